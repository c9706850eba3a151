"""kvpool's daemon on a known-bad catalog, for the negative controls that need a pool which
breaks one of its guarantees (kvgate.faults.controls). Never the production daemon.

  python -m kvgate.faults.pool serve --catalog NAME <kvpool serve options>
      the same daemon and options as `kvpool serve` (kvpool.pool.cli), with the named catalog
      (kvgate.faults.controls.CATALOG_CONTROLS: forgetful, leaseless, leaky, crossed,
      stale_index; kvgate.faults.race_controls.RACE_CATALOG_CONTROLS: abort_visible,
      lost_wakeup, late_visible, eager_drop, kept_drop, pinned_release, visible_at_reserve,
      pending_leak; kvgate.faults.renew_controls.RENEW_CATALOG_CONTROLS: owner_blind_renew,
      resurrecting_renew, ageless_renew); it says on stderr
      that it is a negative control.
"""

from __future__ import annotations

import argparse
import sys

from kvgate.faults.controls import CATALOG_CONTROLS
from kvgate.faults.race_controls import RACE_CATALOG_CONTROLS
from kvgate.faults.renew_controls import RENEW_CATALOG_CONTROLS
from kvpool.pool.cli import serve, serve_parser

CATALOGS = {**CATALOG_CONTROLS, **RACE_CATALOG_CONTROLS, **RENEW_CATALOG_CONTROLS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.faults.pool", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = serve_parser(sub.add_parser("serve", help="run the daemon on a known-bad catalog"))
    cmd.add_argument("--catalog", required=True, choices=sorted(CATALOGS),
                     help="the known-bad catalog (kvgate.faults.controls, kvgate.faults.race_controls, "
                          "kvgate.faults.renew_controls)")
    args = parser.parse_args(argv)
    print(f"kvgate.faults.pool: NEGATIVE CONTROL: known-bad catalog {args.catalog!r}", file=sys.stderr, flush=True)
    return serve(args, catalog_factory=CATALOGS[args.catalog])


if __name__ == "__main__":
    sys.exit(main())
