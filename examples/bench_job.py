"""One node of a throughput benchmark: a gluoncv image model on synthetic images.

Run as every node of a parameter-server job (scheduler, servers and workers alike, as MXNet's
launcher does); on scheduler/server nodes the import of mxps (or mxnet, for native kvstores)
takes the role over.  Each worker trains on random images (fixed seed per rank) and, at the
end, writes one JSON line to --out (or stdout) with its per-step wall times.

    python examples/bench_job.py --kvstore mxps --model resnet18_v1 --steps 20 --out r.jsonl
"""
import argparse
import json
import os
import sys
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
_p.add_argument("--out", default=None, help="append the result line to this file")
ARGS = _p.parse_args()

if ARGS.kvstore.startswith("mxps"):
    import mxps  # noqa: F401  (must precede mxnet: takes over server/scheduler roles)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402


def build(name, classes):
    if name == "mlp":
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(4096, activation="relu"), gluon.nn.Dense(4096, activation="relu"),
                gluon.nn.Dense(classes))
        return net
    from gluoncv.model_zoo import get_model
    return get_model(name, classes=classes, pretrained=False)


def main():
    mx.random.seed(1)
    net = build(ARGS.model, ARGS.classes)
    net.initialize(mx.init.Xavier(magnitude=2))
    net.hybridize(static_alloc=True, static_shape=True)
    kv = mx.kv.create(ARGS.kvstore)
    params = {"learning_rate": 0.01, "momentum": 0.9, "wd": 1e-4}
    kw = {} if ARGS.update_on_kvstore is None else {
        "update_on_kvstore": bool(ARGS.update_on_kvstore)}
    trainer = gluon.Trainer(net.collect_params(), "sgd", params, kvstore=kv, **kw)
    rng = np.random.RandomState(100 + kv.rank)
    shape = (ARGS.batch_size, 3, ARGS.image_size, ARGS.image_size)
    x = mx.nd.array(rng.uniform(-1, 1, size=shape).astype(np.float32))
    y = mx.nd.array(rng.randint(0, ARGS.classes, size=ARGS.batch_size).astype(np.float32))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    times = []
    stamps = []
    t_start = time.time()
    for step in range(ARGS.warmup + ARGS.steps):
        t0 = time.perf_counter()
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
    n_params = sum(int(np.prod(p.shape)) for p in net.collect_params().values())
    line = json.dumps({"kvstore": ARGS.kvstore, "type": kv.type, "rank": kv.rank,
                       "num_workers": kv.num_workers, "model": ARGS.model,
                       "params": n_params, "bytes": 4 * n_params,
                       "batch_size": ARGS.batch_size, "step_seconds": times,
                       "step_end_wall": stamps, "loss": float(loss.mean().asscalar())})
    if ARGS.out:
        with open(ARGS.out, "a") as f:
            f.write(line + "\n")
    else:
        print(line, flush=True)


if __name__ == "__main__":
    main()
