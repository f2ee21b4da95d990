"""A table initialised from a rule (mxps.TableInit), pulled and pushed row by row
(tests/test_table_init.py).  TABLE_OUT: directory for rank<R>.json (the rows pulled before
and after one round of sparse pushes); TABLE_ROWS, TABLE_COLS: the table's shape (default
5000 x 8)."""
import json
import os

import mxps
import mxnet as mx
import numpy as np

ROWS = int(os.environ.get("TABLE_ROWS", 5000))
COLS = int(os.environ.get("TABLE_COLS", 8))
OUT = os.environ["TABLE_OUT"]


def main():
    kv = mx.kv.create("mxps")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))
    kv.init("table", mxps.TableInit((ROWS, COLS), scale=0.5, seed=3))
    ids = mx.nd.array([0, 7, 2499, 2500, 4999], dtype="int64")
    out = mx.nd.sparse.zeros("row_sparse", (ROWS, COLS))
    kv.row_sparse_pull("table", out=out, row_ids=ids)
    before = out.data.asnumpy().tolist()
    grad = mx.nd.sparse.row_sparse_array((np.ones((2, COLS), np.float32),
                                          np.array([7, 2500], np.int64)), shape=(ROWS, COLS))
    kv.push("table", grad)
    kv.row_sparse_pull("table", out=out, row_ids=ids)
    after = out.data.asnumpy().tolist()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "rank%d.json" % kv.rank), "w") as f:
        json.dump({"before": before, "after": after,
                   "ids": out.indices.asnumpy().tolist()}, f)


if __name__ == "__main__":
    main()
