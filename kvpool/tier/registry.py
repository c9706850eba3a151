"""The network tier's chooser: the backend a tier URL names, by the URL's scheme.

  BACKENDS              scheme -> opener(url, auth, timeout_s) -> Tier:
                          redis, rediss, unix   kvpool.tier.redis.RedisTier (credentials in
                                                the URL: redis://USER:PASSWORD@HOST:PORT/DB,
                                                those of the tenant's ACL user)
                          mooncake              kvpool.tier.mooncake.MooncakeTier.from_url
                                                (Mooncake has no access control: the
                                                records' MAC is all there is)
                        Each opener imports its backend when it is first called, so a
                        replica that names no tier imports neither redis-py nor Mooncake.
  open_tier(url, auth, timeout_s=1.0) -> Tier
                        the tier a URL names, bound to the tenant whose keys `auth` holds
                        (kvpool.tier.record.TierAuth; anything else is a TypeError); a URL of no
                        known scheme is a ValueError naming the URL without its password.

Dependencies run one way: this module imports the interface (kvpool.tier.interface) and the
backends; the backends import the interface; neither imports this module.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.tier.interface import Tier, redact_url
from kvpool.tier.record import TierAuth


def _redis(url: str, auth: TierAuth, timeout_s: float) -> Tier:
    from kvpool.tier.redis import RedisTier

    return RedisTier(url, auth, timeout_s=timeout_s)


def _mooncake(url: str, auth: TierAuth, timeout_s: float) -> Tier:
    from kvpool.tier.mooncake import MooncakeTier

    return MooncakeTier.from_url(url, auth, timeout_s=timeout_s)


BACKENDS: dict[str, Callable[[str, TierAuth, float], Tier]] = {
    "redis": _redis, "rediss": _redis, "unix": _redis, "mooncake": _mooncake,
}


def open_tier(url: str, auth: TierAuth, timeout_s: float = 1.0) -> Tier:
    """The tier a URL names, for the tenant `auth` holds the keys of:
    "redis://[USER:PASSWORD@]HOST:PORT/DB", "rediss://..." or "unix:///path" (Redis; the
    credentials of the tenant's ACL user, restricted to its prefix);
    "mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata" (Mooncake Store; also
    `segment_bytes`, `buffer_bytes`, `protocol`, `devices`, `local_hostname`)."""
    if not isinstance(auth, TierAuth):
        raise TypeError(f"open_tier needs the tenant's TierAuth, got {type(auth).__name__}")
    scheme, sep, _ = url.partition("://")
    opener = BACKENDS.get(scheme) if sep else None
    if opener is None:
        raise ValueError(f"no network tier for {redact_url(url)!r}: redis://HOST:PORT/DB, unix:///path or "
                         "mooncake://HOST:PORT?...")
    return opener(url, auth, timeout_s)
