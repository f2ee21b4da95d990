"""The fixes MXNet 1.9.1 needs for mxps, as patch files applied to the installed files.

``mxps-patch apply|check|status|revert`` applies the unified diffs in ``patches/`` (installed as
package data ``mxps_tools/_patches``) to site-packages.  They fix code that runs in processes
mxps does not control, e.g. the launcher ``mxnet/tools/launch.py`` and its ``dmlc_tracker``
(patch 0001).  What ``import mxps`` can repair in the running interpreter is also fixed there,
without touching files (patch 0002: ``mxps.adapter.fixes.apply_runtime_fixes``).

What matters: a three-way state per file (exactly the original around every hunk, a line offset
allowed, no fuzz / exactly the patched content / anything else, refused with the file named
before anything is written), an idempotent apply, a byte-identical revert, check/status exit
codes, and an atomic write per file (temp file in the same directory + ``os.replace``).

Why a small applier of our own rather than a library or GNU ``patch`` (tried
on copies of the two MXNet files and on small ``diff -u`` outputs):

* patch-ng 1.19.1 (``PatchSet.apply/revert``): with a hand-edited ``mxnet/model.py`` it still
  rewrote ``dmlc_tracker/tracker.py`` and returned ``[True, False]`` (no check of every file
  before writing); it writes in place after moving the original to ``<file>.orig`` (not atomic,
  and a ``.orig`` left by an interrupted run aborts that file while the others get patched);
  hunks only at their recorded line (two lines added at the top of tracker.py: refused); a CRLF
  copy passes as the original (line ends are stripped before comparing); no state query for
  ``-p1`` paths (``can_patch`` gave None); failures are log records and a bool; ``apply(root=)``
  changes the process's working directory.  As a parser only it saves ~40 lines, but says why a
  patch is bad only in log records and leaves ``\\ No newline`` lines to us.
* whatthepatch 1.0.7 (``parse_patch`` + the pure ``apply_diff``): exact matching with an
  exception naming the line, but a hunk whose last ``+`` line was lost (truncated patch) was
  applied without a word and deleted the line, a ``\\ No newline at end of file`` diff gave the
  wrong bytes, and hunks are only looked for at their recorded line.
* GNU ``patch -p1 -F0`` gives the same bytes (tests/test_patching.py checks it) and writes
  atomically, but it is Debian priority "optional", so missing from slim images (``pip install
  mxps && mxps-patch apply`` must work there), and the three-way state needs two ``--dry-run``
  calls per file plus parsing its English messages to name the file.  ``git apply`` (also
  "optional") has the same gaps.

So the ~100 lines of strict parser and applier below stay (no new dependency).  The patch files
stay ordinary ``diff -u`` output: ``patch -p1 -d <site-packages>`` applies them too.

This module must not import mxnet at import time (``import mxnet`` in a server or scheduler
process starts MXNet's native ps-lite node), nor anything from the ``mxps`` runtime package.
"""
import argparse
import dataclasses
import glob
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
import tempfile

__all__ = [
    "PatchError", "Patch", "PatchStatus",
    "find_site_packages", "load_patches", "status", "apply", "revert", "check",
    "main",
]

logger = logging.getLogger(__name__)

#: MXNet version the patches and the runtime fixes were written and verified against.
MXNET_VERSION = "1.9.1"

#: Environment variable naming a directory of ``*.patch`` files to use instead of the bundled.
ENV_PATCHES_DIR = "MXPS_PATCHES_DIR"

APPLIED = "applied"
NOT_APPLIED = "not applied"


class PatchError(RuntimeError):
    """A patch cannot be checked, applied or reverted (the message names the file)."""


# --------------------------------------------------------------------------- parsing

@dataclasses.dataclass(frozen=True)
class Hunk:
    old_start: int          # 1-based line number in the original file (0 for an empty file)
    old_lines: tuple        # lines (with their line ending) the hunk expects
    new_lines: tuple        # lines (with their line ending) the hunk produces


