"""The noise study: the label-noise generators (mxps_tools.noise), the study's
arithmetic (mxps_tools.study_noise) and one real 2-worker study cell, k = 1 and k = 4."""
import gzip
import json
import os

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from mxps_tools import noise, study_noise

SEEDS = st.integers(0, 2 ** 31 - 1)
RATIOS = st.floats(0, 1, allow_nan=False)
DIGITS = noise.digits_split()


@st.composite
def labelled(draw, min_size=0):
    """(labels, n_classes): integer labels, some classes possibly absent."""
    c = draw(st.integers(2, 12))
    ys = draw(st.lists(st.integers(0, c - 1), min_size=min_size, max_size=300))
    return np.array(ys, dtype=draw(st.sampled_from([np.int64, np.int32, np.float32]))), c


# --------------------------------------------------------------------------- the generators

@given(st.integers(2, 40), SEEDS)
def test_the_cross_pairing_is_a_derangement_and_an_involution_but_for_an_odd_counts_3_cycle(
        c, seed):
    partner = noise.cross_pairs(c, seed)
    assert sorted(partner) == list(range(c))                  # a permutation
    assert all(partner[x] != x for x in range(c))             # no fixed point
    cycled = [x for x in range(c) if partner[partner[x]] != x]
    if c % 2 == 0:
        assert cycled == []
    else:
        assert len(cycled) == 3 and all(partner[partner[partner[x]]] == x for x in cycled)


@given(labelled(), RATIOS, SEEDS, SEEDS)
def test_cross_noise_moves_exactly_the_ratio_of_each_class_to_its_partner(data, ratio, seed,
                                                                          pair_seed):
    y, c = data
    out = noise.cross_noise(y, ratio, seed, c, pair_seed)
    partner = noise.cross_pairs(c, pair_seed)
    assert out.dtype == y.dtype and out.shape == y.shape
    for cls in range(c):
        own = y == cls
        moved = own & (out != y)
        assert moved.sum() == noise.count(ratio, int(own.sum()))
        assert abs(moved.sum() - ratio * own.sum()) <= 0.5 + 1e-9
        assert set(out[moved].tolist()) <= {partner[cls]}


@given(labelled(), RATIOS, SEEDS)
def test_random_noise_replaces_exactly_the_ratio_of_labels_each_by_a_different_class(
        data, ratio, seed):
    y, c = data
    out = noise.random_noise(y, ratio, seed, c)
    changed = out != y
    # every drawn label changed (a "replacement" by the same class would count one fewer)
    assert changed.sum() == noise.count(ratio, len(y))
    assert out.min(initial=0) >= 0 and out.max(initial=0) < c
    assert np.array_equal(out.astype(np.int64), out)


@given(labelled(), RATIOS, SEEDS, st.sampled_from(["cross", "random"]))
def test_a_seed_reproduces_its_noise_and_the_input_is_never_modified(data, ratio, seed, kind):
    y, c = data
    before = y.copy()
    first = noise.apply(kind, y, ratio, seed, c)
    assert np.array_equal(y, before)
    assert np.array_equal(first, noise.apply(kind, y.copy(), ratio, seed, c))


@given(labelled(), SEEDS, st.sampled_from(noise.KINDS))
def test_ratio_zero_is_the_identity_for_every_kind(data, seed, kind):
    y, c = data
    assert np.array_equal(noise.apply(kind, y, 0.0, seed, c), y)


@pytest.mark.parametrize("kind", ["cross", "random"])
def test_different_seeds_move_different_labels(kind):
    y = noise.digits_split().y_train
    outs = {noise.apply(kind, y, 0.2, s).tobytes() for s in range(20)}
    assert len(outs) == 20


@pytest.mark.parametrize("kind, ratio, words", [
    ("gaussian", 0.1, "noise kind 'gaussian'"), ("cross", -0.1, "ratio -0.1"),
    ("random", 1.5, "ratio 1.5"), ("cross", float("nan"), "ratio nan"),
    ("random", "0.2", "ratio '0.2'"), ("none", 0.2, "kind none takes ratio 0")])
