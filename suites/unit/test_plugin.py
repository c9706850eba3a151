"""kvgate's pytest plugin, in an inner pytest run: replay key, seeds, profiles."""

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
    r = pytester.runpytest("-p", "no:randomly", "--kv-seed", "123", "--kv-profile", "transport", "-s")
    r.assert_outcomes(passed=3, deselected=1)
    r.stdout.fnmatch_lines(["*kvgate replay key: --kv-seed=123 --kv-profile=transport*"])
    first = [ln for ln in r.outlines if ln.startswith("SEED")]
    again = pytester.runpytest("--kv-seed", "last", "-s")
    again.assert_outcomes(passed=4)
    assert [ln for ln in again.outlines if ln.startswith("SEED")] == first  # same root seed, same test seed


def test_unknown_profile_is_a_usage_error(pytester):
    pytester.makepyfile(TESTS)
    r = pytester.runpytest("--kv-profile", "everything")
    assert r.ret != 0
    r.stderr.fnmatch_lines(["*unknown profile*"])