@dataclasses.dataclass(frozen=True)
class FileDiff:
    path: str               # relative to site-packages, '/'-separated, e.g. 'mxnet/model.py'
    hunks: tuple


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str               # file name, e.g. '0002-mxnet-model-keep-plugin-kvstore.patch'
    source: str             # full path of the patch file
    header: str             # the leading comment block (why, file, versions, verify)
    files: tuple            # of FileDiff

    @property
    def summary(self):
        """The first header line without its '#' and number, e.g. 'dmlc_tracker Thread...'."""
        first = self.header.splitlines()[0] if self.header else self.name
        return re.sub(r"^#\s*(mxps patch \d+:\s*)?", "", first).strip()


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_prefix(path):
    """'a/mxnet/model.py' -> 'mxnet/model.py' (``-p1``); also drops a diff timestamp."""
    path = path.split("\t")[0].strip()
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return path


def parse_patch(text, name="<patch>", source=""):
    """Parse a unified diff (with an optional leading ``#`` comment block) into a `Patch`."""
    lines = text.splitlines(keepends=True)
    header, files, i = [], [], 0
    while i < len(lines) and not lines[i].startswith("--- "):
        header.append(lines[i])
        i += 1
    while i < len(lines):
        line = lines[i]
        if not line.startswith("--- "):
            i += 1          # 'diff ...' / 'Index:' lines or trailing text between files
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError("%s: '---' line %d is not followed by '+++'" % (name, i + 1))
        path = _strip_prefix(lines[i + 1][4:])
        if os.path.isabs(path) or ".." in path.split("/"):
            raise PatchError("%s: refusing path outside site-packages: %r" % (name, path))
        i += 2
        hunks = []
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK_RE.match(lines[i])
            if not m:
                raise PatchError("%s: bad hunk header at line %d: %r" % (name, i + 1, lines[i]))
            old_n = 1 if m.group(2) is None else int(m.group(2))
            new_n = 1 if m.group(4) is None else int(m.group(4))
            old, new = [], []
            i += 1
            while (len(old) < old_n or len(new) < new_n) and i < len(lines):
                body = lines[i]
                tag, content = body[:1], body[1:]
                if body.startswith("\\"):
                    i += 1
                    continue
                if tag == " " or body in ("\n", "\r\n"):   # some editors strip the space
                    content = content if tag == " " else body
                    old.append(content)
                    new.append(content)
                elif tag == "-":
                    old.append(content)
                elif tag == "+":
                    new.append(content)
                else:
                    raise PatchError("%s: unexpected line %d in hunk: %r" % (name, i + 1, body))
                i += 1
                # '\ No newline at end of file' applies to the line just read
                if i < len(lines) and lines[i].startswith("\\"):
                    for side, t in ((old, " -"), (new, " +")):
                        if tag in t and side and side[-1].endswith("\n"):
                            side[-1] = side[-1][:-1]
                    i += 1
            if len(old) != old_n or len(new) != new_n:
                raise PatchError("%s: truncated hunk for %s" % (name, path))
            hunks.append(Hunk(int(m.group(1)), tuple(old), tuple(new)))
        if not hunks:
            raise PatchError("%s: no hunks for %s" % (name, path))
        files.append(FileDiff(path, tuple(hunks)))
    if not files:
        raise PatchError("%s: not a unified diff (no '--- a/...' line)" % name)
    return Patch(name, source, "".join(header), tuple(files))


def _transform(lines, hunks, reverse):
    """Apply `hunks` (or undo them) to `lines` exactly (no fuzz); None if any hunk misses.

    A hunk is looked for at its recorded position first, then at the nearest other position
    (an offset, as GNU patch allows); its context and removed lines must match exactly.
    """
    out, pos, delta = [], 0, 0
    for h in hunks:
        want, put = (h.new_lines, h.old_lines) if reverse else (h.old_lines, h.new_lines)
        n = len(want)
        expected = max(h.old_start - 1 + delta, pos) if h.old_start else pos
        found = None
        for off in range(0, len(lines) + 1):
            for cand in ((expected + off, expected - off) if off else (expected,)):
                if pos <= cand <= len(lines) - n and tuple(lines[cand:cand + n]) == want:
                    found = cand
                    break
            if found is not None:
                break
        if found is None:
            return None
        out.extend(lines[pos:found])
        out.extend(put)
        pos = found + n
        delta += len(put) - n
    out.extend(lines[pos:])
    return out


