import sys

from headmech.publish.site import main

sys.exit(main())
