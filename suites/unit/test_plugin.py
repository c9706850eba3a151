"""kvgate's pytest plugin, in an inner pytest run: replay key, seeds, profiles, and that it is
opt-in (a project that does not ask for it sees none of it)."""

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
    r = pytester.runpytest("-p", "harness.plugin", "-p", "no:randomly", "--kv-seed", "123", "--kv-profile", "transport",
                           "-s")
    r.assert_outcomes(passed=3, deselected=1)
    r.stdout.fnmatch_lines(["*kvgate replay key: --kv-seed=123 --kv-profile=transport*"])
    first = [ln for ln in r.outlines if ln.startswith("SEED")]
    again = pytester.runpytest("-p", "harness.plugin", "--kv-seed", "last", "-s")
    again.assert_outcomes(passed=4)
    assert [ln for ln in again.outlines if ln.startswith("SEED")] == first  # same root seed, same test seed


def test_unknown_profile_is_a_usage_error(pytester):
    pytester.makepyfile(TESTS)
    r = pytester.runpytest("-p", "harness.plugin", "--kv-profile", "everything")
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
    """Installing kvgate must not change another project's run: no options, no deselection,
    no skipped slow tests, no Hypothesis profile. (Fails if the plugin auto-loads.)"""
    pytester.makepyfile(OTHER_PROJECT)
    r = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    r.assert_outcomes(passed=2)
    assert "kvgate replay key" not in r.stdout.str()
    unknown = pytester.runpytest_subprocess("--kv-seed", "1")
    assert unknown.ret != 0
    unknown.stderr.fnmatch_lines(["*unrecognized arguments: --kv-seed*"])


def test_asking_for_it_with_dash_p(pytester):
    pytester.makepyfile(OTHER_PROJECT.replace("== 100", "== 25"))
    r = pytester.runpytest_subprocess("-p", "harness.plugin", "-p", "no:randomly")
    r.assert_outcomes(passed=1, skipped=1)  # its slow test skipped, the kvgate profile loaded
    r.stdout.fnmatch_lines(["*kvgate replay key*"])
