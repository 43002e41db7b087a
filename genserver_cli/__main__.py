"""`python -m genserver_cli ...` runs the same command as the `genserver` console script."""

import sys

from genserver_cli.main import main

sys.exit(main())
