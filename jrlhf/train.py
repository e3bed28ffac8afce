"""``python -m jrlhf.train``: see jrlhf.cli.train."""

import sys

from jrlhf.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
