"""kvgate's pytest plugin. Installed, it is registered through the `pytest11` entry point
(named as the module), and it stays inert until a run turns it on: `--kvgate` on the command line,
`kvgate = true` in the ini file (this repository's pyproject.toml), or `-p kvgate.harness.plugin`.
Off, it only adds its options (all named --kv*); it loads no Hypothesis profile, registers
no marker, deselects or skips nothing and prints nothing, so installing kvgate changes
nothing in another project's pytest run (`-p no:kvgate.harness.plugin` removes even the options).

Options:
  --kvgate           turn the plugin on for this run
  --kv-seed N|last   root seed of the run; `last` reuses the previous run's seed
                     (kept in pytest's cache). Default: drawn from the OS and printed.
  --kv-slow          also run tests marked `slow` (deeper Hypothesis runs, longer workloads)
  --kv-report DIR    keep live clusters' logs, history and reports under DIR
  --kv-profile NAME  which fault kinds run (kvgate.faults.schedule.PROFILES: transport, eviction,
                     crash, all); a test marked with a fault kind outside it is deselected
Markers: slow, live, gpu and `fault_<kind>` for each fault kind (kvgate.faults.schedule.KINDS),
registered here (prefixed: `timeout` is pytest-timeout's).
Ini `kvgate_live_paths`: under pytest-xdist with `--dist loadscope`, every test under these paths
is one scope (LIVE_SCOPE): one worker runs them all, in collection order (the replicas a session
or module starts are started once, never two clusters at once), the other workers the rest,
module by module, at a low priority (nice 10: the replicas get most of the cores when they
compute). (pytest-xdist's own xdist_group marker does not group on pytest 9.2: its worker
renames a test's node id through an attribute pytest 9.2 no longer reads; pytest-xdist#1386.)
Fixtures:
  kv_seed            the root seed (int)
  test_seed          a per-test seed derived from the root seed and the test's node id,
                     so one test replays alone with the same randomness.
The report header prints the replay key: seed and commit.
"""

from __future__ import annotations

import hashlib
import os
import secrets

import pytest

SEED_KEY = pytest.StashKey[int]()
CACHE_KEY = "kvgate/last-seed"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvgate")
    group.addoption("--kvgate", action="store_true", default=False, help="turn kvgate's plugin on for this run")
    parser.addini("kvgate", type="bool", default=False, help="turn kvgate's plugin on (as --kvgate)")
    parser.addini("kvgate_live_paths", type="linelist", default=[],
                  help="test paths whose tests start live replicas: under pytest-xdist's --dist loadscope "
                       "one worker runs them all, in order, and the others the rest beside them")
    group.addoption("--kv-seed", default=None, help="root seed: an integer, or 'last' for the previous run's")
    group.addoption("--kv-slow", action="store_true", default=False, help="also run tests marked slow")
    group.addoption("--kv-report", default=None, metavar="DIR",
                    help="keep live clusters' logs, history and reports under DIR")
    group.addoption("--kv-profile", default="all", metavar="NAME",
                    help="fault kinds to run (kvgate.faults.schedule.PROFILES); tests marked with other kinds are deselected")


def _hypothesis_profiles(slow: bool) -> None:
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # hypothesis is a dev dependency; the plugin works without it
        return
    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("kvgate", max_examples=25, stateful_step_count=30, **common)
    settings.register_profile("kvgate-slow", max_examples=400, stateful_step_count=80, **common)
    settings.load_profile("kvgate-slow" if slow else "kvgate")


_MARKERS = (
    "slow: deeper runs (more Hypothesis examples, longer workloads); selected with --kv-slow",
    "live: starts real vLLM replicas",
    "gpu: needs an NVIDIA GPU; skipped where there is none",
)
_ON_KEY = pytest.StashKey[bool]()


def enabled(config: pytest.Config) -> bool:
    """Whether this run turned the plugin on (--kvgate, the ini's `kvgate`, or -p by name)."""
    named = {p for p in (config.option.plugins or []) if not p.startswith("no:")}
    return bool(config.getoption("--kvgate") or config.getini("kvgate")
                or named & {"kvgate.harness.plugin"})


