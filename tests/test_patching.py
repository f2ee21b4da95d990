"""Tests for mxps_tools.patching (the MXNet 1.9.1 patch files, mxps-patch) and the runtime fixes
(mxps.adapter.fixes).

Nothing here modifies the real environment: the installed files are copied (as their pristine
MXNet 1.9.1 content, even if the real environment is already patched) into a temporary
directory laid out like site-packages. patching.py and fixes.py are loaded from their files, so
the tests do not depend on an install or on mxps/__init__.py (whose import starts a role in a
server process). The installed console script and the wheel's layout: tests/test_install.py.
"""
import base64
import csv
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHING_PY = os.path.join(REPO, "mxps_tools", "patching.py")
FIXES_PY = os.path.join(REPO, "mxps", "adapter", "fixes.py")
PATCHES_DIR = os.path.join(REPO, "patches")


def _load_patching(path=PATCHING_PY, name="mxps_patching_under_test"):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


patching = _load_patching()
REAL_SP = patching.find_site_packages()
PATCHED_FILES = sorted({f.path for p in patching.load_patches(PATCHES_DIR) for f in p.files})


def _record_hashes():
    """sha256 of every file as shipped in the mxnet wheel (from its dist-info RECORD)."""
    import importlib.metadata
    dist = importlib.metadata.distribution("mxnet")
    hashes = {}
    for row in csv.reader((dist.read_text("RECORD") or "").splitlines()):
        if len(row) >= 2 and row[1].startswith("sha256="):
            hashes[row[0]] = row[1][len("sha256="):]
    return hashes