def test_a_bad_kind_or_ratio_is_refused_naming_it(kind, ratio, words):
    with pytest.raises(noise.NoiseError, match=words.replace("(", r"\(")):
        noise.apply(kind, np.array([0, 1, 2]), ratio, 1, 3)


def test_labels_that_are_not_class_indices_are_refused():
    with pytest.raises(noise.NoiseError, match="label 3 is not below n_classes=3"):
        noise.cross_noise(np.array([0, 3]), 0.5, 1, 3)
    with pytest.raises(noise.NoiseError, match="non-negative integers"):
        noise.random_noise(np.array([0.5, 1.0]), 0.5, 1, 3)
    with pytest.raises(noise.NoiseError, match="at least 2 classes"):
        noise.random_noise(np.array([0, 0]), 0.5, 1, 1)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(["cross", "random"]), st.floats(0.01, 1), SEEDS)
def test_the_noisy_split_touches_the_training_labels_only(kind, ratio, seed):
    split = DIGITS
    copies = [a.copy() for a in split]
    noisy, info = noise.noisy_split(split, kind, ratio, seed)
    for a, b in zip(split, copies):                    # nothing of the input changed
        assert np.array_equal(a, b)
    assert noisy.x_test is split.x_test and noisy.y_test is split.y_test
    assert noisy.x_train is split.x_train
    changed = noisy.y_train != split.y_train
    assert info["changed"] == changed.sum() > 0
    assert info["changed_per_class"] == np.bincount(split.y_train[changed], minlength=10).tolist()


def test_the_digits_split_is_the_digits_jobs_fixed_split():
    assert (len(DIGITS.y_train), len(DIGITS.y_test)) == (1347, 450)
    assert DIGITS.x_train.shape == (1347, 64) and 0 <= DIGITS.x_train.min() <= 1 >= \
        DIGITS.x_train.max()
    assert np.array_equal(noise.digits_split().y_test, DIGITS.y_test)


# --------------------------------------------------------------------------- local datasets

def _idx(path, arr):
    head = b"\0\0\x08" + bytes([arr.ndim]) + np.array(arr.shape, dtype=">u4").tobytes()
    with gzip.open(path + ".gz", "wb") as f:
        f.write(head + arr.astype(np.uint8).tobytes())


def test_mnist_and_cifar_files_in_mxnets_layout_are_read_and_absent_ones_reported(tmp_path):
    root = str(tmp_path)
    assert noise.locate("mnist", root) is None and noise.locate("cifar10", root) is None
    with pytest.raises(noise.NoiseError, match="dataset mnist: no files under .*nothing is "
                                               "downloaded"):
        noise.load("mnist", root)
    os.makedirs(os.path.join(root, "mnist"))
    rng = np.random.RandomState(0)
    for name, shape in zip(noise.MNIST_FILES, [(6, 28, 28), (6,), (4, 28, 28), (4,)]):
        _idx(os.path.join(root, "mnist", name), rng.randint(0, 10 if len(shape) == 1 else 256,
                                                            size=shape))
    m = noise.load("mnist", root)
    assert m.x_train.shape == (6, 1, 28, 28) and m.y_test.shape == (4,)
    assert m.x_train.max() <= 1 and m.y_train.dtype == np.int64
    d = os.path.join(root, "cifar10", noise.CIFAR_DIR)
    os.makedirs(d)
    for name in noise.CIFAR_FILES:
        rec = rng.randint(0, 256, size=(2, 3073)).astype(np.uint8)
        rec[:, 0] = [3, 7]
        rec.tofile(os.path.join(d, name))
    c = noise.load("cifar10", root)
    assert c.x_train.shape == (10, 3, 32, 32) and c.y_test.tolist() == [3, 7]


# --------------------------------------------------------------------------- the study's arithmetic

