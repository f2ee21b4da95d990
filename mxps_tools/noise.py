"""Label noise for the noise study (``mxps study noise``): pure numpy, no MXNet.

Two kinds of noise, as the seed study defines them, applied to the *training* labels only:

- **cross**: a fixed pairing of the classes, ``partner = cross_pairs(n_classes, pair_seed)``: a
  seeded permutation of the classes cut into consecutive pairs, ``perm[0] <-> perm[1]``,
  ``perm[2] <-> perm[3]``, ...; an involution without fixed points (``partner[partner[c]] == c
  != partner[c]``).  With an odd number of classes the last three of the permutation form a
  3-cycle ``a -> b -> c -> a`` instead (still no fixed point; not an involution on those
  three).  Of each class c's n_c training labels exactly ``count(ratio, n_c)`` are moved to
  ``partner[c]``: the pairs of classes are confused with each other.
- **random**: exactly ``count(ratio, n)`` of the n training labels, drawn uniformly without
  replacement, are replaced by a uniformly drawn *different* class (uniform over the other
  C - 1 classes): every replaced label is wrong, so the ratio is the fraction of wrong labels,
  as for cross-noise (drawing over all C classes would leave 1/C of them right).
- **none**: the labels as they are (ratio 0 only).  A ratio of 0 is the identity for every
  kind; the study runs it once, as ``none``.

``count(ratio, n)`` is ``ratio * n`` rounded half up (``floor(ratio * n + 0.5)``, with a 1e-9
allowance so that 0.15 * 10, 1.4999999999999998 in binary, gives 2).  Which samples move is
drawn by ``numpy.random.RandomState(seed)`` (the legacy generator: the same stream in every
numpy version), so a seed gives the same noisy labels everywhere; inputs are never modified.

The datasets, as ``Split(x_train, y_train, x_test, y_test)`` with integer labels:
``digits_split`` (scikit-learn's 1797 digits, the split of tests/jobs/digits_job.py: 25%
stratified test, ``random_state=0``; 8x8 pixels in [0, 1]) and, when their files are present
under a root directory (never downloaded), ``mnist_split`` (the four idx files MXNet's
``gluon.data.vision.MNIST`` keeps in its root, gzipped or not) and ``cifar10_split`` (the
binary batches of ``gluon.data.vision.CIFAR10``: ``<root>/cifar-10-batches-bin/*.bin``).
``noisy_split`` applies a noise to a split's training labels and hands the test arrays back as
they are (the same objects).
"""
import gzip
import math
import os
from typing import NamedTuple, Optional, Tuple

import numpy as np

KINDS = ("none", "cross", "random")
DATASETS = ("digits", "mnist", "cifar10")
#: MXNet's default dataset roots live under this directory (``~/.mxnet/datasets/<name>``)
MXNET_DATASETS = os.path.join("~", ".mxnet", "datasets")
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CIFAR_DIR = "cifar-10-batches-bin"
CIFAR_FILES = tuple("data_batch_%d.bin" % i for i in range(1, 6)) + ("test_batch.bin",)
DIGITS_TEST_FRACTION = 0.25
DIGITS_SPLIT_SEED = 0


class NoiseError(ValueError):
    """A noise or dataset that cannot be made as asked (the message names the setting)."""


class Split(NamedTuple):
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


# --------------------------------------------------------------------------- the noise

def check(kind: str, ratio: float) -> None:
    """Refuse an unknown kind, a ratio outside [0, 1], and ``none`` with a ratio above 0."""
    if kind not in KINDS:
        raise NoiseError("noise kind %r is not one of %s" % (kind, ", ".join(KINDS)))
    if not isinstance(ratio, (int, float, np.floating, np.integer)) or isinstance(ratio, bool) \
            or not math.isfinite(ratio) or not 0 <= ratio <= 1:
        raise NoiseError("noise ratio %r is not a fraction in [0, 1]" % (ratio,))
    if kind == "none" and ratio != 0:
        raise NoiseError("noise kind none takes ratio 0, got %r" % (ratio,))


def count(ratio: float, n: int) -> int:
    """How many of n labels a ratio moves: ``ratio * n`` rounded half up."""
    return min(n, int(math.floor(ratio * n + 0.5 + 1e-9)))


