"""``python -m jrlhf.launch``: see jrlhf.cli.launch."""

import sys

from jrlhf.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
