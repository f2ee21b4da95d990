"""The test tiers of tests/conftest.py: what each run selects, and what it refuses."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

NETNS_TEST = """
import pytest

@pytest.mark.netns
def test_needs_a_namespace():
    pass

@pytest.mark.unit
def test_needs_nothing():
    pass
"""


@pytest.fixture
def tiers(pytester):
    """A pytester directory with this suite's conftest.py (its tiers and checks)."""
    with open(os.path.join(HERE, "conftest.py")) as f:
        pytester.makeconftest(f.read())
    return pytester


def test_a_netns_test_run_without_root_fails_naming_the_reason(tiers, monkeypatch):
    tiers.makepyfile(test_ns=NETNS_TEST)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    result = tiers.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)       # failed in its setup
    result.stdout.fnmatch_lines(["*test_needs_a_namespace is in the netns tier and it needs "
                                 "root*pytest -m 'not netns'*"])


def test_a_run_that_leaves_the_netns_tier_out_needs_no_root(tiers, monkeypatch):
    tiers.makepyfile(test_ns=NETNS_TEST)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    result = tiers.runpytest_inprocess("-p", "no:cacheprovider", "-m", "not netns")
    result.assert_outcomes(passed=1, deselected=1)


def test_the_tests_that_read_the_readmes_first_command_are_collected_last(tiers):
    tiers.makepyfile(test_a="""
import pytest

@pytest.fixture
def readme_first_command():
    return None

@pytest.fixture
def read_it(readme_first_command):
    return readme_first_command

@pytest.mark.unit
def test_reads_it(read_it):
    pass

@pytest.mark.unit
def test_first():
    pass
""", test_b="""
import pytest

@pytest.mark.unit
def test_second():
    pass
""")
    # (--collect-only: the command itself never starts)
    result = tiers.runpytest_inprocess("-p", "no:cacheprovider", "--collect-only", "-q")
    ids = [ln for ln in result.stdout.lines if "::" in ln]
    assert ids == ["test_a.py::test_first", "test_b.py::test_second", "test_a.py::test_reads_it"]


def test_a_test_in_two_tiers_is_refused(tiers):
    tiers.makepyfile(test_two="""
import pytest

@pytest.mark.unit
@pytest.mark.cluster
def test_both():
    pass
""")
    result = tiers.runpytest_inprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "has more than one tier" in result.stderr.str() + result.stdout.str()


def test_a_test_without_a_tier_is_refused(tiers):
    tiers.makepyfile(test_untiered="def test_where():\n    pass\n")
    result = tiers.runpytest_inprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "has no tier" in result.stderr.str() + result.stdout.str()


@pytest.mark.cluster
def test_the_unit_tier_imports_neither_the_job_runner_nor_the_cluster_helpers():
    """``-m unit`` does not even import the files of the other tiers (MXNet itself imports
    psutil, so that is no sign; the tools' job runner is)."""
    code = ("import sys, pytest\n"
            "rc = pytest.main(['-m', 'unit', '--collect-only', '-q', '-p', 'no:cacheprovider',"
            " %r])\n"
            "print('IMPORTED', sorted(m for m in ('cluster', 'mxps_tools.jobs', "
            "'mxps_tools.emunet') if m in sys.modules))\n"
            "sys.exit(rc)\n" % HERE)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(HERE))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "IMPORTED []" in run.stdout, run.stdout[-3000:]
    collected = [ln for ln in run.stdout.splitlines() if "::" in ln]
    assert len(collected) > 500, run.stdout[-3000:]
    assert not [ln for ln in collected if ln.startswith(("tests/test_bench", "tests/test_fuzz",
                                                         "tests/test_equivalence"))]