def _classes(labels: np.ndarray, n_classes: Optional[int]) -> Tuple[np.ndarray, int]:
    """The labels as int64 (checked: integers in [0, n_classes)) and the class count."""
    y = np.asarray(labels)
    if y.ndim != 1:
        raise NoiseError("labels must be one-dimensional, got shape %s" % (y.shape,))
    yi = y.astype(np.int64)
    if y.size and (not np.array_equal(yi, y) or yi.min() < 0):
        raise NoiseError("labels must be non-negative integers")
    c = int(n_classes) if n_classes is not None else (int(yi.max()) + 1 if y.size else 0)
    if y.size and yi.max() >= c:
        raise NoiseError("label %d is not below n_classes=%d" % (yi.max(), c))
    if c < 2:
        raise NoiseError("label noise needs at least 2 classes, got n_classes=%d" % c)
    return yi, c


def cross_pairs(n_classes: int, pair_seed: int = 0) -> np.ndarray:
    """``partner[c]`` for every class: a seeded derangement made of 2-cycles (a 3-cycle for the
    last three classes of the permutation when n_classes is odd)."""
    if int(n_classes) < 2:
        raise NoiseError("cross-noise pairs classes: n_classes must be at least 2, got %r"
                         % (n_classes,))
    perm = np.random.RandomState(pair_seed).permutation(int(n_classes))
    partner = np.empty(len(perm), dtype=np.int64)
    pairs = len(perm) // 2 - (len(perm) % 2)          # an odd count keeps 3 for the cycle
    for i in range(pairs):
        a, b = perm[2 * i], perm[2 * i + 1]
        partner[a], partner[b] = b, a
    if len(perm) % 2:
        a, b, c = perm[-3:]
        partner[a], partner[b], partner[c] = b, c, a
    return partner


def cross_noise(labels, ratio: float, seed: int, n_classes: Optional[int] = None,
                pair_seed: int = 0) -> np.ndarray:
    """A copy of ``labels`` with ``count(ratio, n_c)`` labels of each class c moved to its
    partner (``cross_pairs``)."""
    check("cross", ratio)
    y, c = _classes(labels, n_classes)
    partner = cross_pairs(c, pair_seed)
    rng = np.random.RandomState(seed)
    out = y.copy()
    for cls in range(c):
        idx = np.flatnonzero(y == cls)
        moved = rng.choice(idx, count(ratio, len(idx)), replace=False)
        out[moved] = partner[cls]
    return out.astype(np.asarray(labels).dtype)


def random_noise(labels, ratio: float, seed: int, n_classes: Optional[int] = None) -> np.ndarray:
    """A copy of ``labels`` with ``count(ratio, n)`` of them replaced by a different class,
    uniform over the other n_classes - 1."""
    check("random", ratio)
    y, c = _classes(labels, n_classes)
    rng = np.random.RandomState(seed)
    moved = rng.choice(len(y), count(ratio, len(y)), replace=False)
    out = y.copy()
    out[moved] = (y[moved] + rng.randint(1, c, size=len(moved))) % c
    return out.astype(np.asarray(labels).dtype)


def apply(kind: str, labels, ratio: float, seed: int, n_classes: Optional[int] = None,
          pair_seed: int = 0) -> np.ndarray:
    """The noise ``kind`` at ``ratio`` (a fraction) on a copy of ``labels``."""
    check(kind, ratio)
    if kind == "cross":
        return cross_noise(labels, ratio, seed, n_classes, pair_seed)
    if kind == "random":
        return random_noise(labels, ratio, seed, n_classes)
    _classes(labels, n_classes)
    return np.array(labels, copy=True)


def noisy_split(split: Split, kind: str, ratio: float, seed: int, n_classes: Optional[int] = None,
                pair_seed: int = 0) -> Tuple[Split, dict]:
    """``split`` with noisy training labels (the test arrays are handed back untouched) and a
    report: how many training labels changed, per class of origin."""
    n_classes = n_classes if n_classes is not None else \
        int(max(np.max(split.y_train), np.max(split.y_test))) + 1
    y = apply(kind, split.y_train, ratio, seed, n_classes, pair_seed)
    changed = np.asarray(split.y_train) != y
    per_class = np.bincount(np.asarray(split.y_train, dtype=np.int64)[changed],
                            minlength=n_classes)
    info = {"kind": kind, "ratio": float(ratio), "seed": seed, "changed": int(changed.sum()),
            "changed_per_class": per_class.tolist(), "train": int(len(y))}
    if kind == "cross":
        info["partner"] = cross_pairs(n_classes, pair_seed).tolist()
    return Split(split.x_train, y, split.x_test, split.y_test), info


# --------------------------------------------------------------------------- the data

