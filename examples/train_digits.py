"""Train a small Gluon MLP on scikit-learn's bundled digits with kvstore='mxps'.

Run it with MXNet's own launcher, unchanged (inside a private network namespace, so the job
keeps to its own addresses: `mxps launch` does both):

    mxps launch -n 2 -s 2 -- python examples/train_digits.py
    # which runs: python <site-packages>/mxnet/tools/launch.py -n 2 -s 2 --launcher local \
    #                 python examples/train_digits.py

Every worker trains on its own shard of the training set (same initial weights on all of
them, synchronised by the parameter server); rank 0 prints the time per step and the final
accuracy on a held-out test set.  Options: --kvstore (default mxps; dist_sync runs native MXNet
for comparison), --epochs, --batch-size, --lr.
"""
import argparse
import os
import sys
import time

KVSTORE = "mxps"
for i, a in enumerate(sys.argv):
    if a.startswith("--kvstore="):
        KVSTORE = a.split("=", 1)[1]
    elif a == "--kvstore" and i + 1 < len(sys.argv):
        KVSTORE = sys.argv[i + 1]
if KVSTORE.startswith("mxps"):
    import mxps  # noqa: F401  (before mxnet: runs mxps's scheduler/server roles)

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kvstore", default="mxps")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()

    mx.random.seed(7)
    np.random.seed(7)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y.astype(np.float32), test_size=0.25,
                                                        random_state=0, stratify=y)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dense(64, activation="relu"),
            gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    kv = mx.kv.create(args.kvstore)
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": args.lr, "momentum": 0.9, "wd": 1e-4},
                            kvstore=kv)
    rank, nw = kv.rank, kv.num_workers
    shard = slice(rank, None, nw)
    data = gluon.data.DataLoader(gluon.data.ArrayDataset(x_train[shard], y_train[shard]),
                                 batch_size=args.batch_size, shuffle=True, last_batch="discard")
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    step_times = []
    steps_per_epoch = min(len(x_train[i::nw]) // args.batch_size for i in range(nw))
    for epoch in range(args.epochs):
        for i, (xb, yb) in enumerate(data):
            if i >= steps_per_epoch:       # every worker takes the same number of steps
                break
            t0 = time.perf_counter()
            with autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            trainer.step(xb.shape[0])
            mx.nd.waitall()
            step_times.append(time.perf_counter() - t0)
        if rank == 0:
            acc = accuracy(net, x_test, y_test)
            print("epoch %d: %.2f ms/step (median), test accuracy %.4f"
                  % (epoch, 1e3 * float(np.median(step_times[-steps_per_epoch:])), acc),
                  flush=True)
    if rank == 0:
        print("kvstore=%s type=%s workers=%d steps=%d median step %.2f ms final test accuracy "
              "%.4f" % (args.kvstore, kv.type, nw, len(step_times),
                        1e3 * float(np.median(step_times)), accuracy(net, x_test, y_test)),
              flush=True)


def accuracy(net, x, y):
    pred = net(mx.nd.array(x)).argmax(axis=1).asnumpy()
    return float((pred == y).mean())


if __name__ == "__main__":
    main()
