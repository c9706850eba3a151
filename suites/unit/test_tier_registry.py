"""The network tier's chooser (kvpool.tier.registry): a URL's scheme picks the backend,
imported only when a URL names it; a URL of no known scheme, or keys that are not a
TierAuth, are refused before any backend is touched."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool.tier.record import TierAuth
from kvpool.tier.registry import BACKENDS, open_tier

AUTH = TierAuth.from_secret("default", b"s" * 16)


def test_every_scheme_of_the_interface_has_a_backend():
    assert set(BACKENDS) == {"redis", "rediss", "unix", "mooncake"}


def test_an_unknown_scheme_is_refused_without_its_password():
    with pytest.raises(ValueError, match="no network tier") as exc:
        open_tier("memcache://user:hunter2@h:1", AUTH)
    assert "hunter2" not in str(exc.value)
    with pytest.raises(ValueError, match="no network tier"):
        open_tier("just-a-host:6379", AUTH)


def test_keys_other_than_a_tier_auth_are_refused():
    with pytest.raises(TypeError, match="TierAuth"):
        open_tier("redis://h:1/0", b"secret")  # type: ignore[arg-type]


def test_choosing_imports_no_backend_until_a_url_names_it():
    code = ("import sys, kvpool.tier.registry\n"
            "print(sorted(m for m in ('kvpool.tier.redis', 'kvpool.tier.mooncake', 'redis', 'mooncake') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
