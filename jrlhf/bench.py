"""``python -m jrlhf.bench``: see jrlhf.cli.bench."""

import sys

from jrlhf.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
