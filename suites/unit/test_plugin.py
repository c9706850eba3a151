"""kvgate's pytest plugin, in an inner pytest run: replay key, seeds, profiles, and that it is
opt-in (a project that does not ask for it sees none of it)."""

import os

from kvgate.harness.plugin import LOW_PRIORITY

pytest_plugins = ["pytester"]

TESTS = """
import pytest

def test_plain(test_seed):
    print("SEED", test_seed)

@pytest.mark.fault_corrupt
def test_corrupt():
    pass

@pytest.mark.fault_pool_restart
def test_crash():
    pass


@pytest.mark.timeout(30)
@pytest.mark.fault_timeout
def test_timeout_marker_is_not_confused():
    pass
"""


def test_header_seed_and_profile_selection(pytester):
    pytester.makepyfile(TESTS)
    r = pytester.runpytest("-p", "kvgate.harness.plugin", "-p", "no:randomly", "--kv-seed", "123", "--kv-profile", "transport",
                           "-s")
    r.assert_outcomes(passed=3, deselected=1)
    r.stdout.fnmatch_lines(["*kvgate replay key: --kv-seed=123 --kv-profile=transport*"])
    first = [ln for ln in r.outlines if ln.startswith("SEED")]
    again = pytester.runpytest("-p", "kvgate.harness.plugin", "--kv-seed", "last", "-s")
    again.assert_outcomes(passed=4)
    assert [ln for ln in again.outlines if ln.startswith("SEED")] == first  # same root seed, same test seed


def test_unknown_profile_is_a_usage_error(pytester):
    pytester.makepyfile(TESTS)
    r = pytester.runpytest("-p", "kvgate.harness.plugin", "--kv-profile", "everything")
    assert r.ret != 0
    r.stderr.fnmatch_lines(["*unknown profile*"])


OTHER_PROJECT = """
import pytest
from hypothesis import settings

@pytest.mark.slow
def test_their_slow_test():
    pass

def test_their_hypothesis_profile():
    assert settings().max_examples == 100  # Hypothesis' default, untouched
"""


def test_a_project_that_does_not_ask_for_it_sees_nothing(pytester):
    """Installed, the plugin is registered through its pytest11 entry point, and another
    project's run must not change: no deselection, no skipped slow tests, no Hypothesis
    profile, no header, even with kvgate's options given. (Fails if the plugin acts off.)"""
    from importlib.metadata import entry_points

    assert entry_points(group="pytest11", name="kvgate.harness.plugin"), "kvgate is not installed with its entry point"
    pytester.makepyfile(OTHER_PROJECT)
    for args in ((), ("--kv-seed", "1", "--kv-profile", "transport")):
        r = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider", *args)
        r.assert_outcomes(passed=2)
        assert "kvgate replay key" not in r.stdout.str()
    removed = pytester.runpytest_subprocess("-p", "no:kvgate.harness.plugin", "--kv-seed", "1")
    assert removed.ret != 0
    removed.stderr.fnmatch_lines(["*unrecognized arguments: --kv-seed*"])


def test_a_test_that_asks_for_a_seed_while_it_is_off_is_told_how_to_turn_it_on(pytester):
    pytester.makepyfile("def test_seeded(kv_seed):\n    pass\n")
    r = pytester.runpytest_subprocess("-p", "no:randomly")
    assert r.ret != 0
    assert "--kvgate" in r.stdout.str() + r.stderr.str()


def test_asking_for_it_with_the_flag_or_the_ini(pytester):
    pytester.makepyfile(OTHER_PROJECT.replace("== 100", "== 25"))
    r = pytester.runpytest_subprocess("--kvgate", "-p", "no:randomly")
    r.assert_outcomes(passed=1, skipped=1)
    r.stdout.fnmatch_lines(["*kvgate replay key*"])
    pytester.makeini("[pytest]\nkvgate = true\n")
    r = pytester.runpytest_subprocess("-p", "no:randomly")
    r.assert_outcomes(passed=1, skipped=1)
    r.stdout.fnmatch_lines(["*kvgate replay key*"])


def test_asking_for_it_with_dash_p(pytester):
    pytester.makepyfile(OTHER_PROJECT.replace("== 100", "== 25"))
    r = pytester.runpytest_subprocess("-p", "kvgate.harness.plugin", "-p", "no:randomly")
    r.assert_outcomes(passed=1, skipped=1)  # its slow test skipped, the kvgate profile loaded
    r.stdout.fnmatch_lines(["*kvgate replay key*"])


