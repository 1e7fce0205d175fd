"""`python -m kvrecover` runs the command line."""

import sys

from kvrecover.entrypoints.cli.main import main

sys.exit(main())
