"""`python -m backplane.cli ...`: the same as the `backplane` command."""

import sys

from backplane.cli.main import main

sys.exit(main())
