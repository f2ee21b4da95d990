"""Test accuracy on scikit-learn's digits with gradient compression, native and mxps.

Every run is ``mxps_tools.noise_job`` (the label-noise study's job, no noise: the digits'
train/test split, an mlp, SGD with momentum, 3 workers x 3 servers on loopback, the Trainer on
the kvstore) for each system and seed, systems interleaved; mxps jobs get a fresh job secret.
Native MXNet refuses compression in pushpull, so its jobs push then pull
(``mxps_tools.compressed``); mxps's keep the Trainer's pushpull.

    python scripts/compression_accuracy.py --json result.json
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

from mxps_tools import jobs
from mxps_tools.bench import job_secret_env

SYSTEMS = [("native", "dist_sync", ""), ("mxps", "mxps", ""),
           ("native 2bit 0.5", "dist_sync", "2bit:0.5"), ("mxps 2bit 0.5", "mxps", "2bit:0.5"),
           ("native 2bit 0.05", "dist_sync", "2bit:0.05"),
           ("mxps 2bit 0.05", "mxps", "2bit:0.05"), ("mxps 1bit 0", "mxps", "1bit:0")]


def run(name, kvstore, compression, seed, a, root):
    out = os.path.join(root, "%s-%d" % (name.replace(" ", "_"), seed))
    argv = ["-m", "mxps_tools.noise_job", "--out", out, "--kvstore", kvstore, "--model",
            a.model, "--epochs", a.epochs, "--seed", seed, "--batch", a.batch, "--lr", a.lr]
    if compression:
        argv += ["--compression", compression]
    env = job_secret_env({}) if kvstore.startswith("mxps") else {}
    result = jobs.Job(argv, a.workers, a.servers, env=env, timeout=600,
                      log_dir=os.path.join(out, "logs"), cpu_interval=None).run()
    if not result.ok:
        raise SystemExit("%s seed %d failed:\n%s" % (name, seed, result.describe()[-3000:]))
    with open(os.path.join(out, "rank0.json")) as f:
        w0 = json.load(f)
    return {"system": name, "seed": seed, "accuracy": w0["test_accuracy"],
            "train_seconds": w0["train_seconds"], "wall_seconds": round(result.wall_seconds, 2)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mxps-compression-") as root:
        for seed in seeds:
            for i in range(len(SYSTEMS)):          # interleaved, order rotated per seed
                name, kv, comp = SYSTEMS[(i + seed) % len(SYSTEMS)]
                rows.append(run(name, kv, comp, seed, a, root))
                print("%-16s seed %d: final accuracy %.4f" % (
                    name, seed, rows[-1]["accuracy"][-1]), flush=True)
    print("\nsystem            final test accuracy, mean (min-max) over seeds %s, %d epochs"
          % (a.seeds, a.epochs))
    for name, _, _ in SYSTEMS:
        finals = [r["accuracy"][-1] for r in rows if r["system"] == name]
        print("%-16s  %.4f (%.4f-%.4f)" % (name, statistics.mean(finals), min(finals),
                                           max(finals)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": vars(a), "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
