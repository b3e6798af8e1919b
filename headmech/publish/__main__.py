"""``python -m headmech.publish``: the published catalogs of the bundled models."""

import sys

from headmech.publish import main

sys.exit(main())
