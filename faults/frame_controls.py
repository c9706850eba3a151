"""Negative control of the daemon's per-frame bounds (kvpool.pool.connection, kvpool.pool.handlers,
kvpool.pool.protocol): the pool's frame handling before it was bounded. Never the production daemon.

  UnboundedFramesDaemon   a PoolDaemon that decodes requests without the protocol's static
                          bounds (any number of hashes, indexes, slots, digests; any length),
                          skips the handlers' distinctness and namespace checks, accepts
                          frames of up to 64 MiB after a hello whatever the page size, and
                          sends replies of any size. A ReadPages of 4096 repeats of one leased
                          page's index makes it build a reply of 4096 pages.
  python -m kvgate.faults.frame_controls serve <kvpool serve options>
                          that daemon with `kvpool serve`'s options (kvpool.pool.cli); it says on
                          stderr that it is a negative control.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import sys

import msgspec

from kvpool.pool import protocol as P
from kvpool.pool.cli import config_from_args, serve_parser
from kvpool.pool.digest import DigestKind
from kvpool.errors import InvalidRequest, MalformedFrame, PoolError
from kvpool.pool.keys import Namespace
from kvpool.pool.config import PoolConfig
from kvpool.pool.daemon import InsecureRunDir, PoolAlreadyRunning, PoolDaemon

_BY_TAG: dict[str, type] = {cls.__struct_config__.tag: cls for cls in P.Request.__args__}


def decode_unbounded(payload: bytes) -> tuple[int, P.Request]:
    """decode_request without the static bounds: the body's fields are taken as they come
    (msgspec checks constraints when it decodes, not when a struct is built)."""
    env = P._envelope_of(payload)  # noqa: SLF001 - the envelope is the same
    try:
        body = msgspec.msgpack.decode(env.body)
        fields = dict(body)
        cls = _BY_TAG[fields.pop("type")]
        if "ns" in fields:
            fields["ns"] = msgspec.convert(fields["ns"], Namespace)
        if "kind" in fields:
            fields["kind"] = DigestKind(fields["kind"])
        return env.id, cls(**fields)
    except (msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError, ValueError) as exc:
        err = MalformedFrame(f"request body does not decode: {exc}")
        err.request_id = env.id  # type: ignore[attr-defined]
        raise err from exc


class UnboundedFramesDaemon(PoolDaemon):
    """The daemon as it handled frames before their bounds (see the module docstring)."""

    def __init__(self, config: PoolConfig, **kwargs: object):
        super().__init__(dataclasses.replace(config, max_frame=P.DEFAULT_MAX_FRAME), **kwargs)

    def _dispatch(self, session, payload: bytes):  # noqa: ANN001, ANN202
        request_id, op_name = 0, "frame"
        try:
            request_id, op = decode_unbounded(payload)
            op_name = type(op).__name__.lower()
            result = self._apply(session, op)
        except PoolError as err:
            return self._error(getattr(err, "request_id", request_id), op_name, err)
        if inspect.isawaitable(result):
            return self._finish(request_id, op_name, result)
        return self._reply(request_id, op_name, result)

    def _check_bounds(self, op: P.Request) -> None:
        return None  # no distinctness, no namespace bound

    def _reply(self, request_id: int, op_name: str, result: P.Reply) -> bytes:
        self.metrics.requests.labels(op_name, "ok").inc()
        return P.encode_reply(request_id, result)  # of any size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.faults.frame_controls", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub.add_parser("serve", help="run the daemon without its per-frame bounds"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    print("kvgate.faults.frame_controls: NEGATIVE CONTROL: a daemon without its per-frame bounds", file=sys.stderr,
          flush=True)
    try:
        UnboundedFramesDaemon(config_from_args(args)).run(dumpable=args.dumpable)
    except (PoolAlreadyRunning, InsecureRunDir, InvalidRequest) as exc:
        print(f"kvgate.faults.frame_controls: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
