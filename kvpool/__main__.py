"""`python -m kvpool serve ...`: the pool daemon (kvpool.cli)."""

import sys

from kvpool.cli import main

sys.exit(main())
