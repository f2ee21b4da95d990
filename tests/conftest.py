"""Session report: native reference runs that had to be re-run (see cluster.native_dist_sync)."""
import cluster


def pytest_terminal_summary(terminalreporter):
    cache = cluster._JOB_CACHE
    if cache is not None and cache.retried:
        terminalreporter.section("native reference runs re-run after failing validation")
        for note in cache.retried:
            terminalreporter.write_line(note)
