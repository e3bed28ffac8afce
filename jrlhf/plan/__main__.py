"""``python -m jrlhf.plan``: see jrlhf.cli.plan."""

import sys

from jrlhf.cli.plan import main

sys.exit(main())
