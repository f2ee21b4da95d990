"""Every dtype MXNet's kvstore carries, pushed and pulled by W workers (tests/test_input_guards.py).

Environment:
  DTYPE_KVSTORE    mxps (run as every node of a job) or local: one process plays DTYPE_WORKERS
                   workers with MXNet's local kvstore (each push is the list of the W workers'
                   gradients, which it sums as a dist server does): the reference.
  DTYPE_WORKERS    W for the local reference (mxps: the job's worker count).
  DTYPE_MODE       sum: every dtype, no optimizer (a pull is the sum of the round's pushes);
                   sgd: the floating-point dtypes with SGD (momentum, multi_precision: float16
                   weights keep a float32 master copy) on the servers / in the local kvstore.
  DTYPE_STEPS      rounds (default 4).
  DTYPE_OUT        directory: pulled_rank{R}.npz (every key's value after every round) and
                   refusals_rank{R}.json (what a second init and, in sgd mode, an integer key
                   raised).

Keys are 5x7 arrays, so MXNET_KVSTORE_BIGARRAY_BOUND=16 cuts every key over two servers.
Gradients are a fixed function of (worker, round, dtype): integers over their full range, so
sums wrap around (as in MXNet); float16 values of every magnitude.
"""
import json
import os

KV = os.environ.get("DTYPE_KVSTORE", "mxps")
if KV == "mxps":
    import mxps  # noqa: F401  (must precede mxnet: takes over server/scheduler roles)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

MODE = os.environ.get("DTYPE_MODE", "sum")
STEPS = int(os.environ.get("DTYPE_STEPS", "4"))
OUT = os.environ["DTYPE_OUT"]
SHAPE = (5, 7)
ALL = ["float32", "float64", "float16", "uint8", "int32", "int8", "int64"]
DTYPES = ALL if MODE == "sum" else ["float32", "float64", "float16"]


def numbers(dtype, seed):
    rng = np.random.RandomState(seed)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        scale = 1.0 if MODE == "sgd" else 100.0
        return (rng.standard_normal(SHAPE) * scale).astype(dt)
    info = np.iinfo(dt)
    return rng.randint(info.min, int(info.max) + 1, size=SHAPE, dtype=dt)


def grad(worker, step, i):
    return mx.nd.array(numbers(DTYPES[i], 1000 * worker + 10 * step + i + 1), dtype=DTYPES[i])


def attempt(fn):
    try:
        fn()
    except Exception as e:    # what the user sees
        return {"type": type(e).__name__, "message": str(e)}
    return None


def main():
    kv = mx.kv.create(KV)
    workers = [kv.rank] if KV == "mxps" else list(range(int(os.environ["DTYPE_WORKERS"])))
    if MODE == "sgd":
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3,
                                          multi_precision=True))
    for i, dt in enumerate(DTYPES):
        kv.init(i, mx.nd.array(numbers(dt, 7 + i), dtype=dt))
    pulled = {}
    for step in range(STEPS):
        for i, dt in enumerate(DTYPES):
            grads = [grad(w, step, i) for w in workers]
            kv.push(i, grads if len(grads) > 1 else grads[0])
            out = mx.nd.zeros(SHAPE, dtype=dt)
            kv.pull(i, out=out)
            pulled["%s_round%d" % (dt, step + 1)] = out.asnumpy()
    mx.nd.waitall()
    rank = workers[0]
    os.makedirs(OUT, exist_ok=True)
    np.savez(os.path.join(OUT, "pulled_rank%d.npz" % rank), **pulled)
    if KV == "mxps":
        refusals = {"second_init": attempt(lambda: kv.init(0, mx.nd.zeros(SHAPE)))}
        if MODE == "sgd":
            refusals["int_key"] = attempt(lambda: kv.init(50, mx.nd.zeros(SHAPE, dtype="int32")))
        with open(os.path.join(OUT, "refusals_rank%d.json" % rank), "w") as f:
            json.dump(refusals, f)


if __name__ == "__main__":
    main()
