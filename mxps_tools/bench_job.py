"""One node of a throughput benchmark: a gluoncv image model on synthetic images.

Run as every node of a parameter-server job (scheduler, servers and workers alike, as MXNet's
launcher does); on scheduler/server nodes the import of mxps (or mxnet, for native kvstores)
takes the role over.  Each worker trains on random images (fixed seed per rank) and, at the
end, writes one JSON line to --out (or stdout) with its per-step wall times, the parameter
sizes in kvstore key order (for bytes-per-server predictions) and absolute step timestamps.
With --progress every worker also prints ``BENCH_STEP <rank> <step> <unix time>`` after each
step (``mxps bench`` follows these for its progress bar and its measurement windows).

    python -m mxps_tools.bench_job --kvstore mxps --model resnet18_v1 --steps 20 --out r.jsonl
"""
import argparse
import json
import os
import time

_p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_p.add_argument("--kvstore", default="mxps")
_p.add_argument("--model", default="resnet18_v1",
                help="gluoncv model name (resnet18_v1, alexnet, vgg11, ...) or 'mlp'")
_p.add_argument("--batch-size", type=int, default=16, help="per worker")
_p.add_argument("--image-size", type=int, default=32)
_p.add_argument("--classes", type=int, default=10)
_p.add_argument("--steps", type=int, default=20, help="timed steps")
_p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
_p.add_argument("--update-on-kvstore", type=int, choices=(0, 1), default=None)
_p.add_argument("--mlp-hidden", type=int, default=4096, help="width of the 'mlp' model")
_p.add_argument("--compute-steps", type=int, default=0,
                help="first time this many steps of a private copy of the model without any "
                     "kvstore (compute only, before the job's rendezvous); reported as "
                     "compute_seconds")
_p.add_argument("--progress", action="store_true", help="print a BENCH_STEP line per step")
_p.add_argument("--out", default=None, help="append the result line to this file")
ARGS = _p.parse_args()

if ARGS.kvstore.startswith("mxps"):
    import mxps  # noqa: F401  (must precede mxnet: takes over server/scheduler roles)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

from mxps_tools import compressed  # noqa: E402


def build(name, classes, hidden=4096):
    if name == "mlp":
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(hidden, activation="relu"),
                gluon.nn.Dense(hidden, activation="relu"), gluon.nn.Dense(classes))
        return net
    from gluoncv.model_zoo import get_model
    return get_model(name, classes=classes, pretrained=False)


def main():
    mx.random.seed(1)
    net = build(ARGS.model, ARGS.classes, ARGS.mlp_hidden)
    net.initialize(mx.init.Xavier(magnitude=2))
    net.hybridize(static_alloc=True, static_shape=True)
    params = {"learning_rate": 0.01, "momentum": 0.9, "wd": 1e-4}
    shape = (ARGS.batch_size, 3, ARGS.image_size, ARGS.image_size)
    rng = np.random.RandomState(99)   # probe data; the real data (below) depends on the rank
    x = mx.nd.array(rng.uniform(-1, 1, size=shape).astype(np.float32))
    y = mx.nd.array(rng.randint(0, ARGS.classes, size=ARGS.batch_size).astype(np.float32))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    compute = []
    if ARGS.compute_steps:
        # Compute only: same model, data and optimizer, no kvstore (no communication).
        pnet = build(ARGS.model, ARGS.classes, ARGS.mlp_hidden)
        pnet.initialize(mx.init.Xavier(magnitude=2))
        pnet.hybridize(static_alloc=True, static_shape=True)
        ptr = gluon.Trainer(pnet.collect_params(), "sgd", params, kvstore=None)
        for step in range(1 + ARGS.compute_steps):
            t0 = time.perf_counter()
            with autograd.record():
                ploss = loss_fn(pnet(x), y)
            ploss.backward()
            ptr.step(ARGS.batch_size)
            ploss.wait_to_read()
            for p in pnet.collect_params().values():
                p.data().wait_to_read()
            if step:
                compute.append(time.perf_counter() - t0)
        del pnet, ptr
    net(x).wait_to_read()   # materialise deferred shapes
    # Trainer sorts a ParameterDict by name; its kvstore keys are the indices in that order.
    names = sorted(net.collect_params().keys())
    sizes = [int(np.prod(net.collect_params()[k].shape)) for k in names]
    if ARGS.progress:
        print("BENCH_PARAMS %s" % json.dumps(sizes), flush=True)
    kv = mx.kv.create(ARGS.kvstore)
    kw = {} if ARGS.update_on_kvstore is None else {
        "update_on_kvstore": bool(ARGS.update_on_kvstore)}
    compression = compressed.params_from_env()
    if compression:
        kw["compression_params"] = compression
        compressed.push_then_pull(kv)
    trainer = gluon.Trainer(net.collect_params(), "sgd", params, kvstore=kv, **kw)
    rng = np.random.RandomState(100 + kv.rank)
    x = mx.nd.array(rng.uniform(-1, 1, size=shape).astype(np.float32))
    y = mx.nd.array(rng.randint(0, ARGS.classes, size=ARGS.batch_size).astype(np.float32))
    times = []
    stamps = []
    starts_abs = []
    ends_abs = []
    t_start = time.time()
    for step in range(ARGS.warmup + ARGS.steps):
        t0 = time.perf_counter()
        w0 = time.time()
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(ARGS.batch_size)
        loss.wait_to_read()
        for p in net.collect_params().values():
            p.data().wait_to_read()
        if step >= ARGS.warmup:
            times.append(time.perf_counter() - t0)
            stamps.append(time.time() - t_start)
            starts_abs.append(w0)
            ends_abs.append(time.time())
        if ARGS.progress:
            print("BENCH_STEP %d %d %.6f" % (kv.rank, step, time.time()), flush=True)
    n_params = sum(sizes)
    line = json.dumps({"kvstore": ARGS.kvstore, "type": kv.type, "rank": kv.rank,
                       "num_workers": kv.num_workers, "model": ARGS.model,
                       "params": n_params, "bytes": 4 * n_params,
                       "batch_size": ARGS.batch_size, "step_seconds": times,
                       "step_end_wall": stamps, "step_start_abs": starts_abs,
                       "step_end_abs": ends_abs, "warmup": ARGS.warmup,
                       "param_names": names, "param_sizes": sizes, "compute_seconds": compute, "dtype_bytes": 4,
                       "pid": os.getpid(), "compression": compression,
                       "loss": float(loss.mean().asscalar())})
    if ARGS.out:
        with open(ARGS.out, "a") as f:
            f.write(line + "\n")
    else:
        print(line, flush=True)


if __name__ == "__main__":
    main()
