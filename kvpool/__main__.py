"""`python -m kvpool serve ...`: the pool daemon (kvpool.pool.cli)."""

import sys

from kvpool.pool.cli import main

sys.exit(main())
