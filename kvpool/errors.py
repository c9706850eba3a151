"""Typed outcomes and errors of the pool.

  MissCause   exactly one per failed lookup or load; a hit has none. IN_FLIGHT only
              answers a lookup that was asked to wait for pending publishes.
  ErrorCode   the wire-level error codes a daemon answers with.
  PoolError   the root of every exception kvpool raises; each subclass maps to one
              ErrorCode so an error crosses the wire and is re-raised as the same type.
"""

from __future__ import annotations

import enum


class MissCause(enum.StrEnum):
    """Why a block was not served from the pool. Counted separately, never merged."""

    NEVER_PUBLISHED = "never_published"  # no committed entry (or another tenant's)
    EVICTED = "evicted"  # it was committed, then evicted (a ghost remembers it)
    INCOMPATIBLE = "incompatible"  # same tokens, a different namespace field
    TRANSPORT_ERROR = "transport_error"  # the daemon or the socket failed mid-load
    CORRUPT = "corrupt"  # the bytes read do not match the digest taken at publish
    TIMEOUT = "timeout"  # the load did not finish within its deadline
    THROTTLED = "throttled"  # a per-client or global load limit was reached
    IN_FLIGHT = "in_flight"  # a publish of the block was still in flight when the lookup's wait ran out


class ErrorCode(enum.StrEnum):
    MALFORMED = "malformed"  # the frame did not decode into a known message
    OVERSIZED = "oversized"  # the frame's length prefix exceeds the daemon's limit
    WRONG_VERSION = "wrong_version"  # protocol version not served by this daemon
    UNAUTHENTICATED = "unauthenticated"  # no hello yet, or a bad tenant token
    BUSY = "busy"  # the daemon's bounded request queue is full
    INVALID = "invalid"  # well-formed but semantically wrong (unknown id, bad size)
    NO_CAPACITY = "no_capacity"  # no page could be reserved (all leased / reserved)
    LEASE_LOST = "lease_lost"  # the lease was released or its pages were reused
    INTERNAL = "internal"  # a daemon bug; the message says where


class PoolError(Exception):
    """Root of kvpool's exceptions."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class MalformedFrame(PoolError):
    code = ErrorCode.MALFORMED


class OversizedFrame(PoolError):
    code = ErrorCode.OVERSIZED


class WrongVersion(PoolError):
    code = ErrorCode.WRONG_VERSION


class Unauthenticated(PoolError):
    code = ErrorCode.UNAUTHENTICATED


class Busy(PoolError):
    code = ErrorCode.BUSY


class InvalidRequest(PoolError):
    code = ErrorCode.INVALID


class NoCapacity(PoolError):
    code = ErrorCode.NO_CAPACITY


class LeaseLost(PoolError):
    code = ErrorCode.LEASE_LOST


class InternalError(PoolError):
    code = ErrorCode.INTERNAL


class TransportError(PoolError):
    """Client side: the connection to the daemon failed (reset, EOF, refused)."""


class PoolTimeout(PoolError):
    """Client side: a reply did not arrive within the deadline."""


class CorruptPage(PoolError):
    """Client side: a page's bytes do not match the digest taken at publish."""


class RenewRefused(PoolError):
    """Client side: the pool refused to renew a reservation or lease the client is still
    working on (expired, unknown, or not this session's; kvpool.pool.records.RenewRefusal).
    What it held may already be reused: a publish ends as a failed commit does."""


class ArenaError(PoolError):
    """The shared-memory arena could not be created, attached or addressed."""


_BY_CODE: dict[ErrorCode, type[PoolError]] = {
    cls.code: cls
    for cls in (
        MalformedFrame,
        OversizedFrame,
        WrongVersion,
        Unauthenticated,
        Busy,
        InvalidRequest,
        NoCapacity,
        LeaseLost,
        InternalError,
    )
}


def error_from_code(code: ErrorCode | str, message: str) -> PoolError:
    """The exception a client raises for a daemon's error reply."""
    return _BY_CODE[ErrorCode(code)](message)


class UntrustedPool(TransportError):
    """Client side: the process listening at a pool's Unix socket runs as a user the
    client does not trust (SO_PEERCRED); nothing, not the hello's token, was sent to it."""
