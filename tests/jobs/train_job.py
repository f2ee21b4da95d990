"""One small training job for native MXNet kvstores and for mxps, configured by environment.

Run it as every node of a job (tests/cluster.py does): on a scheduler or server node the import
of mxps (or of mxnet, for native kvstores) takes the role over and the process never reaches the
training code.

Environment:
  JOB_KVSTORE            kvstore name: dist_sync (default), dist_async, local, mxps, ...
                         Names starting with "mxps" import mxps BEFORE mxnet; others never
                         import mxps.
  JOB_API                gluon (default) or module (mx.mod.Module.fit on a symbol MLP).
  JOB_OPTIMIZER          sgd (default; momentum 0.9, wd 1e-4) or adam (wd 1e-4).
  JOB_LR                 learning rate (default 0.1 for sgd, 0.01 for adam).
  JOB_LR_MULT            1: lr_mult = 0.5 on the first dense layer's weight (gluon only),
                         set as users do: Parameter.lr_mult.
  JOB_UPDATE_ON_KVSTORE  1 / 0 / unset (Trainer's default). For module: sets
                         MXNET_UPDATE_ON_KVSTORE, which Module reads.
  JOB_STEPS              training steps (default 20).
  JOB_FIRST_STEP         the step to start at (default 0; "auto": the round the servers'
                         store resumed at, mxps.resume_round): a job resumed from a store
                         (MXPS_STORE_RESUME) trains steps JOB_FIRST_STEP..JOB_STEPS-1 on the
                         batches an uninterrupted job would.
  JOB_BATCH              batch size per worker (default 32; split across devices).
  JOB_DEVICES            contexts per worker: mx.cpu(0..N-1) (default 1).
  JOB_CONTEXT            cpu (default) or gpu: the contexts are mx.gpu(0..N-1) (a GPU build
                         of MXNet; scripts/gpu_check.py).
  JOB_SIMULATE_WORKERS   W: a single process (JOB_KVSTORE=device) plays W synchronous workers
                         exactly, device i fed worker i's data; writes weights for ranks
                         0..W-1 (all the same). The reference where native dist_sync is not.
  JOB_MODEL              mlp (default: 64-32-32-10) or mlp_big (64-2048-32-10: the first
                         weight has 131072 elements; lower MXNET_KVSTORE_BIGARRAY_BOUND below
                         that to exercise the big-array split across servers).
  JOB_KV_OBJECT          1: create the kvstore with mx.kv.create(JOB_KVSTORE) first and pass
                         the object (gluon only); else pass the name.
  JOB_DATA_RANK          use this data shard instead of the kvstore rank (e.g. local runs).
  JOB_DATA_SHARDS        number of data shards (default: the kvstore's num_workers).
  JOB_WAITALL            1 (default): mx.nd.waitall() after every step; 0: never (the
                         training thread runs ahead of the engine, as real scripts do).
  JOB_DELAY              "rank:step:seconds" (mxps only): on that rank, that step's gradients
                         become ready that many seconds late (an engine operation holding
                         them sleeps), so its pushes leave late while the training thread
                         goes on.
  JOB_SLOW               "rank:seconds": that rank sleeps that long in every step (a worker
                         that computes slowly: a straggler).
  JOB_SEED               seed for initialisation, the same on every worker (default 42).
  JOB_COMPRESSION        "TYPE:THRESHOLD" (e.g. 2bit:0.5): the Trainer's or Module's
                         compression_params, {'type': TYPE, 'threshold': THRESHOLD}.
  JOB_PUSH_PULL          1 (gluon only): the Trainer's pushpull of a key becomes push then
                         pull, as MXNet's model.py does for sparse arrays (native MXNet 1.9.1
                         refuses compression in pushpull).
  JOB_OUT                directory; each worker writes weights_rank{R}.npz (every parameter
                         by name) and meta_rank{R}.json (rank, num_workers, kvstore type,
                         per-step seconds, ...). Required.

Data: sklearn's bundled digits (64 features, 10 classes; its package's digits.csv.gz, read as
load_digits reads it: tests/test_takeover.py checks they are the same), shuffled with a fixed
seed and split into shards by rank, so every worker trains on different data from the same
initial weights.
"""
import importlib.util
import json
import os
import sys
import time

