"""`python -m kvrecover` runs the command line."""

import sys

from kvrecover.cli import main

sys.exit(main())