def _rec(workers, seed, t, kind="cross", ratio=20.0, final=0.9, consistency="sync", k=1):
    return {"name": "x-%d-%d-%s%g-%s%d" % (workers, seed, kind, ratio, consistency, k),
            "dataset": "digits", "kind": kind, "ratio": ratio, "consistency": consistency,
            "sync_every": k, "workers": workers, "seed": seed, "final": final,
            "time_to_target": t, "wall_seconds": 10.0, "bytes_moved": 1000}


def test_the_grid_runs_ratio_zero_once_as_none_and_averaging_with_sync_only():
    specs = study_noise.grid(["digits"], ["none", "cross", "random"], [0, 10, 40],
                             ["sync", "async"], [1, 2], [1, 4], [1, 2])
    assert {(s.kind, s.ratio) for s in specs} == {("none", 0), ("cross", 10), ("cross", 40),
                                                  ("random", 10), ("random", 40)}
    assert {s.consistency for s in specs if s.sync_every == 4} == {"sync"}
    assert len(specs) == 5 * (2 + 1) * 2 * 2          # cells x (sync k1, k4, async) x W x seeds
    assert len({s.name for s in specs}) == len(specs)


def test_the_summary_averages_seeds_and_the_speedup_is_t1_over_tw():
    recs = [_rec(1, 1, 4.0), _rec(1, 2, 6.0), _rec(2, 1, 2.0), _rec(2, 2, 3.0, final=0.8),
            _rec(4, 1, None), _rec(4, 2, 2.0),
            _rec(2, 3, None, kind="random"), dict(_rec(8, 1, 1.0), error="boom")]
    s = study_noise.summarise(recs, 0.85)
    rows = {(r["kind"], r["workers"]): r for r in s["rows"]}
    assert rows[("cross", 1)]["time_to_target"]["mean"] == 5.0
    assert rows[("cross", 2)]["speedup"] == pytest.approx(5.0 / 2.5)
    assert rows[("cross", 2)]["final"]["mean"] == pytest.approx(0.85)
    assert (rows[("cross", 4)]["reached"], rows[("cross", 4)]["runs"]) == (1, 2)
    assert rows[("cross", 4)]["speedup"] == pytest.approx(2.5)
    assert rows[("random", 2)]["speedup"] is None             # no W=1 run, never reached
    assert ("cross", 8) not in rows and s["failed"] == [recs[-1]["name"]]
    text = study_noise.format_tables(s, "digits")
    assert "| sync | cross | 20% | 90.0 (90.0-90.0) | 85.0 (80.0-90.0) | 90.0 (90.0-90.0) |" \
        in text
    assert "| sync | cross | 20% | 5.00 (2/2) | 2.50 (2/2) | 2.00 (1/2) |" in text
    assert "| sync | random | 20% |  | never (0/1) |  |" in text
    assert "| sync | cross | 20% | 1.00 | 2.00 | 2.50 |" in text


def test_the_study_refuses_averaging_without_sync_and_unknown_kinds_naming_them(capsys):
    for argv, words in ((["--consistency", "async", "--sync-every", "4"], "--sync-every"),
                        (["--kinds", "cross,gauss"], "--kinds: gauss"),
                        (["--ratios", "120"], "--ratios")):
        with pytest.raises(SystemExit):
            study_noise.main(["--out", "/nonexistent/x", "--no-plot"] + argv)
        assert words in capsys.readouterr().err


def test_a_study_resumed_with_other_settings_is_refused_naming_them(tmp_path, capsys):
    out = str(tmp_path)
    study_noise.prepare(out, study_noise.Settings(epochs=3), {}, {"mode": "installed"})
    with pytest.raises(SystemExit):
        study_noise.main(["--out", out, "--epochs", "4", "--no-plot"])
    err = capsys.readouterr().err
    assert "other settings" in err and "'epochs': 3" in err and "'epochs': 4" in err


# --------------------------------------------------------------------------- one real study cell

