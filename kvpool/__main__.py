"""`python -m kvpool serve ...` / `python -m kvpool keeper ...` (kvpool.cli)."""

import sys

from kvpool.cli import main

sys.exit(main())