# --------------------------------------------------------------------------- locating

def _bundled_patch_dirs():
    here = os.path.dirname(os.path.abspath(__file__))
    return [
        os.path.join(here, "_patches"),                 # installed: package mxps_tools._patches
        os.path.join(os.path.dirname(here), "patches"),  # source tree / editable install
    ]


def patches_dir(path=None):
    """The directory holding the ``*.patch`` files (argument, $MXPS_PATCHES_DIR, bundled)."""
    candidates = [path] if path else ([os.environ[ENV_PATCHES_DIR]]
                                      if os.environ.get(ENV_PATCHES_DIR)
                                      else _bundled_patch_dirs())
    for d in candidates:
        if d and glob.glob(os.path.join(d, "*.patch")):
            return d
    raise PatchError("no *.patch files found in %s; reinstall mxps (the patches are package "
                     "data mxps_tools/_patches) or pass a directory"
                     % " or ".join(map(str, candidates)))


def load_patches(path=None):
    """All patches, sorted by file name."""
    d = patches_dir(path)
    result = []
    for fname in sorted(glob.glob(os.path.join(d, "*.patch"))):
        with open(fname, encoding="utf-8", newline="") as f:
            result.append(parse_patch(f.read(), os.path.basename(fname), fname))
    return result


def _package_root(package):
    """The directory containing top-level `package`, found without importing it."""
    spec = importlib.util.find_spec(package)   # top-level name: finds, does not import
    if spec is not None:
        if spec.submodule_search_locations:
            return os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))
        if spec.origin:
            return os.path.dirname(os.path.abspath(spec.origin))
    try:
        dist = importlib.metadata.distribution("mxnet")
        root = os.path.abspath(str(dist.locate_file("")))
        if os.path.isdir(os.path.join(root, package)):
            return root
    except importlib.metadata.PackageNotFoundError:
        pass
    return None


def find_site_packages():
    """The site-packages directory holding the installed ``mxnet`` (mxnet is not imported)."""
    root = _package_root("mxnet")
    if root is None:
        raise PatchError("cannot find an installed mxnet (importlib.util.find_spec('mxnet') "
                         "and importlib.metadata both failed); install mxnet==%s or pass "
                         "--site-packages DIR" % MXNET_VERSION)
    return root


def _target(fdiff, site_packages):
    """Absolute path of the installed file a FileDiff patches."""
    if site_packages is not None:
        return os.path.join(site_packages, *fdiff.path.split("/"))
    top = fdiff.path.split("/")[0]
    root = _package_root(top)
    if root is None:
        raise PatchError("cannot find the installed package %r (needed for %s); pass "
                         "--site-packages DIR" % (top, fdiff.path))
    return os.path.join(root, *fdiff.path.split("/"))


# --------------------------------------------------------------------------- state

@dataclasses.dataclass
class PatchStatus:
    patch: Patch
    state: str                  # APPLIED or NOT_APPLIED (anything else raises PatchError)
    files: list                 # [(target path, state, new text or None)]

    def line(self):
        return "%-13s %s  (%s)" % (self.state, self.patch.name,
                                   ", ".join(p for p, _, _ in self.files))


def _read(path):
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def _file_state(patch, fdiff, target):
    """(state, original text, patched text) of one file; PatchError if neither."""
    if not os.path.isfile(target):
        raise PatchError("%s: file to patch not found: %s" % (patch.name, target))
    try:
        text = _read(target)
    except (OSError, UnicodeDecodeError) as e:
        raise PatchError("%s: cannot read %s: %s" % (patch.name, target, e))
    lines = text.splitlines(keepends=True)
    forward = _transform(lines, fdiff.hunks, reverse=False)
    backward = _transform(lines, fdiff.hunks, reverse=True)
    if backward is not None and forward is None:
        return APPLIED, "".join(backward), text
    if forward is not None and backward is None:
        return NOT_APPLIED, text, "".join(forward)
    raise PatchError(
        "%s: unexpected content in %s: it is neither the original MXNet %s file nor the "
        "patched one (edited by hand, or another mxnet/dmlc_tracker version?). Reinstall "
        "mxnet==%s (pip install --force-reinstall --no-deps mxnet==%s) and re-run "
        "'mxps-patch apply'." % (patch.name, target, MXNET_VERSION, MXNET_VERSION,
                                 MXNET_VERSION))


