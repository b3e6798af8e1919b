import sys

from headmech.site import main

sys.exit(main())
