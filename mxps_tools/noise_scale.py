"""Statistical efficiency of the noise study's synchronous SGD vs the number of workers.

    python -m mxps_tools.noise_scale --out /tmp/noise_scale/grid          # the full grid
    python -m mxps_tools.noise_scale --out DIR --cells none,cross:40 --workers 1,8 --seeds 1

``mxps study noise`` (docs/NOISE.md) cannot measure speed-up on a 2-core machine.  What it can
measure is how many synchronous steps the study's training needs to reach a test accuracy as
a function of the number of workers W, under each label noise; the time to accuracy is then
``steps(W) x step_time(W)`` with step_time(W) from the simulator (``mxps_tools.simulate``).

**The emulation** (``Emulator``) is the study's k = 1 job (``mxps_tools.noise_job``, kvstore
``mxps``, dist_sync) in one process, with MXNet's own layers and optimizer:

- the data and the labels: ``noise.noisy_split(noise.load(dataset), kind, ratio, seed,
  pair_seed=pair_seed)``, noise seed = run seed, as ``study_noise`` launches the job;
- the model: noise_job's ``mlp`` (Dense 128 relu, Dense 64 relu, Dense 10, prefix ``noise_``),
  after ``mx.random.seed(seed); np.random.seed(seed)``, ``Xavier(magnitude=2.0)``, shapes
  inferred on two training samples, hybridized: the job's rank-0 weights, which the job's
  ``kv.init`` gives every worker;
- the shards: worker r of W owns training samples r, r + W, ...; in epoch e it permutes them
  with ``RandomState([seed, e, r])`` and takes ``steps * batch``, ``steps = (n // W) //
  batch`` for every worker (``shard_batches``); global step t of an epoch is every worker's
  t-th minibatch;
- the update: under dist_sync the servers sum the W workers' pushed gradients (each the sum of
  its minibatch's per-sample gradients: the loss is not averaged before backward) and run the
  Trainer's optimizer once per key: MXNet's ``SGD(learning_rate=lr, momentum=0.9, wd=1e-4,
  rescale_grad=1/batch)`` (``Trainer.step(batch)`` sets the rescale before the optimizer is sent
  to the servers), i.e. SGD with momentum on the SUM over workers of their mean gradients.  The
  emulation calls MXNet's updater exactly so, one key at a time as the server does
  (``mx.optimizer.get_updater``, key i = the i-th parameter name in sorted order, Gluon's
  Trainer numbering).

Two ways to form the sum, the same maths: ``mode="workers"`` runs W separate forward/backward
passes of ``batch`` samples and adds the gradients (what the servers do; with W = 2 the sum of
two floats does not depend on the arrival order); ``mode="concat"`` (the default, W times
fewer calls) runs one forward/backward on the W minibatches concatenated, whose gradient is
that sum (a loss summed over samples has the summed gradient; the MLP has no batch statistics).
They differ by float summation order only (tests/test_noise_scale.py checks both against
plain SGD with learning rate lr x W on the concatenated minibatch, noise_job's linearity).
Checked against real jobs (``python -m mxps_tools.study_noise --consistency sync``, digits,
none and random 40%, 1-5 epochs): ``workers`` gives worker 0's per-epoch test accuracy and
training loss and the SHA-256 of the final weights bit for bit at W = 1 and 2; at W = 4, and
with ``concat``, the same accuracies, the losses within 1e-7-3e-4.  Training with the study's
learning rate is chaotic where it is unstable (W >= 32), so there float noise can change a run.

**Measured per run**: the clean test accuracy at step 0, every ``eval_every = max(1,
steps_per_epoch // evals_per_epoch)`` steps and at every epoch end (``curve``: [step,
accuracy]); worker 0's and all workers' mean training loss per epoch (the job's
``train_loss`` is worker 0's); **steps to target** = the first evaluated step at which the test
accuracy >= target (resolution ``eval_every`` steps; None = not reached within
``--max-epochs``).  A run whose loss turns NaN/inf is recorded as diverged and stopped (its
accuracy is then a constant guess).  A run is **unstable** if a later epoch's mean training
loss exceeds ln(classes), the loss of a uniform guess (the initial loss): the update blew up;
**collapsed** if its final test accuracy is below 20% (chance is 10%).

**Time to accuracy**: ``step_time(W)`` from ``mxps_tools.simulate.run.simulate`` (scenario
homogeneous, 10 Gbit/s, S = max(1, W // 4) servers, 20 steps, systems native and
mxps-adaptive) on the digits MLP's gradient keys (written to ``<out>/digits-mlp.json``) with the
compute-only step measured here (``measure_compute``: one worker's forward + backward + update
of ``batch`` samples: the smallest of 8 block medians of 100 steps, the least preempted
window of a shared machine; ``--compute`` overrides it); time to accuracy(W) =
steps_to_target(W) x step_time(W), the ideal-scaling reference steps(1) x step_time(1) / W.
The step times depend on the simulator's calibration (its SHA-256 is recorded); a rerun into
the same ``--out`` reuses every run and only measures and simulates again (seconds).

Output in ``--out``: ``runs.jsonl`` (one record per run, appended as runs finish; a rerun with
the same settings skips the recorded runs), ``noise_scale.json`` (settings, compute step, step
times, every run, the aggregates), ``noise_scale.md`` (the tables), ``steps_to_target.png`` and
``time_to_accuracy.png``.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import noise

WORKERS = (1, 2, 4, 8, 16, 32, 64)
SEEDS = (1, 2, 3)
CELLS = (("none", 0.0), ("cross", 20.0), ("cross", 40.0), ("random", 20.0), ("random", 40.0))
TARGETS = (0.80, 0.85, 0.90)
TARGET = 0.85
SYSTEMS = ("native", "mxps-adaptive")
MODEL_NAME = "digits-mlp"
#: the settings that make two runs the same run (a rerun skips a recorded one)
RUN_KEYS = ("dataset", "kind", "ratio", "workers", "seed", "batch", "lr", "momentum", "wd",
            "max_epochs", "evals_per_epoch", "pair_seed", "mode", "targets",
            "stop_when_reached")


class Settings:
    """The emulation's settings (noise_job's defaults where it has them)."""

    def __init__(self, batch=16, lr=0.02, momentum=0.9, wd=1e-4, max_epochs=60,
                 evals_per_epoch=10, targets=TARGETS, pair_seed=0, mode="concat",
                 dataset="digits", stop_when_reached=False):
        if mode not in ("concat", "workers"):
            raise ValueError("mode must be concat or workers, got %r" % (mode,))
        self.batch, self.lr, self.momentum, self.wd = int(batch), float(lr), float(momentum), \
            float(wd)
        self.max_epochs, self.evals_per_epoch = int(max_epochs), int(evals_per_epoch)
        self.targets = tuple(sorted(float(t) for t in targets))
        self.pair_seed, self.mode, self.dataset = int(pair_seed), mode, dataset
        self.stop_when_reached = bool(stop_when_reached)

    def as_dict(self):
        return {"batch": self.batch, "lr": self.lr, "momentum": self.momentum, "wd": self.wd,
                "max_epochs": self.max_epochs, "evals_per_epoch": self.evals_per_epoch,
                "targets": list(self.targets), "pair_seed": self.pair_seed, "mode": self.mode,
                "dataset": self.dataset, "stop_when_reached": self.stop_when_reached}


# --------------------------------------------------------------------------- bookkeeping

def steps_per_epoch(n: int, workers: int, batch: int) -> int:
    """noise_job's ``steps = (n_train // W) // batch``, the same for every worker."""
    return (n // workers) // batch


def shard_batches(n: int, workers: int, batch: int, seed: int, epoch: int) -> np.ndarray:
    """The sample indices of one epoch, shape (steps, workers, batch): ``[t, r]`` is worker r's
    t-th minibatch, as noise_job draws it (its own shard r, r + W, ..., permuted by
    ``RandomState([seed, epoch, r])``, the first ``steps * batch``)."""
    steps = steps_per_epoch(n, workers, batch)
    out = np.empty((steps, workers, batch), dtype=np.int64)
    for r in range(workers):
        own = np.arange(r, n, workers)
        order = own[np.random.RandomState([seed, epoch, r]).permutation(len(own))]
        out[:, r, :] = order[:steps * batch].reshape(steps, batch)
    return out


def eval_every(steps: int, evals_per_epoch: int) -> int:
    return max(1, steps // max(1, evals_per_epoch))


def first_reached(curve: Sequence[Sequence[float]], target: float) -> Optional[int]:
    """The first step of ``curve`` ([step, accuracy], ...) whose accuracy >= target."""
    for step, acc in curve:
        if acc >= target - 1e-12:
            return int(step)
    return None


def unstable(rec: dict, classes: int = 10) -> bool:
    """A training loss above a uniform guess's (ln classes) in an epoch after the first."""
    return any(x > math.log(classes) or not math.isfinite(x) for x in rec["train_loss"][1:])


def collapsed(rec: dict) -> bool:
    return rec["final"] < 0.2


def cell_name(kind: str, ratio: float) -> str:
    return "none" if kind == "none" else "%s %g%%" % (kind, ratio)


def parse_cells(text: str) -> List[Tuple[str, float]]:
    """``none,cross:20,random:40`` -> [("none", 0.0), ("cross", 20.0), ("random", 40.0)]."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        kind, _, ratio = item.partition(":")
        r = float(ratio) if ratio else 0.0
        noise.check(kind, r / 100.0)
        out.append((kind, r))
    return out


# --------------------------------------------------------------------------- the model

def build_net(seed: int, x_example: np.ndarray, classes: int = 10):
    """noise_job's ``mlp`` with the job's initial weights for ``seed`` (hybridized)."""
    import mxnet as mx
    from mxnet import gluon
    mx.random.seed(seed)
    np.random.seed(seed)
    net = gluon.nn.HybridSequential(prefix="noise_")
    with net.name_scope():
        net.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dense(64, activation="relu"),
                gluon.nn.Dense(classes))
    net.initialize(mx.init.Xavier(magnitude=2.0))
    net(mx.nd.array(x_example[:2]).reshape((-1,) + x_example.shape[1:]))
    net.hybridize()
    return net


def key_params(net):
    """The parameters in the kvstore's key order (Gluon's Trainer sorts them by name)."""
    params = net.collect_params()
    return [params[k] for k in sorted(params.keys())]


def model_json(net, name: str = MODEL_NAME) -> dict:
    """The simulator's model file for ``net``: key sizes in key order, each key's layer
    position (``collect_params()`` order)."""
    params = net.collect_params()
    layer = [k for k, p in params.items() if p.grad_req != "null"]
    names = sorted(layer)
    return {"name": name, "keys": [int(params[k].data().size) for k in names],
            "layer": [layer.index(k) for k in names]}


def server_updater(s: Settings):
    """What the servers run: MXNet's SGD as the job's Trainer sends it (rescale 1/batch)."""
    import mxnet as mx
    opt = mx.optimizer.create("sgd", learning_rate=s.lr, momentum=s.momentum, wd=s.wd,
                              rescale_grad=1.0 / s.batch)
    return mx.optimizer.get_updater(opt)


def accuracy(net, x, y, batch=500) -> float:
    """noise_job's ``accuracy``: argmax over batches of 500."""
    import mxnet as mx
    right = 0
    for i in range(0, len(y), batch):
        pred = net(mx.nd.array(x[i:i + batch])).argmax(axis=1).asnumpy()
        right += int((pred.astype(np.int64) == y[i:i + batch]).sum())
    return right / len(y)


# --------------------------------------------------------------------------- the emulation

class Emulator:
    """The study's k = 1 synchronous job with W workers, in one process (module docstring)."""

    def __init__(self, split: noise.Split, workers: int, seed: int, s: Settings):
        import mxnet as mx
        from mxnet import gluon
        self.mx = mx
        self.split, self.W, self.seed, self.s = split, int(workers), int(seed), s
        self.n = len(split.y_train)
        self.steps = steps_per_epoch(self.n, self.W, s.batch)
        if self.steps < 1:
            raise ValueError("%d training samples over %d workers do not fill one batch of %d"
                             % (self.n, self.W, s.batch))
        self.net = build_net(seed, split.x_train)
        self.params = key_params(self.net)
        self.updater = server_updater(s)
        self.loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        self.step_count = 0

    def batches(self, epoch: int) -> np.ndarray:
        return shard_batches(self.n, self.W, self.s.batch, self.seed, epoch)

    def step(self, idx: np.ndarray):
        """One synchronous round: ``idx`` (workers, batch) sample indices; returns each
        worker's mean loss (an NDArray of W, not waited for)."""
        mx, s = self.mx, self.s
        from mxnet import autograd
        x, y = self.split.x_train, self.split.y_train
        if s.mode == "concat":
            flat = idx.reshape(-1)
            with autograd.record():
                loss = self.loss_fn(self.net(mx.nd.array(x[flat])), mx.nd.array(y[flat]))
            loss.backward()
            grads = [p.grad() for p in self.params]
            losses = loss.reshape((self.W, s.batch)).mean(axis=1)
        else:
            grads, per = None, []
            for r in range(self.W):
                with autograd.record():
                    loss = self.loss_fn(self.net(mx.nd.array(x[idx[r]])),
                                        mx.nd.array(y[idx[r]]))
                loss.backward()
                per.append(loss.mean())
                if grads is None:
                    grads = [p.grad().copy() for p in self.params]
                else:
                    for g, p in zip(grads, self.params):
                        g += p.grad()
            losses = mx.nd.concat(*per, dim=0)
        for i, (g, p) in enumerate(zip(grads, self.params)):
            self.updater(i, g, p.data())
        self.step_count += 1
        return losses

    def accuracy(self) -> float:
        return accuracy(self.net, self.split.x_test, self.split.y_test)

    def weights(self) -> Dict[str, np.ndarray]:
        return {p.name: p.data().asnumpy() for p in self.params}

    def run(self, epochs: Optional[int] = None) -> dict:
        """Train ``epochs`` (default ``max_epochs``) epochs; the run's record."""
        s = self.s
        epochs = s.max_epochs if epochs is None else epochs
        every = eval_every(self.steps, s.evals_per_epoch)
        curve = [[0, self.accuracy()]]
        epoch_acc, loss0, loss_all = [], [], []
        diverged = False
        t0 = time.perf_counter()
        reached_all = False
        for epoch in range(epochs):
            per_step = []
            for t, idx in enumerate(self.batches(epoch)):
                per_step.append(self.step(idx))
                if (t + 1) % every == 0 or t + 1 == self.steps:
                    curve.append([self.step_count, self.accuracy()])
            losses = self.mx.nd.stack(*per_step).asnumpy().astype(np.float64)   # (steps, W)
            loss0.append(float(losses[:, 0].sum() / self.steps))
            loss_all.append(float(losses.mean()))
            epoch_acc.append(curve[-1][1])
            if not np.all(np.isfinite(losses)):
                diverged = True
                break
            if s.stop_when_reached and all(first_reached(curve, t) is not None
                                           for t in s.targets):
                reached_all = True
                break
        steps_to = {"%g" % t: first_reached(curve, t) for t in s.targets}
        return {
            "workers": self.W, "seed": self.seed, "steps_per_epoch": self.steps,
            "samples_per_step": self.W * s.batch,
            "samples_per_epoch": self.W * s.batch * self.steps, "eval_every": every,
            "epochs_run": len(epoch_acc), "steps": self.step_count, "curve": curve,
            "epoch_accuracy": epoch_acc, "train_loss_worker0": loss0, "train_loss": loss_all,
            "final": epoch_acc[-1] if epoch_acc else curve[-1][1],
            "best": max(a for _, a in curve), "diverged": diverged,
            "peak_train_loss": max(loss_all) if loss_all else None,
            "stopped_when_reached": reached_all, "steps_to": steps_to,
            "epochs_to": {k: (None if v is None else v / self.steps)
                          for k, v in steps_to.items()},
            "seconds": time.perf_counter() - t0,
        }


_SPLITS = {}


def load_split(dataset: str, kind: str, ratio: float, seed: int, pair_seed: int = 0):
    """The study's split with the study's noisy training labels (noise seed = run seed)."""
    if dataset not in _SPLITS:
        _SPLITS[dataset] = noise.load(dataset)
    return noise.noisy_split(_SPLITS[dataset], kind, ratio / 100.0, seed, pair_seed=pair_seed)


def run_one(kind: str, ratio: float, workers: int, seed: int, s: Settings) -> dict:
    """One emulated run: its settings and its record."""
    split, info = load_split(s.dataset, kind, ratio, seed, s.pair_seed)
    rec = {"dataset": s.dataset, "kind": kind, "ratio": float(ratio), "workers": int(workers),
           "seed": int(seed), "batch": s.batch, "lr": s.lr, "momentum": s.momentum, "wd": s.wd,
           "max_epochs": s.max_epochs, "evals_per_epoch": s.evals_per_epoch,
           "pair_seed": s.pair_seed, "mode": s.mode, "targets": list(s.targets),
           "stop_when_reached": s.stop_when_reached,
           "changed_labels": info["changed"], "train_samples": len(split.y_train)}
    rec.update(Emulator(split, workers, seed, s).run())
    return rec


def _task(args):
    kind, ratio, workers, seed, sd = args
    return run_one(kind, ratio, workers, seed, Settings(**sd))


# --------------------------------------------------------------------------- compute and time

def measure_compute(batch: int = 16, blocks: int = 8, per_block: int = 100, warmup: int = 50,
                    dataset: str = "digits") -> dict:
    """One worker's compute-only step on this machine, as noise_job runs it: the minibatch to
    NDArrays, forward, backward, the optimizer's update of every key, the loss read back
    (the job's ``loss.mean().asscalar()``), wall time per step.

    ``blocks`` blocks of ``per_block`` steps; ``median_s`` is the smallest of the blocks'
    medians: a median of many steps, taken in the least disturbed window, since other
    processes on a shared 2-core machine preempt some blocks (their medians are recorded,
    with the median and quantiles over all steps)."""
    import mxnet as mx
    from mxnet import autograd, gluon
    split = noise.load(dataset)
    s = Settings(batch=batch)
    net = build_net(1, split.x_train)
    params, upd = key_params(net), server_updater(s)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(0)
    times = []
    for i in range(warmup + blocks * per_block):
        idx = rng.choice(len(split.y_train), batch, replace=False)
        t = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(split.x_train[idx])), mx.nd.array(split.y_train[idx]))
        loss.backward()
        for k, p in enumerate(params):
            upd(k, p.grad(), p.data())
        float(loss.mean().asscalar())
        mx.nd.waitall()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    medians = [float(np.median(times[j * per_block:(j + 1) * per_block]))
               for j in range(blocks)]
    q = np.percentile(times, [10, 25, 50, 75])
    return {"median_s": min(medians), "block_medians_s": medians,
            "all_median_s": float(q[2]), "p10_s": float(q[0]), "p25_s": float(q[1]),
            "p75_s": float(q[3]), "min_s": float(min(times)), "repeats": len(times),
            "batch": batch, "load_average": list(os.getloadavg()), "model": model_json(net)}