# The digits are read from scikit-learn's package without importing it (load_data, as
# load_digits reads them), and the import is refused before mxnet's: mxnet/model.py imports
# scikit-learn when it is installed only for the deprecated FeedForward's base class (object
# when it is absent), and with scipy and pandas that is 0.4 s of CPU in each of a job's
# processes (scheduler, servers and workers alike) on a 2-core machine.
SKLEARN = importlib.util.find_spec("sklearn")
sys.modules.setdefault("sklearn", None)

KVSTORE = os.environ.get("JOB_KVSTORE", "dist_sync")
if KVSTORE.startswith("mxps"):
    import mxps  # noqa: F401  (must precede mxnet: takes over server/scheduler roles)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402


def _env_int(name, default):
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def _env_flag(name):
    """True / False / None (unset or empty)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise SystemExit("%s must be 0 or 1, got %r" % (name, value))
    return value == "1"


API = os.environ.get("JOB_API", "gluon")
OPTIMIZER = os.environ.get("JOB_OPTIMIZER", "sgd")
LR_MULT = _env_flag("JOB_LR_MULT") or False
UPDATE_ON_KVSTORE = _env_flag("JOB_UPDATE_ON_KVSTORE")
STEPS = _env_int("JOB_STEPS", 20)
# an int, or None for "auto": the step the servers' store was resumed at (mxps.resume_round)
FIRST_STEP = None if os.environ.get("JOB_FIRST_STEP") == "auto" else _env_int("JOB_FIRST_STEP",
                                                                             0)
BATCH = _env_int("JOB_BATCH", 32)
DEVICES = _env_int("JOB_DEVICES", 1)
# JOB_SIMULATE_WORKERS=W: one process plays W synchronous workers exactly: W devices, device i
# fed worker i's batches, gradients summed over devices by MXNet's local kvstore, every device
# updated with the sum (what dist_sync with update on workers computes, with no network).
SIMULATE = _env_int("JOB_SIMULATE_WORKERS", 0)
MODEL = os.environ.get("JOB_MODEL", "mlp")
KV_OBJECT = _env_flag("JOB_KV_OBJECT") or False
SEED = _env_int("JOB_SEED", 42)
WAITALL = _env_flag("JOB_WAITALL") is not False
SLOW = [float(x) for x in os.environ["JOB_SLOW"].split(":")] if os.environ.get("JOB_SLOW") \
    else None
DELAY = [float(x) for x in os.environ["JOB_DELAY"].split(":")] if os.environ.get("JOB_DELAY") \
    else None
OUT = os.environ.get("JOB_OUT", "")
COMPRESSION = None
if os.environ.get("JOB_COMPRESSION"):
    _type, _threshold = os.environ["JOB_COMPRESSION"].split(":")
    COMPRESSION = {"type": _type, "threshold": float(_threshold)}
PUSH_PULL = _env_flag("JOB_PUSH_PULL") or False
CONTEXT = os.environ.get("JOB_CONTEXT", "") or "cpu"
if CONTEXT not in ("cpu", "gpu"):
    raise SystemExit("JOB_CONTEXT must be cpu or gpu, got %r" % CONTEXT)
DEVICE = mx.gpu if CONTEXT == "gpu" else mx.cpu
HIDDEN = {"mlp": [32, 32], "mlp_big": [2048, 32]}

if not OUT:
    raise SystemExit("JOB_OUT must name the output directory")
if MODEL not in HIDDEN:
    raise SystemExit("JOB_MODEL must be one of %s, got %r" % (sorted(HIDDEN), MODEL))
if OPTIMIZER not in ("sgd", "adam"):
    raise SystemExit("JOB_OPTIMIZER must be sgd or adam, got %r" % OPTIMIZER)
if API not in ("gluon", "module"):
    raise SystemExit("JOB_API must be gluon or module, got %r" % API)


def optimizer_params():
    lr = float(os.environ.get("JOB_LR", "") or (0.1 if OPTIMIZER == "sgd" else 0.01))
    params = {"learning_rate": lr, "wd": 1e-4}
    if OPTIMIZER == "sgd":
        params["momentum"] = 0.9
    return params


def load_data():
    import gzip
    if SKLEARN is None:
        raise SystemExit("train_job.py needs scikit-learn's digits: pip install scikit-learn")
    path = os.path.join(os.path.dirname(SKLEARN.origin), "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    x, y = data[:, :-1], data[:, -1].astype(int)
    order = np.random.RandomState(1234).permutation(len(y))
    return (x[order] / 16.0).astype(np.float32), y[order].astype(np.float32)


def shard(x, y, rank, shards):
    """Rank's share of the data, as STEPS batches of BATCH samples (cycling if needed)."""
    xs, ys = x[rank::shards], y[rank::shards]
    idx = np.arange(STEPS * BATCH) % len(ys)
    return xs[idx].reshape(STEPS, BATCH, xs.shape[1]), ys[idx].reshape(STEPS, BATCH)


