"""Record the DMLC_* variables this node was started with, then run train_job.py unchanged.

For tests/test_launcher.py: MXNet's launcher starts the same command for every role, so each
node (scheduler, servers, workers) writes ``JOB_OUT/env_<role>_<pid>.json`` before train_job.py
runs (in scheduler and server processes its ``import mxps`` then takes the role over).
"""
import json
import os
import runpy
import sys

TRAIN_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_job.py")

out = os.environ["JOB_OUT"]
os.makedirs(out, exist_ok=True)
role = os.environ.get("DMLC_ROLE", "worker")
path = os.path.join(out, "env_%s_%d.json" % (role, os.getpid()))
with open(path + ".tmp", "w") as f:
    json.dump({k: v for k, v in os.environ.items() if k.startswith("DMLC_")}, f)
os.replace(path + ".tmp", path)

sys.argv = [TRAIN_JOB] + sys.argv[1:]
runpy.run_path(TRAIN_JOB, run_name="__main__")