def step_times(workers: Sequence[int], model_path: str, compute_s: float,
               systems: Sequence[str] = SYSTEMS, rate: float = 10000.0, sim_steps: int = 20):
    """{W: {system: simulated mean step seconds}} (homogeneous, S = max(1, W // 4))."""
    from mxps_tools.simulate import run, scenarios
    out = {}
    for w in workers:
        o = scenarios.Options(scenario="homogeneous", num_workers=int(w),
                              num_servers=max(1, int(w) // 4), model=model_path, rate=rate,
                              steps=sim_steps, compute=compute_s, systems=tuple(systems))
        summ = run.simulate(o)
        out[int(w)] = {a["name"]: float(a["mean_s"]) for a in summ["variants"][0]["systems"]}
    return out


def simulator_state() -> dict:
    """Which simulator made the step times: SHA-256 of its calibration file and of its code
    and data (every .py and .json of the package, by name), the calibration's mtime."""
    import hashlib
    from mxps_tools.simulate import calibration
    path = calibration.CALIBRATION_FILE
    folder = os.path.dirname(path)
    out = {"calibration": path}
    try:
        with open(path, "rb") as f:
            out["sha256"] = hashlib.sha256(f.read()).hexdigest()
        out["modified"] = time.strftime("%Y-%m-%d %H:%M:%S",
                                        time.localtime(os.path.getmtime(path)))
        h = hashlib.sha256()
        for name in sorted(os.listdir(folder)):
            if name.endswith((".py", ".json")):
                h.update(name.encode())
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(f.read())
        out["package_sha256"] = h.hexdigest()
    except OSError as e:
        out["error"] = str(e)
    return out


# --------------------------------------------------------------------------- aggregates

def _med(values: List[float]) -> Optional[float]:
    """The median with None (never reached) as +inf; None if the median is not finite."""
    if not values:
        return None
    v = sorted(math.inf if x is None else x for x in values)
    m = statistics.median(v)
    return None if math.isinf(m) else m


def _spread(values: List[Optional[float]]):
    v = [math.inf if x is None else x for x in values]
    lo, hi = min(v), max(v)
    return (None if math.isinf(lo) else lo), (None if math.isinf(hi) else hi)


def aggregate(records: List[dict], times: Optional[dict], targets: Sequence[float]) -> dict:
    """Per (cell, W, target): steps to target over seeds (median, min, max, reached), time to
    accuracy per system; per (cell, target, system): the speed-up over W = 1, the best W."""
    cells = sorted({(r["kind"], r["ratio"]) for r in records},
                   key=lambda c: (noise.KINDS.index(c[0]), c[1]))
    workers = sorted({r["workers"] for r in records})
    rows, scaling = [], []
    for kind, ratio in cells:
        for tgt in targets:
            key = "%g" % tgt
            per_w = {}
            for w in workers:
                rs = sorted((r for r in records if (r["kind"], r["ratio"], r["workers"]) ==
                             (kind, ratio, w)), key=lambda r: r["seed"])
                if not rs:
                    continue
                steps = [r["steps_to"].get(key) for r in rs]
                lo, hi = _spread(steps)
                row = {"kind": kind, "ratio": ratio, "cell": cell_name(kind, ratio),
                       "workers": w, "target": tgt, "seeds": [r["seed"] for r in rs],
                       "steps": steps, "steps_median": _med(steps), "steps_min": lo,
                       "steps_max": hi, "reached": sum(x is not None for x in steps),
                       "runs": len(rs), "steps_per_epoch": rs[0]["steps_per_epoch"],
                       "epochs_median": None, "samples_median": None,
                       "final_median": statistics.median(r["final"] for r in rs),
                       "best_median": statistics.median(r["best"] for r in rs),
                       "epoch_peak_median": statistics.median(max(r["epoch_accuracy"])
                                                              for r in rs),
                       "diverged": sum(bool(r["diverged"]) for r in rs),
                       "unstable": sum(unstable(r) for r in rs),
                       "collapsed": sum(collapsed(r) for r in rs), "tta": {}}
                if row["steps_median"] is not None:
                    row["epochs_median"] = row["steps_median"] / rs[0]["steps_per_epoch"]
                    row["samples_median"] = row["steps_median"] * w * rs[0]["batch"]
                if times and w in times:
                    for name, st in times[w].items():
                        tt = [None if x is None else x * st for x in steps]
                        tlo, thi = _spread(tt)
                        row["tta"][name] = {"step_s": st, "median_s": _med(tt), "min_s": tlo,
                                            "max_s": thi}
                rows.append(row)
                per_w[w] = row
            base = per_w.get(1)
            if base is None:
                continue
            sc = {"kind": kind, "ratio": ratio, "cell": cell_name(kind, ratio), "target": tgt,
                  "step_speedup": {}, "efficiency": {}, "tta_speedup": {}, "best_workers": {},
                  "ideal_tta_s": {}}
            for w, row in per_w.items():
                if base["steps_median"] is not None and row["steps_median"] is not None:
                    sc["step_speedup"][w] = base["steps_median"] / row["steps_median"]
                    sc["efficiency"][w] = sc["step_speedup"][w] / w
            for name in (times[1] if times and 1 in times else {}):
                sp, best = {}, None
                for w, row in per_w.items():
                    t1, tw = base["tta"][name]["median_s"], row["tta"][name]["median_s"]
                    sp[w] = (t1 / tw) if (t1 is not None and tw is not None) else None
                    if tw is not None and (best is None or tw < best[1]):
                        best = (w, tw)
                sc["tta_speedup"][name] = sp
                sc["best_workers"][name] = None if best is None else \
                    {"workers": best[0], "tta_s": best[1]}
                if base["tta"][name]["median_s"] is not None:
                    sc["ideal_tta_s"][name] = {w: base["steps_median"] * times[1][name] / w
                                               for w in per_w}
            scaling.append(sc)
    return {"rows": rows, "scaling": scaling}


# --------------------------------------------------------------------------- report

def _noise_table(cells, rows, workers, fmt):
    """Markdown lines of a table with a row per noise cell and a column per W: ``fmt(row)``
    of that cell's row at W (``rows``: dicts with ``cell`` and ``workers``), blank where the
    grid has none."""
    lines = ["| noise | " + " | ".join("W=%d" % w for w in workers) + " |",
             "|---|" + "---|" * len(workers)]
    for c in cells:
        by = {r["workers"]: r for r in rows if r["cell"] == c}
        lines.append("| %s | " % c + " | ".join(fmt(by[w]) if w in by else ""
                                                 for w in workers) + " |")
    return lines


def _fmt_steps(row):
    if row["steps_median"] is None:
        if not row["reached"]:
            return "never (0/%d)" % row["runs"]
        return "never in %d/%d (reached: %s)" % (
            row["runs"] - row["reached"], row["runs"],
            ", ".join(_n(x) for x in sorted(x for x in row["steps"] if x is not None)))
    txt = "%s (%s-%s)" % (_n(row["steps_median"]), _n(row["steps_min"]),
                          _n(row["steps_max"]) if row["steps_max"] is not None else "never")
    return txt


def _n(x):
    return "-" if x is None else ("%d" % x if float(x).is_integer() else "%.1f" % x)


def _s(x):
    if x is None:
        return "never"
    return "%.3f" % x if x < 10 else "%.1f" % x


def report(summary: dict) -> str:
    """The markdown tables of ``summary`` (``noise_scale.json``)."""
    agg, st = summary["aggregates"], summary["settings"]
    rows = agg["rows"]
    workers = sorted({r["workers"] for r in rows})
    cells = []
    for r in rows:
        if r["cell"] not in cells:
            cells.append(r["cell"])
    lines = ["# Steps to accuracy vs workers under label noise (emulated, %s)" % st["dataset"],
             "",
             "Settings: batch %d per worker, lr %g on the sum of the workers' mean gradients, "
             "momentum %g, wd %g, at most %d epochs, test accuracy evaluated every "
             "max(1, steps_per_epoch // %d) steps and at epoch ends; seeds %s; mode %s." % (
                 st["batch"], st["lr"], st["momentum"], st["wd"], st["max_epochs"],
                 st["evals_per_epoch"], ",".join(str(x) for x in summary["seeds"]), st["mode"]),
             ""]
    spe = {r["workers"]: r["steps_per_epoch"] for r in rows}
    lines += ["Steps per epoch: " + ", ".join("W=%d: %d" % (w, spe[w]) for w in workers), ""]
    if summary.get("compute") and "median_s" not in summary["compute"]:
        lines += ["Compute-only step: %.3f ms, given (--compute), not measured."
                  % (1e3 * summary["compute"]["used_s"]), ""]
    elif summary.get("compute"):
        c = summary["compute"]
        lines += ["Compute-only step (one worker, batch %d): %.3f ms, the smallest of %d "
                  "block medians (%s ms); over all %d steps: median %.3f, quartiles %.3f-%.3f "
                  "ms; load average %s when measured%s." % (
                      c["batch"], 1e3 * c["median_s"], len(c["block_medians_s"]),
                      ", ".join("%.2f" % (1e3 * x) for x in c["block_medians_s"]),
                      c["repeats"], 1e3 * c["all_median_s"], 1e3 * c["p25_s"],
                      1e3 * c["p75_s"], "/".join("%.1f" % x for x in c["load_average"]),
                      ""), ""]
    times = summary.get("step_times") or {}
    if times:
        sim = (summary.get("compute") or {}).get("simulator", {})
        lines += ["Simulated step time, ms (homogeneous, 10 Gbit/s, S = max(1, W//4); "
                  "calibration %s of %s, simulator package %s):" % (
                      sim.get("sha256", "?")[:12], sim.get("modified", "?"),
                      sim.get("package_sha256", "?")[:12]), "",
                  "| system | " + " | ".join("W=%d" % w for w in workers) + " |",
                  "|---|" + "---|" * len(workers)]
        for name in summary["systems"]:
            lines.append("| %s | " % name + " | ".join(
                "%.3f" % (1e3 * times[str(w)][name]) if str(w) in times else "-"
                for w in workers) + " |")
        lines.append("")
    first = [r for r in rows if abs(r["target"] - st["targets"][0]) < 1e-9]
    lines += ["Peak over the epoch ends (the same count of evaluations for every W; the peak "
              "of the finer curve grows with its number of points) / final test accuracy, % "
              "(medians over seeds); (uA cB of n): A runs "
              "unstable (a later epoch's mean training loss above ln 10, the initial loss), "
              "B collapsed (final accuracy < 20%), of n:", ""]
    lines += _noise_table(cells, first, workers, lambda r: "%.1f / %.1f%s" % (
        100 * r["epoch_peak_median"], 100 * r["final_median"],
        " (u%d c%d of %d)" % (r["unstable"], r["collapsed"], r["runs"])
        if r["unstable"] or r["collapsed"] else ""))
    lines.append("")
    for tgt in st["targets"]:
        sub = [r for r in rows if abs(r["target"] - tgt) < 1e-9]
        lines += ["## Target %g%%" % (100 * tgt), "",
                  "Steps to target, median (min-max) over seeds; `never (r/n)`: r of n seeds "
                  "reached it:", ""]
        lines += _noise_table(cells, sub, workers, _fmt_steps)
        lines += ["", "Epochs to target (median):", ""]
        lines += _noise_table(cells, sub, workers, lambda r: "%.2f" % r["epochs_median"]
                              if r["epochs_median"] is not None else "never")
        lines.append("")
        for name in summary["systems"]:
            lines += ["Time to accuracy, %s, seconds: median (min-max); `ideal` = steps(1) x "
                      "step_time(1) / W of the clean cell:" % name, ""]

            def tta(r, name=name):
                t = r["tta"].get(name)
                return "" if t is None else "%s (%s-%s)" % (
                    _s(t["median_s"]), _s(t["min_s"]), _s(t["max_s"]))
            lines += _noise_table(cells, sub, workers, tta)
            clean = [sc for sc in agg["scaling"] if sc["kind"] == "none" and
                     abs(sc["target"] - tgt) < 1e-9]
            if clean and clean[0]["ideal_tta_s"].get(name):
                ideal = clean[0]["ideal_tta_s"][name]
                lines.append("| ideal (none) | " + " | ".join(
                    _s(ideal.get(str(w), ideal.get(w))) for w in workers) + " |")
            lines.append("")
        head = ["W=%d" % w for w in workers] + ["best W, %s" % n for n in summary["systems"]]
        lines += ["Scaling: step speed-up steps(1)/steps(W) [efficiency = speed-up / W]; per "
                  "system the best W by median time to accuracy (its speed-up TTA(1)/TTA(W); "
                  "the speed-up at the largest W):", "",
                  "| noise | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
        for sc in (x for x in agg["scaling"] if abs(x["target"] - tgt) < 1e-9):
            def g(d, w):
                return d.get(str(w), d.get(w))
            vals = []
            for w in workers:
                sp = g(sc["step_speedup"], w)
                vals.append("-" if sp is None else "%.2f [%.2f]" % (sp, g(sc["efficiency"], w)))
            bests = []
            for n in summary["systems"]:
                b = sc["best_workers"].get(n)
                spb = None if b is None else g(sc["tta_speedup"].get(n, {}), b["workers"])
                spm = g(sc["tta_speedup"].get(n, {}), max(workers))
                bests.append("-" if b is None else "%d (x%.2f; W=%d: %s)" % (
                    b["workers"], spb, max(workers), "never" if spm is None else
                    "x%.2f" % spm))
            lines.append("| %s | " % sc["cell"] + " | ".join(vals + bests) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(summary: dict, out_dir: str) -> List[str]:
    """``steps_to_target.png`` (steps to ``summary['target']`` vs W; steps x W relative to
    W = 1; peak and final accuracy vs W) and ``time_to_accuracy.png`` (a panel per system);
    medians over seeds, bands min-max, x at the top: the median never reached the target."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory
    tgt = summary["target"]
    rows = [r for r in summary["aggregates"]["rows"] if abs(r["target"] - tgt) < 1e-9]
    cells = []
    for r in rows:
        if r["cell"] not in cells:
            cells.append(r["cell"])
    colours = {c: "C%d" % i for i, c in enumerate(cells)}
    xsall = sorted({r["workers"] for r in rows})
    clean = next((r for r in rows if r["kind"] == "none" and r["workers"] == 1), None)
    paths = []

    def series(c, get):
        pts = sorted((r for r in rows if r["cell"] == c), key=lambda r: r["workers"])
        xs, med, lo, hi, never = [], [], [], [], []
        for r in pts:
            m, a, b = get(r)
            if m is None:
                never.append(r["workers"])
                continue
            xs.append(r["workers"])
            med.append(m)
            lo.append(a)
            hi.append(b if b is not None else np.nan)
        return xs, med, lo, hi, never

    def draw(ax, get, label_never=True):
        trans = blended_transform_factory(ax.transData, ax.transAxes)
        for i, c in enumerate(cells):
            xs, med, lo, hi, never = series(c, get)
            if xs:
                ax.plot(xs, med, "o-", color=colours[c], label=c)
                ax.fill_between(xs, lo, hi, color=colours[c], alpha=0.15)
            if never and label_never:
                ax.scatter([w * (1 + 0.04 * (i - len(cells) / 2)) for w in never],
                           [0.97] * len(never), marker="x", color=colours[c], transform=trans,
                           clip_on=False)

    def axis(ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xsall)
        ax.set_xticklabels([str(w) for w in xsall])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    draw(axes[0], lambda r: (r["steps_median"], r["steps_min"], r["steps_max"]))
    if clean and clean["steps_median"] is not None:
        axes[0].plot(xsall, [clean["steps_median"] / w for w in xsall], "k--", lw=1,
                     label="ideal: steps(1)/W, none")
    for c in cells:
        base = next((r for r in rows if r["cell"] == c and r["workers"] == 1), None)
        xs, med, _, _, _ = series(c, lambda r: (r["steps_median"], None, None))
        if base and base["steps_median"] is not None and xs:
            axes[1].plot(xs, [m * w / base["steps_median"] for m, w in zip(med, xs)], "o-",
                         color=colours[c], label=c)
    axes[1].axhline(1.0, color="k", ls="--", lw=1, label="ideal (steps x W constant)")
    for c in cells:
        pts = sorted((r for r in rows if r["cell"] == c), key=lambda r: r["workers"])
        axes[2].plot([r["workers"] for r in pts], [100 * r["epoch_peak_median"] for r in pts],
                     "o-", color=colours[c], label="%s peak" % c)
        axes[2].plot([r["workers"] for r in pts], [100 * r["final_median"] for r in pts], ":",
                     color=colours[c])
    axes[2].axhline(100 * tgt, color="k", ls="--", lw=1, label="target")
    axes[0].set_ylabel("synchronous steps to %g%% test accuracy" % (100 * tgt))
    axes[1].set_ylabel("steps(W) x W / steps(1)  (samples to target, relative)")
    axes[2].set_ylabel("test accuracy, % (solid: peak at epoch ends, dotted: final)")
    axes[0].set_title("steps to target (median; band: min-max over seeds; x: median never)",
                      fontsize=9)
    axes[1].set_title("statistical cost of W workers, per noise cell", fontsize=9)
    axes[2].set_title("peak and final test accuracy within %d epochs (medians)"
                      % summary["settings"]["max_epochs"], fontsize=9)
    for ax in axes[:2]:
        ax.set_yscale("log")
    for ax in axes:
        ax.set_xlabel("workers W (batch %d each)" % summary["settings"]["batch"])
        axis(ax)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "steps_to_target.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    systems = summary["systems"]
    if summary.get("step_times"):
        fig, axes = plt.subplots(1, len(systems), figsize=(6 * len(systems), 4.8),
                                 squeeze=False)
        for ax, name in zip(axes[0], systems):
            draw(ax, lambda r: ((r["tta"][name]["median_s"], r["tta"][name]["min_s"],
                                 r["tta"][name]["max_s"]) if name in r["tta"]
                                else (None, None, None)))
            if clean and clean["steps_median"] is not None and name in clean["tta"]:
                t1 = clean["tta"][name]["median_s"]
                ax.plot(xsall, [t1 / w for w in xsall], "k--", lw=1,
                        label="ideal: steps(1) x step_time(1) / W, none")
            ax.set_yscale("log")
            ax.set_xlabel("workers W")
            ax.set_ylabel("time to %g%% = steps x simulated step time, s" % (100 * tgt))
            ax.set_title("%s (10 Gbit/s, S = max(1, W/4), measured compute; x: never)" % name,
                         fontsize=9)
            axis(ax)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "time_to_accuracy.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# --------------------------------------------------------------------------- the grid

def _same(rec: dict, want: dict) -> bool:
    defaults = {"stop_when_reached": False}
    return all(rec.get(k, defaults.get(k)) == want.get(k, defaults.get(k)) for k in RUN_KEYS)


def run_grid(out: str, cells: Sequence[Tuple[str, float]] = CELLS,
             workers: Sequence[int] = WORKERS, seeds: Sequence[int] = SEEDS,
             s: Optional[Settings] = None, jobs: int = 1, simulate: bool = True,
             systems: Sequence[str] = SYSTEMS, target: float = TARGET,
             compute_s: Optional[float] = None, plots: bool = True,
             log=print) -> dict:
    """The grid into ``out``; returns the summary (also ``noise_scale.json``)."""
    s = s or Settings()
    if target not in s.targets:
        s.targets = tuple(sorted(set(s.targets) | {float(target)}))
    os.makedirs(out, exist_ok=True)
    t_start = time.time()
    path = os.path.join(out, "runs.jsonl")
    done = []
    if os.path.exists(path):
        with open(path) as f:
            done = [json.loads(line) for line in f if line.strip()]
    tasks, records = [], []
    for kind, ratio in cells:
        for seed in seeds:
            for w in workers:
                want = dict(s.as_dict(), kind=kind, ratio=float(ratio), workers=int(w),
                            seed=int(seed), targets=list(s.targets))
                hit = next((r for r in done if _same(r, want)), None)
                if hit is not None:
                    records.append(hit)
                else:
                    tasks.append((kind, float(ratio), int(w), int(seed), s.as_dict()))
    # the long runs (most steps: small W) first, so that two processes end together
    tasks.sort(key=lambda t: t[2])
    log("noise_scale: %d runs (%d recorded already), %d process(es)"
        % (len(tasks) + len(records), len(records), jobs))

    def note(rec, i):
        records.append(rec)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        log("run %d of %d: %s W=%d seed %d: final %.3f, steps to %g: %s, %.1f s" % (
            i, len(tasks), cell_name(rec["kind"], rec["ratio"]), rec["workers"], rec["seed"],
            rec["final"], target, rec["steps_to"].get("%g" % target), rec["seconds"]))
    t_grid = time.time()
    if jobs <= 1:
        for i, t in enumerate(tasks, 1):
            note(_task(t), i)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"       # one core each (the children read it)
        try:
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) \
                    as ex:
                futs = [ex.submit(_task, t) for t in tasks]
                for i, fut in enumerate(as_completed(futs), 1):
                    note(fut.result(), i)
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old
    grid_seconds = time.time() - t_grid
    compute = times = None
    if simulate:
        if compute_s is None:
            compute = measure_compute(s.batch, dataset=s.dataset)
        else:                                   # given: nothing measured
            compute = {"used_s": float(compute_s), "batch": s.batch, "model": model_json(
                build_net(1, noise.load(s.dataset).x_train))}
        model_path = os.path.join(out, MODEL_NAME + ".json")
        with open(model_path, "w") as f:
            json.dump(compute["model"], f)
        t_sim = time.time()
        times = step_times(sorted({int(w) for w in workers}), model_path,
                           compute.get("used_s", compute.get("median_s")), systems)
        compute["simulate_seconds"] = time.time() - t_sim
        compute["simulator"] = simulator_state()
    records.sort(key=lambda r: ([c for c in cells].index((r["kind"], r["ratio"]))
                                if (r["kind"], r["ratio"]) in cells else 99,
                                r["workers"], r["seed"]))
    agg = aggregate(records, times, s.targets)
    summary = {"settings": s.as_dict(), "cells": [list(c) for c in cells],
               "workers": list(workers), "seeds": list(seeds), "target": float(target),
               "systems": list(systems) if simulate else [], "compute": compute,
               "step_times": {str(w): v for w, v in (times or {}).items()},
               "grid_seconds": grid_seconds, "wall_seconds": time.time() - t_start,
               "jobs": jobs, "aggregates": _jsonable(agg), "runs": records}
    summary["aggregates"] = json.loads(json.dumps(summary["aggregates"]))
    with open(os.path.join(out, "noise_scale.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "noise_scale.md"), "w") as f:
        f.write(report(summary))
    if plots:
        summary["plots"] = plot(summary, out)
    log("noise_scale: %d runs, grid %.0f s, total %.0f s; %s" % (
        len(records), grid_seconds, time.time() - t_start, os.path.join(out, "noise_scale.md")))
    return summary


def _jsonable(x):
    """Integer dict keys as strings (JSON's), recursively."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def add_arguments(p: argparse.ArgumentParser) -> None:
    """This command's options on ``p`` (for ``python -m`` and a CLI subcommand)."""
    p.add_argument("--out", required=True)
    p.add_argument("--cells", type=parse_cells, default=list(CELLS),
                   help="noise cells KIND[:PERCENT],... (default none,cross:20,cross:40,"
                        "random:20,random:40)")
    p.add_argument("--workers", type=lambda t: [int(x) for x in t.split(",")],
                   default=list(WORKERS))
    p.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")],
                   default=list(SEEDS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--max-epochs", type=int, default=60)
    p.add_argument("--evals-per-epoch", type=int, default=10)
    p.add_argument("--target", type=float, default=TARGET)
    p.add_argument("--targets", type=lambda t: [float(x) for x in t.split(",")],
                   default=list(TARGETS), help="also recorded")
    p.add_argument("--pair-seed", type=int, default=0)
    p.add_argument("--mode", choices=("concat", "workers"), default="concat")
    p.add_argument("--stop-when-reached", action="store_true",
                   help="end a run once every target is reached (curves end there)")
    p.add_argument("--jobs", type=int, default=2, help="processes running the grid")
    p.add_argument("--compute", type=float, default=None,
                   help="compute-only step seconds for the simulator (default: measured; "
                        "given, nothing is measured)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--no-simulate", action="store_true")
    p.add_argument("--no-plot", action="store_true")


def run(a: argparse.Namespace) -> int:
    """The grid of parsed options ``a`` (``add_arguments``); exit status 0."""
    s = Settings(batch=a.batch, lr=a.lr, max_epochs=a.max_epochs,
                 evals_per_epoch=a.evals_per_epoch, targets=a.targets, pair_seed=a.pair_seed,
                 mode=a.mode, stop_when_reached=a.stop_when_reached)
    run_grid(a.out, a.cells, a.workers, a.seeds, s, jobs=a.jobs, simulate=not a.no_simulate,
             systems=tuple(x for x in a.systems.split(",") if x), target=a.target,
             compute_s=a.compute, plots=not a.no_plot)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
