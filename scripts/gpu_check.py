"""mxps with GPU workers against native MXNet, on a machine with GPUs and a GPU build of MXNet
1.9.1 (``pip install mxnet-cu112==1.9.1``, or the build matching its CUDA).

Runs tests/jobs/train_job.py (digits, an mlp, 20 steps) as 2 workers x 2 servers on loopback,
every worker on ``--devices`` GPUs (``JOB_CONTEXT=gpu``), with native ``dist_sync`` and with
mxps, update on the servers and on the workers, and with 2bit compression (native pushing then
pulling); each mxps job must end with native's weights (relative L2 per parameter at most
1e-5, as tests/test_equivalence.py asks on CPUs) and its workers agreeing.

    python scripts/gpu_check.py [--devices 2]

Exit status: 0 every check passed, 1 one failed, 2 no GPU here (nothing was run).
"""
import argparse
import os
import sys
import tempfile

import numpy as np

from mxps_tools import jobs

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_JOB = os.path.join(HERE, "..", "tests", "jobs", "train_job.py")

CASES = [("update on servers", {}), ("update on workers", {"JOB_UPDATE_ON_KVSTORE": "0"}),
         ("2bit", {"JOB_COMPRESSION": "2bit:0.0625", "JOB_PUSH_PULL": "1"})]


def gpus():
    import mxnet as mx
    try:
        return mx.context.num_gpus()
    except mx.base.MXNetError:
        return 0


def train(kvstore, env, devices, out):
    env = dict(env, JOB_KVSTORE=kvstore, JOB_CONTEXT="gpu", JOB_DEVICES=str(devices),
               JOB_OUT=out)
    if kvstore == "mxps":
        env.pop("JOB_PUSH_PULL", None)          # mxps compresses in pushpull
        env["MXPS_SECRET"] = os.urandom(32).hex()
    result = jobs.Job([TRAIN_JOB], 2, 2, env=env, timeout=600, cpu_interval=None).run()
    if not result.ok:
        raise SystemExit("%s failed:\n%s" % (kvstore, result.describe()[-3000:]))
    weights = [dict(np.load(os.path.join(out, "weights_rank%d.npz" % r))) for r in (0, 1)]
    for k in weights[0]:
        if not np.array_equal(weights[0][k], weights[1][k]):
            raise SystemExit("%s: the workers disagree on %s" % (kvstore, k))
    return weights[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=None, help="GPUs per worker (default: "
                   "2 if the machine has 2, else 1)")
    a = p.parse_args(argv)
    n = gpus()
    if n == 0:
        print("no GPU: mxnet.context.num_gpus() is 0 (a CPU build of MXNet, or no device); "
              "nothing was run")
        return 2
    devices = a.devices or min(2, n)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="mxps-gpu-") as root:
        for name, env in CASES:
            native = train("dist_sync", env, devices, os.path.join(root, name + "-native"))
            mine = train("mxps", env, devices, os.path.join(root, name + "-mxps"))
            worst = max(np.linalg.norm(mine[k] - native[k]) / max(np.linalg.norm(native[k]),
                                                                  1e-12) for k in native)
            ok = worst <= 1e-5
            failed += not ok
            print("%-18s %d GPU(s) per worker: max relative difference %.2e  %s"
                  % (name, devices, worst, "ok" if ok else "FAILED"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
