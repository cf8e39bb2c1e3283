import sys

from eaglet.cli import main

sys.exit(main())
