"""``python -m jrlhf.generate``: see jrlhf.cli.generate."""

import sys

from jrlhf.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
