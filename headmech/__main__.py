"""``python -m headmech``: the same command as ``headmech``."""

import sys

from headmech.cli import main

sys.exit(main())