def digits_split() -> Split:
    """scikit-learn's digits, the split of tests/jobs/digits_job.py; x (n, 64) in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split((x / 16.0).astype(np.float32), y.astype(np.int64),
                                          test_size=DIGITS_TEST_FRACTION, stratify=y,
                                          random_state=DIGITS_SPLIT_SEED)
    return Split(xtr, ytr, xte, yte)


def _dataset_dirs(name: str, root: Optional[str]):
    """Where a dataset's files may be: ``<root>/<name>`` and ``<root>`` (root default: MXNet's
    ``~/.mxnet/datasets``)."""
    base = os.path.expanduser(root or MXNET_DATASETS)
    return [os.path.join(base, name), base]


def _find(dirs, names) -> Optional[dict]:
    """{name: path} when every file is in one of ``dirs`` (``.gz`` allowed), else None."""
    for d in dirs:
        found = {}
        for n in names:
            for cand in (os.path.join(d, n), os.path.join(d, n + ".gz")):
                if os.path.isfile(cand):
                    found[n] = cand
                    break
        if len(found) == len(names):
            return found
    return None


def locate(name: str, root: Optional[str] = None) -> Optional[dict]:
    """The files of dataset ``name`` under ``root`` ({file: path}), None if absent; digits
    always is (it ships with scikit-learn)."""
    if name == "digits":
        return {}
    if name == "mnist":
        return _find(_dataset_dirs("mnist", root), MNIST_FILES)
    if name == "cifar10":
        return _find([os.path.join(d, CIFAR_DIR) for d in _dataset_dirs("cifar10", root)],
                     CIFAR_FILES)
    raise NoiseError("dataset %r is not one of %s" % (name, ", ".join(DATASETS)))


def _read(path: str) -> bytes:
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        return f.read()


def read_idx(path: str) -> np.ndarray:
    """An idx file (MNIST's format: magic 0x0000 08 <ndim>, big-endian sizes, uint8 data)."""
    raw = _read(path)
    if len(raw) < 4 or raw[:3] != b"\0\0\x08":
        raise NoiseError("%s is not an idx file of unsigned bytes" % path)
    ndim = raw[3]
    shape = tuple(int(x) for x in np.frombuffer(raw[4:4 + 4 * ndim], dtype=">u4"))
    data = np.frombuffer(raw[4 + 4 * ndim:], dtype=np.uint8)
    if data.size != int(np.prod(shape)):
        raise NoiseError("%s holds %d values, its header says %s" % (path, data.size, shape))
    return data.reshape(shape)


def mnist_split(files: dict) -> Split:
    """MNIST from ``locate('mnist')``'s files: x (n, 1, 28, 28) in [0, 1]."""
    xtr, ytr, xte, yte = (read_idx(files[n]) for n in MNIST_FILES)
    return Split((xtr[:, None] / 255.0).astype(np.float32), ytr.astype(np.int64),
                 (xte[:, None] / 255.0).astype(np.float32), yte.astype(np.int64))


def read_cifar(path: str) -> Tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 binary batch: records of a label byte and 3x32x32 pixel bytes."""
    raw = np.frombuffer(_read(path), dtype=np.uint8)
    if raw.size % 3073:
        raise NoiseError("%s is not a CIFAR-10 batch (%d bytes, not a multiple of 3073)"
                         % (path, raw.size))
    rec = raw.reshape(-1, 3073)
    return (rec[:, 1:].reshape(-1, 3, 32, 32) / 255.0).astype(np.float32), \
        rec[:, 0].astype(np.int64)


def cifar10_split(files: dict) -> Split:
    """CIFAR-10 from ``locate('cifar10')``'s files: x (n, 3, 32, 32) in [0, 1]."""
    train = [read_cifar(files[n]) for n in CIFAR_FILES[:-1]]
    xte, yte = read_cifar(files[CIFAR_FILES[-1]])
    return Split(np.concatenate([t[0] for t in train]), np.concatenate([t[1] for t in train]),
                 xte, yte)


def load(name: str, root: Optional[str] = None, limit: int = 0) -> Split:
    """Dataset ``name`` (its first ``limit`` training and test samples if ``limit``)."""
    files = locate(name, root)
    if files is None:
        raise NoiseError("dataset %s: no files under %s (nothing is downloaded)"
                         % (name, " or ".join(_dataset_dirs(name, root))))
    split = digits_split() if name == "digits" else \
        mnist_split(files) if name == "mnist" else cifar10_split(files)
    if limit:
        split = Split(split.x_train[:limit], split.y_train[:limit], split.x_test[:limit],
                      split.y_test[:limit])
    return split