def pytest_configure(config: pytest.Config) -> None:
    on = enabled(config)
    config.stash[_ON_KEY] = on
    if not on:
        return
    from kvgate.faults.schedule import KINDS, PROFILES

    _hypothesis_profiles(config.getoption("--kv-slow"))
    for line in _MARKERS:
        config.addinivalue_line("markers", line)
    for kind, (site, heal) in KINDS.items():
        config.addinivalue_line("markers", f"fault_{kind}: injects the {kind} fault at {site} (heal: {heal})")
    if config.getoption("--kv-profile") not in PROFILES:
        raise pytest.UsageError(f"--kv-profile: unknown profile {config.getoption('--kv-profile')!r}; "
                                f"known: {sorted(PROFILES)}")
    raw = config.getoption("--kv-seed")
    worker_seed = getattr(config, "workerinput", {}).get("kv_seed")
    if worker_seed is not None:
        seed = int(worker_seed)
    elif raw == "last":
        cache = getattr(config, "cache", None)
        seed = cache.get(CACHE_KEY, None) if cache is not None else None
        if seed is None:
            raise pytest.UsageError("--kv-seed=last: no previous seed in the cache")
    elif raw is not None:
        try:
            seed = int(raw)
        except ValueError as exc:
            raise pytest.UsageError(f"--kv-seed takes an integer or 'last', got {raw!r}") from exc
    else:
        seed = secrets.randbits(32)
    config.stash[SEED_KEY] = seed
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks(), "kvgate-xdist")
    if getattr(config, "cache", None) is not None and worker_seed is None:
        config.cache.set(CACHE_KEY, seed)


LIVE_SCOPE = "kvgate-live"
LOW_PRIORITY = 10  # the nice value of a worker running the tests beside the live ones
_NICED_KEY = pytest.StashKey[bool]()


def live_path(nodeid: str, paths: list[str]) -> bool:
    """Whether a test's node id lies under one of the ini's kvgate_live_paths."""
    where = nodeid.split("::", 1)[0]
    return any(where == p or where.startswith(p.rstrip("/") + "/") for p in paths)


class _XdistHooks:
    """Registered only where pytest-xdist is loaded: hands the root seed to workers, and under
    `--dist loadscope` schedules every test under the ini's kvgate_live_paths as one scope."""

    @staticmethod
    def pytest_configure_node(node) -> None:  # noqa: ANN001
        node.workerinput["kv_seed"] = node.config.stash[SEED_KEY]
        node.workerinput["kv_live_scope"] = bool(node.config.getoption("dist") == "loadscope"
                                                 and node.config.getini("kvgate_live_paths"))

    @staticmethod
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(item: pytest.Item) -> None:
        """Under the live scope, a worker that runs a test outside the live paths lowers its
        priority (and its children's): the live worker's replicas get most of the cores
        when they compute, the rest runs in what they leave."""
        config = item.config
        if not getattr(config, "workerinput", {}).get("kv_live_scope") or config.stash.get(_NICED_KEY, False):
            return
        if not live_path(item.nodeid, config.getini("kvgate_live_paths")):
            os.nice(LOW_PRIORITY - os.nice(0))
            config.stash[_NICED_KEY] = True

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):  # noqa: ANN001, ANN205
        paths = config.getini("kvgate_live_paths")
        if config.getoption("dist") != "loadscope" or not paths:
            return None
        from xdist.scheduler import LoadScopeScheduling

        class LiveScopeScheduling(LoadScopeScheduling):
            """pytest-xdist's loadscope (a module's tests on one worker), with every live test in
            one scope: one worker runs them all, in collection order."""

            def _split_scope(self, nodeid: str) -> str:
                return LIVE_SCOPE if live_path(nodeid, paths) else super()._split_scope(nodeid)

            def _assign_work_unit(self, node) -> None:  # noqa: ANN001
                # the live scope first, whatever the order of the rest (loadscope puts the
                # largest scopes first): the first worker to ask runs nothing before it
                if LIVE_SCOPE in self.workqueue:
                    self.workqueue.move_to_end(LIVE_SCOPE, last=False)
                super()._assign_work_unit(node)

        return LiveScopeScheduling(config, log)


def pytest_report_header(config: pytest.Config) -> str | None:
    if not config.stash.get(_ON_KEY, False):
        return None
    return (f"kvgate replay key: --kv-seed={config.stash[SEED_KEY]} --kv-profile={config.getoption('--kv-profile')} "
            f"commit={_commit()}")


def _commit() -> str:
    from kvgate.harness.provenance import provenance

    prov = provenance()
    return prov["short"] + ("" if prov["clean"] else "+dirty")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.stash.get(_ON_KEY, False):
        return
    from kvgate.faults.schedule import KINDS, PROFILES

    selected = set(PROFILES[config.getoption("--kv-profile")])
    keep, drop = [], []
    for item in items:
        kinds = {m.name.removeprefix("fault_") for m in item.iter_markers() if m.name.removeprefix("fault_") in KINDS
                 and m.name.startswith("fault_")}
        (drop if kinds - selected else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if config.getoption("--kv-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --kv-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def derive_seed(root: int, name: str) -> int:
    digest = hashlib.blake2b(f"{root}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@pytest.fixture(scope="session")
def kv_seed(request: pytest.FixtureRequest) -> int:
    if not request.config.stash.get(_ON_KEY, False):
        raise pytest.UsageError("kv_seed: kvgate's plugin is off; turn it on with --kvgate or `kvgate = true` in the ini")
    return request.config.stash[SEED_KEY]


@pytest.fixture
def test_seed(request: pytest.FixtureRequest, kv_seed: int) -> int:
    return derive_seed(kv_seed, request.node.nodeid)
