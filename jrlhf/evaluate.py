"""``python -m jrlhf.evaluate``: see jrlhf.cli.evaluate."""

import sys

from jrlhf.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
