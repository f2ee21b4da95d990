#!/usr/bin/env python3
"""Why the label-noise study's async cells at 8 workers do not train (docs/NOISE.md): the same
job (mxps_tools.noise_job, clean digits, MLP, 10 epochs, lr 0.02, batch 16) with 8 workers and
1 server on loopback, under mxps's ``mxps_async`` and native MXNet's ``dist_async``, with the
study's momentum 0.9 and with none; prints worker 0's test accuracy per epoch and writes
``<out>/async_probe.json``.

    flock /tmp/mxps-bench.lock python scripts/noise_async_probe.py /tmp/noise/async
"""
import argparse
import json
import os
import shutil

from mxps_tools import jobs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    results = []
    for seed in args.seeds:
        for momentum in (0.9, 0.0):
            for kv in ("mxps_async", "dist_async"):
                name = "%s-m%g-s%d" % (kv, momentum, seed)
                run_dir = os.path.join(args.out, name)
                shutil.rmtree(run_dir, ignore_errors=True)
                os.makedirs(run_dir)
                argv = ["-m", "mxps_tools.noise_job", "--out", run_dir, "--kvstore", kv,
                        "--dataset", "digits", "--model", "mlp", "--kind", "none", "--ratio",
                        "0", "--seed", str(seed), "--noise-seed", str(seed), "--epochs", "10",
                        "--batch", "16", "--lr", "0.02", "--momentum", str(momentum)]
                r = jobs.Job(argv, args.workers, 1, timeout=600,
                             log_dir=os.path.join(run_dir, "logs"), cpu_interval=None).run()
                curve = None
                if r.ok:
                    with open(os.path.join(run_dir, "rank0.json")) as f:
                        curve = json.load(f)["test_accuracy"]
                results.append({"name": name, "ok": r.ok, "curve": curve,
                                "wall_seconds": r.wall_seconds})
                print(name, "ok" if r.ok else "FAILED",
                      curve and [round(a, 3) for a in curve], flush=True)
    with open(os.path.join(args.out, "async_probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
