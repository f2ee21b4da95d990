"""A server process's ``import mxnet`` (mxps.roles.takeover) leaves out what a server never uses."""
import importlib
import os
import subprocess
import sys
import textwrap

import pytest

from mxps.roles import takeover

MXPS_PKG = os.path.dirname(os.path.dirname(os.path.abspath(takeover.__file__)))


def test_imports_refused_refuses_a_module_in_the_block_and_not_after(tmp_path, monkeypatch):
    (tmp_path / "mxps_refusal_probe.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with takeover.imports_refused(["mxps_refusal_probe"]) as refused:
        assert refused == ["mxps_refusal_probe"]
        with pytest.raises(ImportError):
            importlib.import_module("mxps_refusal_probe")
    assert "mxps_refusal_probe" not in sys.modules
    assert importlib.import_module("mxps_refusal_probe").VALUE == 7
    try:
        # a module already imported is left as it is
        with takeover.imports_refused(["mxps_refusal_probe", "json"]) as refused:
            assert refused == []
            assert importlib.import_module("mxps_refusal_probe").VALUE == 7
        assert sys.modules["mxps_refusal_probe"].VALUE == 7
    finally:
        sys.modules.pop("mxps_refusal_probe", None)


def test_a_servers_mxnet_import_leaves_scikit_learn_out_and_importable():
    pytest.importorskip("sklearn")   # installed by the test extra: then this always runs
    # a fresh interpreter holding mxps's package without running its __init__ (which, in a
    # worker, imports mxnet the usual way), as a server process is before its import of mxnet
    code = textwrap.dedent("""
        import sys, types
        pkg = types.ModuleType("mxps"); pkg.__path__ = [%r]; sys.modules["mxps"] = pkg
        from mxps.roles import takeover
        mx = takeover._import_mxnet_quietly()
        import mxnet.model
        print("sklearn loaded:", "sklearn" in sys.modules)
        print("base:", mxnet.model.BASE_ESTIMATOR.__name__)
        import sklearn.base
        print("importable after:", sklearn.base.BaseEstimator.__name__)
    """ % MXPS_PKG)
    env = dict(os.environ, DMLC_ROLE="server")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "sklearn loaded: False" in p.stdout, p.stdout
    assert "base: object" in p.stdout, p.stdout
    assert "importable after: BaseEstimator" in p.stdout, p.stdout


def test_the_test_jobs_digits_read_without_scikit_learn_are_load_digits(tmp_path, monkeypatch):
    # tests/jobs/train_job.py refuses scikit-learn's import (mxnet.model's optional one, 0.4 s
    # a process) and reads the digits from its package: they must be load_digits' own
    from sklearn.datasets import load_digits    # imported first: the job's refusal is a no-op
    import numpy as np
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "train_job.py")
    for name in [k for k in os.environ if k.startswith("JOB_")]:
        monkeypatch.delenv(name)                  # its defaults (the mlp on dist_sync)
    monkeypatch.setenv("JOB_OUT", str(tmp_path))  # its one required setting, checked on import
    spec = importlib.util.spec_from_file_location("train_job_probe", path)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert sys.modules["sklearn"] is not None
    x, y = load_digits(return_X_y=True)
    order = np.random.RandomState(1234).permutation(len(y))
    got_x, got_y = job.load_data()
    np.testing.assert_array_equal(got_x, (x[order] / 16.0).astype(np.float32))
    np.testing.assert_array_equal(got_y, y[order].astype(np.float32))
    assert got_x.shape == (1797, 64) and got_x.dtype == np.float32