@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    """The command's code path: cross-noise 20%, sync, 2 workers + 1 server, 2 epochs, at
    k = 1 and k = 4."""
    out = str(tmp_path_factory.mktemp("noise-study"))
    code = study_noise.main(["--out", out, "--kinds", "cross", "--ratios", "20",
                             "--consistency", "sync", "--workers", "2", "--sync-every", "1,4",
                             "--seeds", "1", "--epochs", "2", "--no-plot", "--timeout", "120"])
    recs = {r["sync_every"]: r for r in study_noise.load_records(os.path.join(out, "runs.jsonl"))}
    return code, recs, out


def test_a_two_worker_cell_runs_end_to_end_and_learns(cell):
    code, recs, out = cell
    assert code == 0, [r.get("error") for r in recs.values()]
    r = recs[1]
    assert r["workers"] == 2 and r["kvstore_type"] == "dist_sync"
    assert len(r["curve"]) == len(r["ends"]) == 2 and r["final"] > 0.3        # chance: 0.1
    assert r["changed_labels"] == sum(noise.count(0.2, n) for n in
                                      np.bincount(DIGITS.y_train))
    assert r["bytes_moved"] > 0 and r["steps"] == 2 * r["steps_per_epoch"]
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["rows"]
    assert os.path.exists(os.path.join(out, "digits.md"))


def test_averaging_every_4_steps_ends_with_identical_workers_and_moves_fewer_bytes(cell):
    code, recs, out = cell
    r = recs[4]
    assert "error" not in r and r["averagings"] > 0
    digests = set()
    for rank in range(2):
        with open(os.path.join(out, "runs", r["name"], "rank%d.json" % rank)) as f:
            digests.add(json.load(f)["weights_sha256"])
    assert len(digests) == 1
    assert 0 < r["bytes_moved"] < recs[1]["bytes_moved"] / 2


def test_a_mnist_cell_in_mxnets_layout_trains_squeezenet_from_the_local_files(tmp_path):
    """The image path of the study (MNIST files present locally, SqueezeNet 1.1 from scratch):
    a tiny MNIST in MXNet's layout whose classes differ by where a bright square sits, 2
    workers, 1 epoch; the run completes with a synchronous pair of identical models."""
    root = str(tmp_path / "data")
    os.makedirs(os.path.join(root, "mnist"))
    rng = np.random.RandomState(3)

    def images(n):
        y = rng.randint(0, 10, size=n)
        x = rng.randint(0, 40, size=(n, 28, 28))
        for i, c in enumerate(y):
            r, q = divmod(int(c), 5)
            x[i, 4 + 10 * r:10 + 10 * r, 1 + 5 * q:5 + 5 * q] = 255
        return x, y
    (xt, yt), (xs, ys) = images(128), images(32)
    for name, arr in zip(noise.MNIST_FILES, [xt, yt, xs, ys]):
        _idx(os.path.join(root, "mnist", name), arr)
    out = str(tmp_path / "study")
    code = study_noise.main(["--out", out, "--datasets", "mnist", "--data-root", root,
                             "--kinds", "random", "--ratios", "10", "--consistency", "sync",
                             "--workers", "2", "--seeds", "1", "--epochs", "1", "--no-plot",
                             "--timeout", "300"])
    recs = study_noise.load_records(os.path.join(out, "runs.jsonl"))
    assert code == 0, [r.get("error") for r in recs]
    (r,) = recs
    assert r["dataset"] == "mnist" and r["model"] == "squeezenet"
    assert len(r["curve"]) == 1 and 0 <= r["final"] <= 1 and r["steps"] > 0
    # an accuracy over the 32 images of the test split: a whole number of them right
    assert r["final"] * len(ys) == pytest.approx(round(r["final"] * len(ys)), abs=1e-6), r
    assert r["changed_labels"] == noise.count(0.1, len(yt))     # random: a ratio of all labels
    assert os.path.exists(os.path.join(out, "mnist.md"))
