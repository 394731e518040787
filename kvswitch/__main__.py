import sys

from kvswitch.cli import main

sys.exit(main())