def data_for(rank, num_workers):
    data_rank = _env_int("JOB_DATA_RANK", rank)
    shards = _env_int("JOB_DATA_SHARDS", num_workers)
    x, y = load_data()
    return shard(x, y, data_rank, shards)


def write_results(rank, num_workers, kv, weights, step_seconds, extra):
    os.makedirs(OUT, exist_ok=True)
    np.savez(os.path.join(OUT, "weights_rank%d.npz" % rank), **weights)
    meta = {
        "rank": rank, "num_workers": num_workers,
        "kvstore_requested": KVSTORE,
        "kvstore_type": kv.type if kv is not None else None,
        "api": API, "optimizer": OPTIMIZER, "model": MODEL, "devices": DEVICES,
        "context": CONTEXT,
        "steps": STEPS, "step_seconds": step_seconds, "pid": os.getpid(),
    }
    meta.update(extra)
    with open(os.path.join(OUT, "meta_rank%d.json" % rank), "w") as f:
        json.dump(meta, f, indent=1)


def run_gluon():
    from mxnet import autograd, gluon
    ctxs = [DEVICE(i) for i in range(SIMULATE or DEVICES)]
    net = gluon.nn.HybridSequential(prefix="net_")
    with net.name_scope():
        in_units = 64
        for width in HIDDEN[MODEL]:
            net.add(gluon.nn.Dense(width, activation="relu", in_units=in_units))
            in_units = width
        net.add(gluon.nn.Dense(10, in_units=in_units))
    net.initialize(mx.init.Xavier(magnitude=2.0), ctx=ctxs)
    params = net.collect_params()
    first_weight = sorted(n for n in params.keys() if n.endswith("weight"))[0]
    if LR_MULT:
        params[first_weight].lr_mult = 0.5

    kv_arg = mx.kv.create(KVSTORE) if KV_OBJECT else KVSTORE
    kwargs = {"kvstore": kv_arg}
    if UPDATE_ON_KVSTORE is not None:
        kwargs["update_on_kvstore"] = UPDATE_ON_KVSTORE
    if COMPRESSION:
        kwargs["compression_params"] = COMPRESSION
    trainer = gluon.Trainer(params, OPTIMIZER, optimizer_params(), **kwargs)
    # Create the kvstore now (Trainer would on the first step) to learn the rank, which picks
    # this worker's data. Same code path as step(), which first sets rescale_grad (it must be
    # right before set_optimizer pickles the optimizer to the servers), then calls this.
    trainer._optimizer.rescale_grad = trainer._scale / BATCH
    trainer._init_kvstore()
    first = FIRST_STEP
    if first != 0 and KVSTORE.startswith("mxps"):      # resumed: start from the stored weights
        import mxps
        mxps.resume_trainer(trainer)
        if first is None:
            first = mxps.resume_round(trainer)
    kv = trainer._kvstore
    rank = kv.rank if kv is not None else 0
    num_workers = kv.num_workers if kv is not None else 1
    if PUSH_PULL:
        def push_then_pull(key, value, out=None, priority=0):
            kv.push(key, value, priority=priority)
            kv.pull(key, out=value if out is None else out, priority=priority)
        kv.pushpull = push_then_pull
    if SIMULATE:
        shards = [data_for(i, SIMULATE) for i in range(SIMULATE)]
    else:
        xb, yb = data_for(rank, num_workers)

    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    step_seconds = []
    for step in range(first or 0, STEPS):
        t0 = time.perf_counter()
        if SIMULATE:
            xs = [mx.nd.array(sx[step], ctx=c) for (sx, _), c in zip(shards, ctxs)]
            ys = [mx.nd.array(sy[step], ctx=c) for (_, sy), c in zip(shards, ctxs)]
        else:
            xs = gluon.utils.split_and_load(xb[step], ctxs, even_split=True)
            ys = gluon.utils.split_and_load(yb[step], ctxs, even_split=True)
        with autograd.record():
            losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
        for loss in losses:
            loss.backward()
        if DELAY and (rank, step) == (int(DELAY[0]), int(DELAY[1])):
            delay_gradients(params, DELAY[2])
        if SLOW and rank == int(SLOW[0]):
            time.sleep(SLOW[1])
        trainer.step(BATCH)
        if WAITALL:
            mx.nd.waitall()
        step_seconds.append(time.perf_counter() - t0)
    mx.nd.waitall()
    weights = {name: p.data(ctxs[0]).asnumpy() for name, p in params.items()}
    for name, p in params.items():                  # devices of one worker must agree
        for c in ctxs[1:]:
            if not np.array_equal(weights[name], p.data(c).asnumpy()):
                raise SystemExit("rank %d: %s differs between %s and %s" % (
                    rank, name, ctxs[0], c))
    extra = {"update_on_kvstore": trainer._update_on_kvstore, "lr_mult_param":
             first_weight if LR_MULT else None, "kv_object": KV_OBJECT,
             "simulated_workers": SIMULATE, "compression": COMPRESSION,
             "push_pull": PUSH_PULL, "first_step": first or 0}
    for r in (range(SIMULATE) if SIMULATE else [rank]):
        write_results(r, SIMULATE or num_workers, kv, weights, step_seconds, extra)


