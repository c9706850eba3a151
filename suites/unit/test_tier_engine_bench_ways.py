"""scripts/gpu/tier_engine_bench.py's headline key is its first way's median: that way must be
the engine's own defaults, or the key measures a configuration no replica runs."""

import importlib.util
from pathlib import Path

import pytest

from kvpool.gpu.config import TransferConfig

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("tier_engine_bench", ROOT / "scripts/gpu/tier_engine_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_default_way_is_the_engines_defaults():
    bench = _bench()
    name, config = bench._way(bench.DEFAULT_WAYS.split(",")[0])
    defaults = TransferConfig(block_dim=0)
    assert (config.sketch_impl, config.chunk_bytes, config.fuse_loads, config.install_direct) == (
        defaults.sketch_impl, defaults.chunk_bytes, defaults.fuse_loads, defaults.install_direct), name


def test_a_way_without_direct_installs_staged():
    bench = _bench()
    assert not bench._way("triton-dot:1024")[1].install_direct
    assert bench._way("triton-dot:1024:direct")[1].install_direct
    with pytest.raises(SystemExit):
        bench._way("triton-dot:1024:sideways")