LIVE_TESTS = {
    "live/test_one.py": "import os, time, pytest\npytestmark = pytest.mark.live\n"
                        "@pytest.mark.parametrize('i', range(3))\ndef test_a(i):\n    time.sleep(1)\n    print('NICE', os.nice(0))\n",
    "live/test_two.py": "import os, time, pytest\npytestmark = pytest.mark.live\n"
                        "@pytest.mark.parametrize('i', range(3))\ndef test_b(i):\n    time.sleep(1)\n    print('NICE', os.nice(0))\n",
    "test_plain.py": "import os, time, pytest\n@pytest.mark.parametrize('i', range(3))\ndef test_c(i):\n"
                     "    print('NICE', os.nice(0))\n",
    # two modules of more tests than the live scope: xdist's loadscope would hand them out first,
    # and the live tests would then run on a worker that ran other tests before them
    "test_many.py": "import pytest\n@pytest.mark.parametrize('i', range(12))\ndef test_d(i):\n    pass\n",
    "test_more.py": "import pytest\n@pytest.mark.parametrize('i', range(12))\ndef test_e(i):\n    pass\n",
}


def _workers(pytester, *ini: str) -> dict[str, set[str]]:
    for path, text in LIVE_TESTS.items():
        pytester.path.joinpath(path).parent.mkdir(exist_ok=True)
        pytester.path.joinpath(path).write_text(text)
    pytester.makeini("[pytest]\nkvgate = true\n" + "".join(f"{line}\n" for line in ini))
    r = pytester.runpytest_subprocess("-n", "2", "--dist", "loadscope", "-v", "-rA")
    r.assert_outcomes(passed=33)
    out: dict[str, set[str]] = {}
    for line in r.outlines:  # "[gw0] PASSED live/test_one.py::test_a[0]"; -rA's sections: the test's NICE print
        if "PASSED" in line and line.startswith("[gw"):
            out.setdefault(line.split("PASSED", 1)[1].strip().split("::")[0], set()).add(line[1:4])
    nice: dict[str, set[int]] = {}
    section = None
    for line in r.outlines:
        if line.startswith("_") and ("test_a[" in line or "test_b[" in line or "test_c[" in line):
            section = "live" if ("test_a[" in line or "test_b[" in line) else "plain"
        elif line.startswith("NICE ") and section:
            nice.setdefault(section, set()).add(int(line.split()[1]))
    out["nice"] = nice  # type: ignore[assignment]
    return out


def test_under_xdist_every_test_of_the_live_paths_runs_on_one_worker(pytester):
    got = _workers(pytester, "kvgate_live_paths = live")
    assert len(got["live/test_one.py"] | got["live/test_two.py"]) == 1, got
    assert got["test_plain.py"].isdisjoint(got["live/test_one.py"]), got  # the rest beside them
    base = os.nice(0)
    assert got["nice"] == {"live": {base}, "plain": {LOW_PRIORITY}}, got["nice"]  # the rest at a low priority


def test_without_live_paths_loadscope_spreads_the_live_modules(pytester):
    """The control: pytest-xdist's own loadscope, one scope per module."""
    got = _workers(pytester)
    assert got["live/test_one.py"] != got["live/test_two.py"], got
    assert got["nice"] == {"live": {os.nice(0)}, "plain": {os.nice(0)}}, got["nice"]  # and nothing lowered


def test_the_live_marks_and_the_live_paths_agree():
    """Every test of this repository marked live lies under the ini's kvgate_live_paths (else
    make test's two workers could start two clusters at once), and every test there is marked live."""
    import subprocess
    import sys

    code = ("import json, pytest\n"
            "class R:\n"
            "    def pytest_collection_finish(self, session):\n"
            "        print('ITEMS', json.dumps([(i.nodeid, 'live' in i.keywords) for i in session.items]))\n"
            "pytest.main(['--co', '-q', '-p', 'no:cacheprovider', 'suites'], plugins=[R()])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("ITEMS "))
    import json

    from kvgate.harness.plugin import live_path

    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    paths = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["kvgate_live_paths"]
    items = json.loads(line.removeprefix("ITEMS "))
    assert len(items) > 500
    wrong = [(nodeid, live) for nodeid, live in items if live != live_path(nodeid, paths)]
    assert not wrong, wrong[:5]