class _RankedIter(mx.io.DataIter):
    """STEPS batches of this worker's shard; the shard is chosen on the first batch, once
    Module.fit has created the kvstore (and so the rank) from the name it was given."""

    def __init__(self, module):
        super().__init__(BATCH)
        self.module = module
        self.batches = None
        self.cursor = 0

    @property
    def provide_data(self):
        return [mx.io.DataDesc("data", (BATCH, 64))]

    @property
    def provide_label(self):
        return [mx.io.DataDesc("softmax_label", (BATCH,))]

    def reset(self):
        self.cursor = 0

    def next(self):
        if self.batches is None:
            kv = self.module._kvstore
            self.batches = data_for(kv.rank if kv is not None else 0,
                                    kv.num_workers if kv is not None else 1)
        if self.cursor >= STEPS:
            raise StopIteration
        x, y = self.batches[0][self.cursor], self.batches[1][self.cursor]
        self.cursor += 1
        return mx.io.DataBatch([mx.nd.array(x)], [mx.nd.array(y)])


def run_module():
    if UPDATE_ON_KVSTORE is not None:
        os.environ["MXNET_UPDATE_ON_KVSTORE"] = "1" if UPDATE_ON_KVSTORE else "0"
    data = mx.sym.Variable("data")
    net = data
    for i, width in enumerate(HIDDEN[MODEL]):
        net = mx.sym.FullyConnected(net, num_hidden=width, name="fc%d" % i)
        net = mx.sym.Activation(net, act_type="relu", name="relu%d" % i)
    net = mx.sym.FullyConnected(net, num_hidden=10, name="fc_out")
    net = mx.sym.SoftmaxOutput(net, name="softmax")
    ctxs = [DEVICE(i) for i in range(DEVICES)]
    mod = mx.mod.Module(net, context=ctxs, compression_params=COMPRESSION)
    it = _RankedIter(mod)
    step_seconds = []
    last = [time.perf_counter()]

    def on_batch(_param):
        now = time.perf_counter()
        step_seconds.append(now - last[0])
        last[0] = now

    mod.fit(it, kvstore=KVSTORE, optimizer=OPTIMIZER, optimizer_params=optimizer_params(),
            initializer=mx.init.Xavier(magnitude=2.0), num_epoch=1,
            batch_end_callback=on_batch)
    mx.nd.waitall()
    kv = mod._kvstore
    rank = kv.rank if kv is not None else 0
    num_workers = kv.num_workers if kv is not None else 1
    arg, aux = mod.get_params()
    weights = {k: v.asnumpy() for k, v in arg.items()}
    weights.update({"aux:" + k: v.asnumpy() for k, v in aux.items()})
    write_results(rank, num_workers, kv, weights, step_seconds, {
        "update_on_kvstore": mod._update_on_kvstore})


def delay_gradients(params, seconds):
    import threading
    from mxps.kernels import engine
    grads = [g.handle.value for p in params.values() if p.grad_req != "null"
             for g in p.list_grad()]
    engine.push_async(lambda done: threading.Timer(seconds, done).start(), [], grads, 0,
                      b"test_delay")


def main():
    mx.random.seed(SEED)
    np.random.seed(SEED)
    if API == "gluon":
        run_gluon()
    else:
        run_module()
    return 0


if __name__ == "__main__":
    sys.exit(main())
