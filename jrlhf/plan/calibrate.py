"""``python -m jrlhf.plan.calibrate``: see jrlhf.cli.calibrate."""

import sys

from jrlhf.cli.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
