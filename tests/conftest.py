"""The test tiers, and the session report of native reference runs that had to be re-run.

Every test has exactly one tier, by what it needs to run:

- ``unit``: no processes, no sockets beyond an in-process pair, no root: the quick loop
  (``python -m pytest -m unit``);
- ``cluster``: jobs of several processes on loopback (``tests/cluster.py``);
- ``netns``: root, for network namespaces and the emulated network (``mxps_tools.emunet``).

A test's tier is its own mark (``@pytest.mark.netns``) or else its file's (``FILE_TIERS``).
``slow`` marks, besides, what takes minutes (fuzzing, the failure matrix, the bench, the
install): ``-m "not slow"`` leaves it out.  A ``netns`` test run without root fails, naming
the reason, unless the run leaves the tier out (``-m "not netns"``).  Files none of whose
tests the ``-m`` expression can select are not even imported, so ``-m unit`` imports neither
the job runner nor psutil.

The README's first command (``readme_first_command``, tests/readme_run.py) takes minutes,
mostly waiting on slow emulated links: when a selected test uses it, it starts in the
background as soon as the tests are collected, and the tests that read its result run last.
"""
import itertools
import os
import re
import shutil
import sys

import pytest
from _pytest.mark.expression import Expression

#: the session fixture of the README's first command (tests/readme_run.py), started in the
#: background once the tests are collected if a selected test uses it
FIRST_COMMAND = "readme_first_command"
_BACKGROUND = pytest.StashKey()

TIERS = ("unit", "cluster", "netns")

pytest_plugins = ["pytester"]     # tests/test_tiers.py runs small suites in-process

#: each test file's tier; a test marked with another tier has that one
FILE_TIERS = {
    "test_accum.py": "unit",
    "test_adaptive_plan.py": "unit",
    "test_async.py": "cluster",
    "test_checkpoints.py": "unit",
    "test_compression.py": "unit",
    "test_compression_jobs.py": "cluster",
    "test_auth.py": "cluster",
    "test_bench.py": "cluster",
    "test_emunet.py": "netns",
    "test_engine.py": "unit",
    "test_equivalence.py": "cluster",
    "test_failures.py": "cluster",
    "test_fuzz.py": "cluster",
    "test_incast.py": "cluster",
    "test_input_guards.py": "cluster",
    "test_install.py": "cluster",
    "test_launcher.py": "netns",
    "test_ltp.py": "cluster",
    "test_ltp_close.py": "unit",
    "test_ltp_intake.py": "unit",
    "test_ltp_kernels.py": "unit",
    "test_ltp_others.py": "cluster",
    "test_ltp_rate.py": "unit",
    "test_ltp_share.py": "unit",
    "test_metrics.py": "cluster",
    "test_native_baseline.py": "cluster",
    "test_no_pickle.py": "unit",
    "test_noise.py": "cluster",
    "test_noise_scale.py": "unit",
    "test_patching.py": "cluster",
    "test_pairs.py": "cluster",
    "test_plan.py": "unit",
    "test_push_gate.py": "unit",
    "test_replan.py": "cluster",
    "test_divert.py": "cluster",
    "test_slow_watch.py": "unit",
    "test_scheduler_state.py": "unit",
    "test_server_state.py": "unit",
    "test_server_bench.py": "cluster",
    "test_simulate.py": "unit",
    "test_sparse.py": "cluster",
    "test_ssh_launch.py": "netns",
    "test_states.py": "cluster",
    "test_store_rows.py": "unit",
    "test_store_server.py": "cluster",
    "test_study_ltp.py": "cluster",
    "test_study_wsp.py": "cluster",
    "test_table_init.py": "cluster",
    "test_takeover.py": "cluster",
    "test_tiers.py": "unit",
    "test_trace.py": "cluster",
    "test_typed.py": "unit",
    "test_wire.py": "unit",
    "test_wsp.py": "cluster",
}

#: what the netns tier needs besides root (scripts/test-deps.sh installs the packages)
NETNS_TOOLS = ("ip", "tc", "nft", "ethtool")


def _marks_in(path):
    """The tiers named in a test file's text, and whether it marks anything slow."""
    with open(path) as f:
        text = f.read()
    return set(re.findall(r"mark\.(%s)\b" % "|".join(TIERS), text)), "mark.slow" in text


def pytest_ignore_collect(collection_path, config):
    """Skip importing a test file none of whose tests ``-m`` can select."""
    name = collection_path.name
    expr = config.getoption("markexpr")
    if not expr or name not in FILE_TIERS:
        return None
    tiers, slow = _marks_in(str(collection_path))
    tiers.add(FILE_TIERS[name])
    compiled = Expression.compile(expr)
    for tier, is_slow in itertools.product(tiers, (False, True) if slow else (False,)):
        marks = {tier, "slow"} if is_slow else {tier}
        if compiled.evaluate(lambda m: m in marks):
            return None
    return True


def pytest_collection_modifyitems(config, items):
    for item in items:
        own = [m.name for m in item.iter_markers() if m.name in TIERS]
        if len(set(own)) > 1:
            raise pytest.UsageError("%s has more than one tier: %s" % (item.nodeid, own))
        if own:
            continue
        tier = FILE_TIERS.get(item.path.name)
        if tier is None:
            raise pytest.UsageError("%s: its file has no tier in tests/conftest.py FILE_TIERS"
                                    % item.nodeid)
        item.add_marker(tier)
    # the tests that wait for the README's first command go last: it runs meanwhile
    items[:] = [i for i in items if FIRST_COMMAND not in getattr(i, "fixturenames", ())] + \
        [i for i in items if FIRST_COMMAND in getattr(i, "fixturenames", ())]


def pytest_collection_finish(session):
    if session.config.option.collectonly or netns_missing() is not None:
        return
    if any(FIRST_COMMAND in getattr(item, "fixturenames", ()) for item in session.items):
        import readme_run
        session.config.stash[_BACKGROUND] = readme_run.Background()


def pytest_sessionfinish(session):
    background = session.config.stash.get(_BACKGROUND, None)
    if background is not None:
        background.stop()


@pytest.fixture(scope="session")
def readme_first_command(request):
    """The README's first command, run verbatim in a fresh clone (tests/readme_run.py)."""
    background = request.config.stash.get(_BACKGROUND, None)
    if background is None:          # not started at collection (no other hook ran): now
        import readme_run
        background = request.config.stash[_BACKGROUND] = readme_run.Background()
    return background.result()


def netns_missing():
    """Why the netns tier cannot run here, or None."""
    if os.geteuid() != 0:
        return "it needs root (network namespaces, tc, nft)"
    missing = [t for t in NETNS_TOOLS if shutil.which(t) is None]
    if missing:
        return ("%s not installed: run `bash scripts/test-deps.sh` (Debian packages)"
                % ", ".join(missing))
    return None


def pytest_runtest_setup(item):
    if item.get_closest_marker("netns") is not None:
        why = netns_missing()
        if why is not None:
            pytest.fail("%s is in the netns tier and %s; to run only the tiers without it: "
                        "python -m pytest -m 'not netns'" % (item.nodeid, why), pytrace=False)


def pytest_terminal_summary(terminalreporter):
    cluster = sys.modules.get("cluster")
    cache = getattr(cluster, "_JOB_CACHE", None)
    if cache is not None and cache.retried:
        terminalreporter.section("native reference runs re-run after failing validation")
        for note in cache.retried:
            terminalreporter.write_line(note)
