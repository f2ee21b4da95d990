"""``mxps launch``: MXNet's real launcher (--launcher local) in a private network namespace.

    PATH=/work/venv/bin:$PATH JOB_KVSTORE=mxps JOB_OUT=... \
        mxps launch -n 2 -s 2 -- python tests/jobs/fault_launch_env.py

``fault_launch_env.py`` records each node's DMLC_* variables and then runs train_job.py
unchanged, which passes ``kvstore='mxps'`` *by name* to gluon.Trainer with one device: the case
MXNet 1.9.1 silently drops (mxnet.model._create_kvstore), so identical weights from workers that
trained on different data prove the plugin really synchronised.  Needs root (namespaces).
"""
import ipaddress
import json
import glob
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster  # noqa: E402

LAUNCH_TIMEOUT = 300
NAMESPACE_NET = ipaddress.ip_network("198.18.0.0/15")
ENV_JOB = os.path.join(cluster.JOBS_DIR, "fault_launch_env.py")

# mxps launch runs the job in a network namespace: the netns tier (root; tests/conftest.py)


def _netns():
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _ours(pid):
    """Namespaces created by the mxps launch process ``pid`` (emunet names them mxps-<pid>-...)."""
    return [n for n in _netns() if n.startswith("mxps-%d-" % pid)]


def _launch(out, log_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    env.update(cluster.QUIET_ENV)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(cluster.train_env("mxps", steps=5))
    env["JOB_OUT"] = out
    argv = [sys.executable, "-m", "mxps_tools.cli", "launch", "-n", "2", "-s", "2", "--",
            "python", ENV_JOB]
    with open(os.path.join(log_dir, "launch.out"), "wb") as fo, \
            open(os.path.join(log_dir, "launch.err"), "wb") as fe:
        # from outside the checkout: mxps and its tools as installed
        p = subprocess.Popen(argv, env=env, cwd=log_dir, stdin=subprocess.DEVNULL,
                             stdout=fo, stderr=fe, start_new_session=True)
    start = time.monotonic()
    timed_out = False
    leftover = []
    try:
        p.wait(LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        if p.poll() is None:
            # SIGTERM: mxps launch tears its namespaces (and the processes in them) down
            os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        leftover = _ours(p.pid)
        for ns in leftover:          # never leave a namespace behind, even on failure
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
    with open(os.path.join(log_dir, "launch.err"), errors="replace") as f:
        err = f.read()
    return p.returncode, time.monotonic() - start, timed_out, leftover, err


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    base = tmp_path_factory.mktemp("launch")
    out = str(base / "out")
    rc, seconds, timed_out, leftover, err = _launch(out, str(base))
    print("\n[mxps launch] 2 workers x 2 servers: rc=%s in %.1f s" % (rc, seconds))
    return {"out": out, "rc": rc, "seconds": seconds, "timed_out": timed_out,
            "leftover": leftover, "stderr": err}


def test_launch_runs_the_job_to_completion(launched):
    assert not launched["timed_out"], "mxps launch still ran after %d s:\n%s" % (
        LAUNCH_TIMEOUT, launched["stderr"][-3000:])
    assert launched["rc"] == 0, launched["stderr"][-3000:]


def test_kvstore_by_name_with_one_device_synchronises_workers(launched):
    assert launched["rc"] == 0, launched["stderr"][-3000:]
    cluster.assert_synchronised(launched["out"], 2, kvstore_type="dist_sync")
    for r in range(2):
        meta = cluster.load_meta(launched["out"], r)
        assert meta["kvstore_requested"] == "mxps" and not meta["kv_object"], meta
        assert meta["devices"] == 1 and meta["api"] == "gluon", meta


def test_every_node_used_the_namespace_address_as_scheduler(launched):
    assert launched["rc"] == 0, launched["stderr"][-3000:]
    envs = {}
    for path in glob.glob(os.path.join(launched["out"], "env_*.json")):
        with open(path) as f:
            envs[os.path.basename(path)] = json.load(f)
    roles = sorted(name.split("_")[1] for name in envs)
    assert roles == ["scheduler", "server", "server", "worker", "worker"], sorted(envs)
    uris = {e["DMLC_PS_ROOT_URI"] for e in envs.values()}
    assert len(uris) == 1, uris
    uri = uris.pop()
    assert ipaddress.ip_address(uri) in NAMESPACE_NET, \
        "the job's scheduler address %s is not the namespace's 198.18.x address" % uri


def test_no_namespace_is_left_behind(launched):
    assert launched["leftover"] == [], \
        "mxps launch left namespaces behind (deleted by the test): %s" % launched["leftover"]
