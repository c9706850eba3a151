"""kvpool's command (console script `kvpool`, or `python -m kvpool`): one subcommand per process
kvpool runs.

  kvpool serve ...    the pool daemon (kvpool.pool.cli)
  kvpool keeper ...   a GPU keeper: one GPU's tier and its control plane (kvpool.gpu.cli)

  build_parser()      the parser of both; main(argv=None) -> exit status.
Here because it is the one place above both: kvpool.pool knows nothing of kvpool.gpu.
"""

from __future__ import annotations

import argparse
import sys

from kvpool.gpu.cli import keeper_parser, main_keeper
from kvpool.pool.cli import serve, serve_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="kvpool: a shared pool of KV blocks (host memory, "
                                                                "and a GPU tier above it)")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub.add_parser("serve", help="run a pool daemon in the foreground"))
    keeper_parser(sub.add_parser("keeper", help="run one GPU's keeper (the GPU tier) in the foreground"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "keeper":
        return main_keeper(args)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