def _sha256_b64(data):
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def site(tmp_path):
    """A tmp dir laid out like site-packages with the pristine MXNet 1.9.1 files to patch."""
    sp = tmp_path / "site-packages"
    # the whole dmlc_tracker package (it is imported and run below), and mxnet/model.py
    shutil.copytree(os.path.join(REAL_SP, "dmlc_tracker"), sp / "dmlc_tracker",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (sp / "mxnet").mkdir()
    shutil.copy2(os.path.join(REAL_SP, "mxnet", "model.py"), sp / "mxnet" / "model.py")
    # whatever the real state, write the original content (the real venv may be patched)
    for p in patching.load_patches(PATCHES_DIR):
        for f in p.files:
            target = os.path.join(str(sp), *f.path.split("/"))
            state, original, _ = patching._file_state(p, f, target)
            with open(target, "w", encoding="utf-8", newline="") as out:
                out.write(original)
    return str(sp)


def _snapshot(sp):
    return {rel: _read_bytes(os.path.join(sp, *rel.split("/"))) for rel in PATCHED_FILES}


# --------------------------------------------------------------------------- patch files

def test_every_patch_file_has_a_header_and_targets_a_file_in_site_packages():
    patches = patching.load_patches(PATCHES_DIR)
    assert [p.name for p in patches] == sorted(
        n for n in os.listdir(PATCHES_DIR) if n.endswith(".patch"))
    assert len(patches) >= 2
    for p in patches:
        for word in ("Why:", "File:", "Versions:", "Verify:"):
            assert word in p.header, "%s: header lacks %r" % (p.name, word)
        for f in p.files:
            assert os.path.isfile(os.path.join(REAL_SP, *f.path.split("/"))), f.path


def test_pristine_copies_match_the_mxnet_wheel_record(site):
    hashes = _record_hashes()
    for rel in PATCHED_FILES:
        assert _sha256_b64(_read_bytes(os.path.join(site, rel))) == hashes[rel], rel


# --------------------------------------------------------------------------- apply/check/revert

def test_apply_then_check_reports_applied_and_a_second_apply_changes_nothing(site, capsys):
    patches = patching.load_patches(PATCHES_DIR)
    assert not patching.check(site, patches)
    assert patching.main(["check", "--site-packages", site, "--patches-dir", PATCHES_DIR]) == 1
    out = capsys.readouterr().out
    assert out.count("not applied") == len(patches)

    assert [w for _, w in patching.apply(site, patches)] == ["applied"] * len(patches)
    assert patching.check(site, patches)
    assert patching.main(["check", "--site-packages", site, "--patches-dir", PATCHES_DIR]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(patches)
    assert all(line.startswith("applied") for line in lines)

    before = _snapshot(site)
    mtimes = {rel: os.stat(os.path.join(site, rel)).st_mtime_ns for rel in PATCHED_FILES}
    assert patching.main(["apply", "--site-packages", site, "--patches-dir", PATCHES_DIR]) == 0
    out = capsys.readouterr().out
    assert out.count("already applied") == len(patches)
    assert _snapshot(site) == before
    assert {rel: os.stat(os.path.join(site, rel)).st_mtime_ns for rel in PATCHED_FILES} == mtimes


def test_revert_restores_byte_identical_originals_and_twice_is_a_noop(site, capsys):
    original = _snapshot(site)
    patching.apply(site)
    assert _snapshot(site) != original
    assert all(w == "not applied" for _, w in patching.revert(site))
    assert _snapshot(site) == original
    hashes = _record_hashes()
    for rel, data in _snapshot(site).items():
        assert _sha256_b64(data) == hashes[rel], rel
    assert patching.main(["revert", "--site-packages", site]) == 0
    assert "already not applied" in capsys.readouterr().out
    assert _snapshot(site) == original


def test_the_patches_make_the_intended_changes(site):
    patching.apply(site)
    tracker = open(os.path.join(site, "dmlc_tracker", "tracker.py")).read()
    assert "isAlive" not in tracker and tracker.count(".is_alive()") == 4
    model = open(os.path.join(site, "mxnet", "model.py")).read()
    assert "kvstore.lower() not in kvs.KVStoreBase.kv_registry" in model


def test_check_on_a_tampered_file_gives_an_error_naming_the_file(site, capsys):
    model = os.path.join(site, "mxnet", "model.py")
    text = open(model).read()
    with open(model, "w") as f:
        f.write(text.replace("if num_device == 1 and 'dist' not in kvstore:",
                             "if num_device == 1 and 'dist' not in kvstore and False:"))
    with pytest.raises(patching.PatchError, match="unexpected content in .*model.py"):
        patching.check(site)
    assert patching.main(["check", "--site-packages", site]) == 1
    err = capsys.readouterr().err
    assert model in err and "neither the original" in err

    # apply refuses before writing anything: the (good) tracker.py is left unpatched
    tracker_before = _read_bytes(os.path.join(site, "dmlc_tracker", "tracker.py"))
    model_before = _read_bytes(model)
    assert patching.main(["apply", "--site-packages", site]) == 1
    assert model in capsys.readouterr().err
    assert _read_bytes(os.path.join(site, "dmlc_tracker", "tracker.py")) == tracker_before
    assert _read_bytes(model) == model_before


def test_a_half_hand_fixed_file_is_refused(site):
    tracker = os.path.join(site, "dmlc_tracker", "tracker.py")
    text = open(tracker).read()
    with open(tracker, "w") as f:
        f.write(text.replace("isAlive", "is_alive", 1))
    with pytest.raises(patching.PatchError, match="tracker.py"):
        patching.apply(site)


def test_a_missing_file_is_named(site):
    os.unlink(os.path.join(site, "mxnet", "model.py"))
    with pytest.raises(patching.PatchError, match="not found: .*model.py"):
        patching.status(site)


def test_no_temp_files_are_left_behind(site):
    patching.apply(site)
    patching.revert(site)
    for d in ("mxnet", "dmlc_tracker"):
        assert not [n for n in os.listdir(os.path.join(site, d)) if n.startswith(".mxps-patch")]


@pytest.mark.skipif(not shutil.which("patch"), reason="GNU patch not installed")
def test_gnu_patch_and_the_python_applier_give_identical_bytes(site, tmp_path):
    other = str(tmp_path / "other")
    shutil.copytree(site, other)
    for p in patching.load_patches(PATCHES_DIR):
        with open(p.source, "rb") as f:
            r = subprocess.run(["patch", "-p1", "-F0", "-d", other], stdin=f,
                               capture_output=True)
        assert r.returncode == 0, r.stdout + r.stderr
    patching.apply(site)
    assert _snapshot(other) == _snapshot(site)


def test_patch_files_are_found_in_the_installed_layout(tmp_path):
    """Installed (`pip install .`), the patches are package data mxps_tools/_patches beside
    patching.py."""
    pkg = tmp_path / "lib" / "mxps_tools"
    shutil.copytree(PATCHES_DIR, pkg / "_patches")
    shutil.copy(PATCHING_PY, pkg / "patching.py")
    mod = _load_patching(str(pkg / "patching.py"), "mxps_patching_installed_layout")
    assert mod.patches_dir() == str(pkg / "_patches")
    assert [p.name for p in mod.load_patches()] == [
        p.name for p in patching.load_patches(PATCHES_DIR)]


# --------------------------------------------------------------------------- patch 0001 works

def _run(code, env_extra=None, cwd=None, timeout=120, drop=("DMLC_ROLE",)):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


TRACKER_SCRIPT = """
    import sys
    sys.path.insert(0, %r)
    from dmlc_tracker import tracker
    assert tracker.__file__.startswith(%r), tracker.__file__
    t = tracker.PSTracker('127.0.0.1', 'true')   # runs `true` as the "scheduler"
    t.join()
    print('alive after join:', t.alive())
"""


def test_patched_tracker_runs_on_this_python_and_the_unpatched_raises(site):
    r = _run(TRACKER_SCRIPT % (site, site))
    if sys.version_info >= (3, 9):
        assert r.returncode != 0
        assert "AttributeError" in r.stderr and "isAlive" in r.stderr
    patching.apply(site)
    r = _run(TRACKER_SCRIPT % (site, site))
    assert r.returncode == 0, r.stderr
    assert "alive after join: False" in r.stdout


def test_mxnet_launcher_runs_a_native_dist_sync_job_with_the_patched_tracker(site, tmp_path):
    patching.apply(site)
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import mxnet as mx
        kv = mx.kv.create('dist_sync')
        kv.init(3, mx.nd.ones((2,)))
        kv.push(3, mx.nd.ones((2,)) * (kv.rank + 1))
        out = mx.nd.zeros((2,))
        kv.pull(3, out=out)
        # one file per worker: the workers share the launcher's stdout
        with open('result-%d.txt' % kv.rank, 'w') as f:
            f.write('%d %d %s' % (kv.rank, kv.num_workers, out.asnumpy().tolist()))
    """))
    launch = os.path.join(REAL_SP, "mxnet", "tools", "launch.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    env["PYTHONPATH"] = site        # the launcher imports dmlc_tracker: the patched copy
    r = subprocess.run([sys.executable, launch, "-n", "2", "-s", "1", "--launcher", "local",
                        sys.executable, str(job)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    results = [(tmp_path / ("result-%d.txt" % rank)).read_text() for rank in (0, 1)]
    assert results == ["0 2 [3.0, 3.0]", "1 2 [3.0, 3.0]"], r.stdout + r.stderr


# --------------------------------------------------------------------------- patch 0002 / runtime

RUNTIME_SCRIPT = """
    import importlib.util, json, sys
    spec = importlib.util.spec_from_file_location('mxps_fixes_sub', %(fixes)r)
    fixes = importlib.util.module_from_spec(spec); spec.loader.exec_module(fixes)
    assert 'mxnet' not in sys.modules          # loading fixes.py does not import mxnet

    import mxnet as mx
    import mxnet.model as model
    import mxnet.gluon.trainer as trainer_mod
    import mxnet.module.module as module_mod
    from mxnet.kvstore import KVStoreBase

    def load_create_kvstore(path):
        # _create_kvstore as defined by a given model.py (pristine or patched copy)
        ns = {'__name__': 'mxnet.model', '__package__': 'mxnet', '__file__': path}
        exec(compile(open(path).read(), path, 'exec'), ns)
        return ns['_create_kvstore']

    # simulate an unpatched MXNet 1.9.1 even if the real site-packages is patched
    pristine = load_create_kvstore(%(pristine)r)
    for mod in (model, trainer_mod, module_mod):
        mod._create_kvstore = pristine

    calls = []

    @KVStoreBase.register
    class Dummyname(KVStoreBase):
        def broadcast(self, key, value, out, priority=0):
            for o in (out if isinstance(out, list) else [out]):
                o[:] = value
        def pushpull(self, key, value, out=None, priority=0):
            calls.append(key)
            if out is not None:
                for o in (out if isinstance(out, list) else [out]):
                    o[:] = value[0] if isinstance(value, list) else value
        def is_capable(self, capability):
            return False
        @property
        def type(self):
            return 'dummyname'

    def describe(fn, name, ndev=1):
        kv, upd = fn(name, ndev, {'w': mx.nd.zeros((3,))})
        return [type(kv).__name__ if kv is not None else None, upd]

    out = {}
    out['before'] = {'model': describe(model._create_kvstore, 'dummyname'),
                     'trainer': describe(trainer_mod._create_kvstore, 'Dummyname'),
                     'module': describe(module_mod._create_kvstore, 'dummyname')}
    out['changed'] = fixes.apply_runtime_fixes('worker', lambda: True)
    out['changed_again'] = fixes.apply_runtime_fixes('worker', lambda: True)
    out['after'] = {'model': describe(model._create_kvstore, 'dummyname'),
                    'trainer': describe(trainer_mod._create_kvstore, 'Dummyname'),
                    'module': describe(module_mod._create_kvstore, 'dummyname')}
    out['native'] = {n: describe(model._create_kvstore, n) for n in ('local', 'device')}
    out['native_2dev'] = describe(model._create_kvstore, 'local', 2)
    out['native_pristine_2dev'] = describe(pristine, 'local', 2)
    patched = load_create_kvstore(%(patched)r)
    out['patched_file'] = {n: describe(patched, n) for n in ('dummyname', 'local', 'device')}

    # end to end: gluon.Trainer(kvstore='dummyname') on one device really uses the plugin
    from mxnet import autograd, gluon
    net = gluon.nn.Dense(1, in_units=2)
    net.initialize()
    tr = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                       kvstore='dummyname')
    with autograd.record():
        loss = net(mx.nd.ones((4, 2))).sum()
    loss.backward()
    tr.step(4)
    out['trainer_kvstore'] = type(tr._kvstore).__name__
    out['pushpull_keys'] = sorted(calls)
    print('JSON' + json.dumps(out))
"""


def _run_runtime_script(site):
    pristine = os.path.join(site, "mxnet", "model.py")
    patched_dir = os.path.join(os.path.dirname(site), "patched-copy")
    shutil.copytree(site, patched_dir)
    patching.apply(patched_dir)
    r = _run(RUNTIME_SCRIPT % {"fixes": FIXES_PY, "pristine": pristine,
                               "patched": os.path.join(patched_dir, "mxnet", "model.py")})
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    line = [l for l in r.stdout.splitlines() if l.startswith("JSON")][-1]
    return json.loads(line[4:])


def test_runtime_fix_keeps_a_registered_plugin_kvstore_and_native_names_unchanged(site):
    out = _run_runtime_script(site)
    # before: the plugin is silently dropped everywhere
    assert out["before"] == {"model": [None, False], "trainer": [None, False],
                             "module": [None, False]}
    assert set(out["changed"]) == {"mxnet.model", "mxnet.gluon.trainer", "mxnet.module.module",
                                  "mxnet.gluon.trainer.KVStore"}
    assert out["changed_again"] == []
    # after: the plugin instance, in every module that bound the name
    assert out["after"] == {"model": ["Dummyname", False], "trainer": ["Dummyname", False],
                            "module": ["Dummyname", False]}
    # native names keep native behaviour
    assert out["native"] == {"local": [None, False], "device": [None, False]}
    assert out["native_2dev"] == out["native_pristine_2dev"] == ["KVStore", True]
    # the patched model.py behaves the same as the runtime fix
    assert out["patched_file"] == {"dummyname": ["Dummyname", False],
                                   "local": [None, False], "device": [None, False]}
    # and gluon.Trainer really pushes through the plugin (weight and bias)
    assert out["trainer_kvstore"] == "Dummyname"
    assert out["pushpull_keys"] == [0, 1]


def test_runtime_fixes_do_not_import_mxnet_in_a_server_process():
    r = _run("""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location('p', %r)
        p = importlib.util.module_from_spec(spec); spec.loader.exec_module(p)
        print(p.apply_runtime_fixes('server', lambda: True), 'mxnet' in sys.modules)
    """ % FIXES_PY, env_extra={"DMLC_ROLE": "server"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[] False"


def test_find_site_packages_does_not_import_mxnet():
    r = _run("""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location('p', %r)
        p = importlib.util.module_from_spec(spec); spec.loader.exec_module(p)
        print(p.find_site_packages()); print('mxnet' in sys.modules)
    """ % PATCHING_PY, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [REAL_SP, "False"]
