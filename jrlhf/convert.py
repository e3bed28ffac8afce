"""``python -m jrlhf.convert``: see jrlhf.cli.convert."""

import sys

from jrlhf.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