def _status_of(patch, site_packages):
    files, states = [], set()
    for fdiff in patch.files:
        target = _target(fdiff, site_packages)
        state, original, patched = _file_state(patch, fdiff, target)
        files.append((target, state, patched if state == NOT_APPLIED else original))
        states.add(state)
    if len(states) != 1:
        bad = [p for p, s, _ in files if s == NOT_APPLIED]
        raise PatchError("%s: partially applied; not applied to: %s. Run 'mxps-patch apply'."
                         % (patch.name, ", ".join(bad)))
    return PatchStatus(patch, states.pop(), files)


def status(site_packages=None, patches=None):
    """The state of every patch: a list of `PatchStatus` (PatchError on unexpected content)."""
    patches = load_patches() if patches is None else patches
    return [_status_of(p, site_packages) for p in patches]


def _write_atomic(path, text):
    """Replace `path` with `text` atomically (temp file in the same dir, then os.replace)."""
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".mxps-patch-", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        st = os.stat(path)
        os.chmod(tmp, st.st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    # drop stale bytecode of the old content (best effort)
    stem = os.path.splitext(os.path.basename(path))[0]
    for pyc in glob.glob(os.path.join(d, "__pycache__", stem + ".*.pyc")):
        try:
            os.unlink(pyc)
        except OSError:
            pass


def _change(to_state, site_packages, patches):
    """Bring every patch to `to_state`; all states are checked before any file is written."""
    sts = status(site_packages, patches)
    report = []
    for st in sts:
        if st.state == to_state:
            report.append((st.patch.name, "already " + to_state))
            continue
        for target, _, new_text in st.files:
            _write_atomic(target, new_text)
        report.append((st.patch.name, to_state))
    return report


def apply(site_packages=None, patches=None):
    """Apply every patch not yet applied. Returns [(patch name, 'applied'|'already applied')]."""
    return _change(APPLIED, site_packages, patches)


def revert(site_packages=None, patches=None):
    """Undo every applied patch. Returns [(patch name, 'not applied'|'already not applied')]."""
    return _change(NOT_APPLIED, site_packages, patches)


def check(site_packages=None, patches=None):
    """True if every patch is applied, False if any is not (PatchError on unexpected content)."""
    return all(st.state == APPLIED for st in status(site_packages, patches))


# --------------------------------------------------------------------------- CLI

def main(argv=None):
    """``mxps-patch apply|check|revert [--site-packages DIR] [--patches-dir DIR]``.

    Exit codes: 0 success (check: every patch applied); 1 check found a patch not applied,
    or a patch could not be handled (the message names the file); 2 usage error.
    """
    parser = argparse.ArgumentParser(
        prog="mxps-patch",
        description="Apply, check or revert the fixes mxps needs in the installed "
                    "MXNet %s (see patches/README.md)." % MXNET_VERSION)
    parser.add_argument("command", choices=["apply", "check", "revert", "status"],
                        help="apply: patch the installed files (idempotent); check/status: "
                             "one line per patch, exit 0 only if all are applied; revert: "
                             "restore the original files")
    parser.add_argument("--site-packages", metavar="DIR",
                        help="the site-packages holding mxnet/ and dmlc_tracker/ (default: "
                             "where the current Python finds them, without importing mxnet)")
    parser.add_argument("--patches-dir", metavar="DIR",
                        help="directory of *.patch files (default: the ones installed "
                             "with mxps)")
    args = parser.parse_args(argv)
    try:
        patches = load_patches(args.patches_dir)
        if args.command in ("check", "status"):
            sts = status(args.site_packages, patches)
            for st in sts:
                print(st.line())
            return 0 if all(st.state == APPLIED for st in sts) else 1
        action = apply if args.command == "apply" else revert
        for name, what in action(args.site_packages, patches):
            print("%-19s %s" % (what, name))
        return 0
    except PatchError as e:
        print("mxps-patch: error: %s" % e, file=sys.stderr)
        return 1
    except OSError as e:
        print("mxps-patch: error: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
