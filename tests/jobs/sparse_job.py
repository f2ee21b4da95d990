"""A model with a row-sparse embedding, trained on scikit-learn's digits (tests/test_sparse.py).

Every sample becomes a bag of 64 tokens, token = pixel * 17 + value (a vocabulary of 1088
ids), embedded (dimension 8), averaged, and classified by a dense layer: each step touches
only the rows of the tokens its batch holds.

Environment:
  SPARSE_OUT        directory; each worker writes weights_rank{R}.npz and meta_rank{R}.json
                    (cluster.load_weights / load_meta).  Required.
  SPARSE_KVSTORE    mxps (default) or local: the reference, one process playing
                    SPARSE_SIMULATE workers as devices cpu(0..W-1) (device i gets worker i's
                    batch), whose local kvstore sums their gradients and steps once, as a
                    synchronous parameter server does.
  SPARSE_SIMULATE   W for the reference.
  SPARSE_WEIGHT     grad (default): gluon.nn.Embedding(sparse_grad=True), a dense weight with
                    row-sparse gradients (pushed sparse, pulled dense); weight: the contrib
                    SparseEmbedding, a row-sparse weight (row_sparse_pull of the batch's rows).
  SPARSE_OPTIMIZER  sgd (default; momentum 0.9, wd 1e-4) or adam (wd 1e-4).
  SPARSE_STEPS      steps (default 12); SPARSE_BATCH samples per device per step (default 16).
  SPARSE_DEVICES    D devices cpu(0..D-1) per worker (default 1): worker w's device d gets
                    shard w * D + d of W * D (the reference: SPARSE_SIMULATE = W * D).
"""
import json
import os

KVSTORE = os.environ.get("SPARSE_KVSTORE", "mxps")
if KVSTORE.startswith("mxps"):
    import mxps  # noqa: F401  (must precede mxnet: takes over server/scheduler roles)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

OUT = os.environ["SPARSE_OUT"]
SIMULATE = int(os.environ.get("SPARSE_SIMULATE", "0") or 0)
WEIGHT = os.environ.get("SPARSE_WEIGHT", "grad")
OPTIMIZER = os.environ.get("SPARSE_OPTIMIZER", "sgd")
STEPS = int(os.environ.get("SPARSE_STEPS", "12"))
BATCH = int(os.environ.get("SPARSE_BATCH", "16"))
DEVICES = int(os.environ.get("SPARSE_DEVICES", "1") or 1)
VOCAB, DIM = 64 * 17, 8


def data(rank, workers):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    order = np.random.RandomState(1234).permutation(len(y))
    tokens = (np.arange(64) * 17 + x[order].astype(np.int64)).astype(np.float32)
    xs, ys = tokens[rank::workers], y[order][rank::workers].astype(np.float32)
    idx = np.arange(STEPS * BATCH) % len(ys)
    return xs[idx].reshape(STEPS, BATCH, 64), ys[idx].reshape(STEPS, BATCH)


class Bag(gluon.Block):
    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            if WEIGHT == "weight":
                self.embed = gluon.contrib.nn.SparseEmbedding(VOCAB, DIM)
            else:
                self.embed = gluon.nn.Embedding(VOCAB, DIM, sparse_grad=True)
            self.out = gluon.nn.Dense(10, in_units=DIM)

    def forward(self, x):
        return self.out(self.embed(x).mean(axis=1))


def main():
    mx.random.seed(7)
    ctxs = [mx.cpu(i) for i in range(SIMULATE or DEVICES)]
    net = Bag(prefix="bag_")
    net.initialize(mx.init.Uniform(0.5), ctx=ctxs)
    params = net.collect_params()
    opt = {"learning_rate": 0.5 if OPTIMIZER == "sgd" else 0.05, "wd": 1e-4}
    if OPTIMIZER == "sgd":
        opt["momentum"] = 0.9
    trainer = gluon.Trainer(params, OPTIMIZER, opt, kvstore=KVSTORE, update_on_kvstore=True)
    trainer._optimizer.rescale_grad = trainer._scale / BATCH
    trainer._init_kvstore()
    kv = trainer._kvstore
    rank, workers = (0, SIMULATE) if SIMULATE else (kv.rank, kv.num_workers)
    shards = [data(r, workers) for r in range(SIMULATE)] if SIMULATE else \
        [data(rank * DEVICES + d, workers * DEVICES) for d in range(DEVICES)]
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for step in range(STEPS):
        xs = [mx.nd.array(s[0][step], ctx=c) for s, c in zip(shards, ctxs)]
        ys = [mx.nd.array(s[1][step], ctx=c) for s, c in zip(shards, ctxs)]
        with autograd.record():
            ls = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
        for loss in ls:
            loss.backward()
        trainer.step(BATCH)
        losses.append(float(sum(loss.mean().asscalar() for loss in ls) / len(ls)))
    weights = {}
    for name, p in params.items():
        if p._stype == "row_sparse":
            rows = p.row_sparse_data(mx.nd.arange(VOCAB, ctx=ctxs[0]))
            weights[name] = rows.tostype("default").asnumpy()
        else:
            weights[name] = p.data(ctxs[0]).asnumpy()
    os.makedirs(OUT, exist_ok=True)
    for r in (range(SIMULATE) if SIMULATE else [rank]):
        np.savez(os.path.join(OUT, "weights_rank%d.npz" % r), **weights)
        with open(os.path.join(OUT, "meta_rank%d.json" % r), "w") as f:
            json.dump({"rank": r, "num_workers": workers, "kvstore_requested": KVSTORE,
                       "kvstore_type": kv.type if kv is not None else None,
                       "losses": losses, "weight": WEIGHT, "optimizer": OPTIMIZER}, f)


if __name__ == "__main__":
    main()
