"""Emulated heterogeneous network on one machine, built from real kernel networking.

Each node gets its own network namespace with one interface ``eth0`` (a veth) whose peer sits in
a bridge namespace of its own, so nothing is ever created in, or routed through, the root
namespace. Links are shaped with ``tc tbf`` on both veth ends: the node end's egress is the
node's *upload*, the bridge end's egress is its *download* (the switch port's queue).

A lossy, shallow-buffered switch (what an incast benchmark needs) is three more options:

- ``loss``: random loss per link in percent, on packets going *towards* a node (its download),
  dropped by an nft rule in the bridge namespace (``numgen random``, per packet, IPv4 only so
  neighbour resolution is not delayed at random); changeable live with ``set_loss``.
- ``queue_ms``: the switch ports' queue (tbf ``limit``) as time at the port's rate; default
  50 ms, changeable live with ``set_queue``.
- ``mtu``: the MTU of every veth (1500; 9000 for jumbo frames).

Loss and shallow queues must act on packets as they would be on a wire, not on the 64 KB
super-packets that segmentation offload (GSO/TSO) and receive offload (GRO) pass between veths:
in *per-packet* mode ``ethtool -K`` turns those offloads off on every veth and the shapers use a
bucket and a queue floor of a few frames. The mode is on when a topology has loss or a queue
shorter than the default (or when asked, ``per_packet=True``); otherwise everything stays as it
always was (offloads on, 128 KiB bucket, 256 KiB queue floor), so existing benchmarks keep
their numbers.

Layers, bottom up:

- ``_Cmd``: runs ``ip``/``tc`` and turns a failure into an ``EmunetError`` naming the command.
- ``cleanup_stale`` and the state directory: namespaces are named
  ``<prefix><pid>-<runid>-...`` and a small JSON file under ``/run/mxps-emunet/`` records the
  creating process (pid and start time), so leftovers of a crashed run can be told apart from a
  live run and removed.
- ``Topology``: builds the namespaces, bridge, veths, addresses and shaping; runs processes in
  the nodes (optionally each with private files, ``binds``, as separate machines have), starts
  services there and waits until they are ready (``start_service``), waits for what others
  started in a node (``wait_node_idle``); changes rates live; closes everything on exit, error,
  Ctrl-C, SIGTERM and atexit.
- ``RateSchedule``: a background thread applying a list of timed rate changes.

Example::

    from mxps_tools import emunet
    emunet.cleanup_stale()
    with emunet.Topology(['sched', 's0', 'w0'], rates={'s0': 100.0}) as topo:
        p = topo.popen('s0', ['python', 'server.py'])
        topo.set_rate('s0', 50.0)

Needs root and the ``ip`` and ``tc`` tools (iproute2); per-packet mode needs ``ethtool`` and loss
``nft`` (nftables); ``check_prerequisites`` says which is missing. ``scripts/test-deps.sh``
installs them.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import threading
import time
from typing import (Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence,
                    Tuple, Union)

import psutil

__all__ = [
    'EmunetError',
    'check_prerequisites',
    'cleanup_stale',
    'Topology',
    'RateSchedule',
    'DEFAULT_PREFIX',
    'DEFAULT_SUBNET',
    'ALLOWED_NETWORK',
    'STATE_DIR',
    'Shape',
    'tbf_sizes',
    'loss_threshold',
]

DEFAULT_PREFIX = 'mxps-'
DEFAULT_SUBNET = '198.18.0.0/24'
#: Benchmarking range (RFC 2544); every address this module assigns lies inside it.
ALLOWED_NETWORK = ipaddress.ip_network('198.18.0.0/15')
#: Where each live run records its creating process, so stale runs can be recognised.
STATE_DIR = '/run/mxps-emunet'

#: Interface name of a node's link, inside its namespace.
NODE_IFACE = 'eth0'
BRIDGE_IFACE = 'br0'
#: tbf bucket size. At or below 64 KiB the veth hands ~64 KiB TCP GSO segments to the shaper,
#: which then has to split them (about 14x the CPU); 128 KiB keeps the rate exact and cheap.
MIN_BURST_BYTES = 128 * 1024
#: Queue allowed behind the bucket, as time at the configured rate (with a floor in bytes so low
#: rates still hold a few GSO segments). The default of ``queue_ms`` and of every node's upload.
QUEUE_SECONDS = 0.05
MIN_QUEUE_BYTES = 256 * 1024
#: Per-packet mode (offloads off): the bucket holds this much time at the rate, at least
#: ``PACKET_BURST_FRAMES`` frames, so a shaper timer that fires late (a busy 2-core machine)
#: does not cost rate; a queue holds at least ``MIN_QUEUE_FRAMES`` frames however short
#: ``queue_ms`` is. A real switch port has no bucket: this one is kept small, so that
#: an idle port lets only a few frames pass at more than its rate.
PACKET_BURST_SECONDS = 0.0002
PACKET_BURST_FRAMES = 4
MIN_QUEUE_FRAMES = 4
#: Ethernet header counted by tbf on top of the MTU (veths have no preamble, FCS or gap).
ETH_HEADER_BYTES = 14
DEFAULT_MTU = 1500
#: Smallest MTU every IPv4 host must accept, and the usual jumbo-frame maximum of switches.
MTU_RANGE = (576, 9216)
#: Offloads turned off in per-packet mode: segmentation (TCP, UDP, generic) and receive.
OFFLOADS = ('tso', 'gso', 'gro', 'tx-udp-segmentation')
#: nftables table (bridge family) in the bridge namespace holding the loss rules.
LOSS_TABLE = 'emunet'
LOSS_CHAIN = 'loss'
#: Resolution of the random drop: ``numgen random mod LOSS_SCALE < threshold``.
LOSS_SCALE = 1_000_000
#: Tools every topology needs, with what for.
BASE_TOOLS = {'ip': 'namespaces and links', 'tc': 'shaping'}
#: Package that provides each external tool, for error messages.
_TOOL_PACKAGE = {'ip': 'iproute2', 'tc': 'iproute2', 'nft': 'nftables', 'ethtool': 'ethtool',
                 'sysctl': 'procps', 'mount': 'util-linux'}

_NODE_NAME_RE = re.compile(r'^[A-Za-z0-9_]{1,40}$')
_RUN_ID_BYTES = 2

Rate = Optional[float]
RateSpec = Union[None, float, int, Tuple[Rate, Rate]]


class EmunetError(RuntimeError):
    """A problem building, changing or tearing down the emulated network."""


# --------------------------------------------------------------------------- commands


def _run(argv: Sequence[str], timeout: float = 30.0, input_text: Optional[str] = None) -> str:
    """Run ``argv`` (with ``input_text`` on its stdin, if given) and return its stdout.

    Raises:
        EmunetError: the command is missing, failed, or timed out; the message quotes the
            command and its stderr.
    """
    try:
        stdin = subprocess.DEVNULL if input_text is None else None
        done = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=stdin, input=input_text, timeout=timeout, text=True)
    except FileNotFoundError as exc:
        tool = _tool_of(argv)
        raise EmunetError(f'command {tool!r} not found while running {" ".join(argv)!r}: '
                          f'install {_TOOL_PACKAGE.get(tool, tool)}') from exc
    except subprocess.TimeoutExpired as exc:
        raise EmunetError(f'command {" ".join(argv)!r} timed out after {timeout:.0f} s') from exc
    if done.returncode != 0:
        raise EmunetError(f'command {" ".join(argv)!r} failed with exit code {done.returncode}: '
                          f'{done.stderr.strip() or "(no stderr)"}')
    return done.stdout


def _tool_of(argv: Sequence[str]) -> str:
    """The external tool ``argv`` runs (the command after ``ip netns exec NS``, if any)."""
    if list(argv[:3]) == ['ip', 'netns', 'exec'] and len(argv) > 4:
        return argv[4]
    return argv[0]


def check_prerequisites(which: Callable[[str], Optional[str]] = shutil.which,
                        euid: Optional[int] = None,
                        tools: Optional[Mapping[str, str]] = None) -> None:
    """Check that this process can build a topology.

    Args:
        which: lookup of executables on PATH (``shutil.which``); injectable for tests.
        euid: effective user id to check; defaults to ``os.geteuid()``.
        tools: the tools needed, each with what it is needed for (the default: a plain
            topology; per-packet mode adds ``ethtool``, loss ``nft``).

    Raises:
        EmunetError: naming every missing prerequisite (root, each tool and its package).
    """
    problems = []
    tools = BASE_TOOLS if tools is None else tools
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        problems.append(f'emunet needs root (running as uid {euid}) to create network '
                        f'namespaces; run the tests or benchmark with sudo')
    for tool, purpose in tools.items():
        if which(tool) is None:
            problems.append(f'`{tool}` not found on PATH ({os.environ.get("PATH", "")}), '
                            f'needed for {purpose}; install {_TOOL_PACKAGE.get(tool, tool)} '
                            f'(sudo bash scripts/test-deps.sh)')
    if problems:
        raise EmunetError('; '.join(problems))


def _list_netns() -> List[str]:
    """Names of all network namespaces known to ``ip netns``."""
    names = []
    for line in _run(['ip', 'netns', 'list']).splitlines():
        if line.strip():
            names.append(line.split()[0])
    return names


def _netns_pids(netns: str) -> List[int]:
    """PIDs of processes living in ``netns`` (empty if the namespace is gone)."""
    try:
        out = _run(['ip', 'netns', 'pids', netns])
    except EmunetError:
        return []
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _kill_pids(pids: Iterable[int], grace: float) -> None:
    """SIGTERM the given PIDs, wait up to ``grace`` seconds, then SIGKILL survivors."""
    pids = [p for p in pids if p != os.getpid()]
    for pid in pids:
        _signal_pid(pid, signal.SIGTERM)
    for pid in _wait_exits(pids, grace):
        _signal_pid(pid, signal.SIGKILL)


def _wait_exits(pids: Iterable[int], timeout: float) -> List[int]:
    """Wait until every pid has exited (a zombie has) or ``timeout`` seconds passed; the pids
    still running.  Woken by each exit (pidfds), not by polling the process table."""
    fds = {}
    try:
        for pid in pids:
            try:
                fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                pass            # gone already
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        left = set(fds)
        deadline = time.monotonic() + timeout
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for fd, _ in poller.poll(remaining * 1000):
                poller.unregister(fd)
                left.discard(fd)
        return [fds[fd] for fd in left]
    finally:
        for fd in fds:
            os.close(fd)


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pid_start_time(pid: int) -> Optional[float]:
    """When ``pid`` started (unix time; with its pid, it tells a process from a later one that
    reuses the pid), or None if it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


def _delete_netns(netns: str, grace: float = 2.0) -> None:
    """Stop every process inside ``netns`` by PID, then delete the namespace."""
    _kill_pids(_netns_pids(netns), grace)
    try:
        _run(['ip', 'netns', 'delete', netns])
    except EmunetError:
        if netns in _list_netns():
            raise


# --------------------------------------------------------------------------- stale runs


def _run_base(prefix: str, pid: int, run_id: str) -> str:
    return f'{prefix}{pid}-{run_id}'


def _parse_base(name: str, prefix: str) -> Optional[Tuple[str, int]]:
    """``(base, pid)`` if ``name`` is a namespace created by this module with ``prefix``."""
    m = re.match(re.escape(prefix) + r'(\d+)-([0-9a-f]+)(?:-|$)', name)
    if not m:
        return None
    return f'{prefix}{m.group(1)}-{m.group(2)}', int(m.group(1))


def _state_path(base: str) -> str:
    return os.path.join(STATE_DIR, base + '.json')


def _owner_alive(base: str, pid: int) -> bool:
    """True if the process that created run ``base`` is still running (PID reuse checked)."""
    if pid == os.getpid():
        return True
    if not _pid_alive(pid):
        return False
    try:
        with open(_state_path(base)) as f:
            recorded = json.load(f).get('start_time')
    except (OSError, ValueError):
        return True  # no record to compare: trust the PID
    return recorded is None or recorded == _pid_start_time(pid)


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> List[str]:
    """Remove namespaces left by runs whose creating process is gone.

    Only namespaces named ``<prefix><pid>-<runid>-...`` (as ``Topology`` names them) are
    considered; those of live runs are kept. Processes still inside a stale namespace were
    started by that run and are stopped by PID before the namespace is deleted.

    Args:
        prefix: project prefix of the namespaces to consider.

    Returns:
        Names of the namespaces removed.

    Raises:
        EmunetError: a prerequisite is missing or a namespace could not be deleted.
    """
    check_prerequisites()
    removed = []
    stale_bases = set()
    for name in _list_netns():
        parsed = _parse_base(name, prefix)
        if parsed is None:
            continue
        base, pid = parsed
        if _owner_alive(base, pid):
            continue
        _delete_netns(name)
        removed.append(name)
        stale_bases.add(base)
    if os.path.isdir(STATE_DIR):
        for fname in os.listdir(STATE_DIR):
            parsed = _parse_base(fname[:-5], prefix) if fname.endswith('.json') else None
            if parsed and not _owner_alive(*parsed):
                _remove_file(os.path.join(STATE_DIR, fname))
    return removed


def _remove_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------- private files

#: Runs in the process's own mount namespace: ``ip netns exec`` unshares one for every process
#: it starts and makes every mount in it a slave of the root namespace's, so these bind mounts
#: are seen by that process and its children only, never outside, and vanish with them.
_BIND_SCRIPT = ('while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 125; shift 2; done; '
                'shift; exec "$@"')


def _bind_prefix(binds: Mapping[str, str]) -> List[str]:
    """argv prefix that bind-mounts each source over its target, then execs the command.

    Raises:
        EmunetError: a path is relative or missing, a file is bound over a directory (or the
            reverse), or ``mount`` is not on PATH.
    """
    if not binds:
        return []
    if shutil.which('mount') is None:
        raise EmunetError('`mount` not found on PATH, needed to bind private files into a node; '
                          'install util-linux')
    pairs = []
    for target, source in binds.items():
        for what, path in (('target', target), ('source', source)):
            if not os.path.isabs(path) or not os.path.exists(path):
                raise EmunetError(f'bind {what} {path!r} must be an existing absolute path')
        if os.path.isdir(target) != os.path.isdir(source):
            raise EmunetError(f'bind source {source!r} and target {target!r} must both be '
                              f'directories or both files')
        pairs += [str(source), str(target)]
    return ['sh', '-c', _BIND_SCRIPT, 'emunet-bind'] + pairs + ['--']


class _LineWatch:
    """Copies a stream to a log file line by line (a thread, until EOF); ``wake`` is set at
    the first line matching ``pattern`` (then ``matched`` is True) or at EOF, so a waiter also
    learns of an early exit at once."""

    def __init__(self, stream, log_path: str, pattern: 're.Pattern') -> None:
        self.matched = False
        self.wake = threading.Event()
        log = open(log_path, 'ab')          # here, so a bad path fails in the caller
        self._thread = threading.Thread(target=self._copy, args=(stream, log, pattern),
                                        name='emunet-log', daemon=True)
        self._thread.start()

    def _copy(self, stream, log, pattern: 're.Pattern') -> None:
        try:
            with stream, log:
                for raw in iter(stream.readline, b''):
                    log.write(raw)
                    log.flush()
                    if not self.matched and pattern.search(raw.decode(errors='replace')):
                        self.matched = True
                        self.wake.set()
        finally:
            self.wake.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


# --------------------------------------------------------------------------- shaping


def _normalize_rate(spec: RateSpec, what: str) -> Tuple[Rate, Rate]:
    """``(up, down)`` in Mbit/s from a number (both directions), a pair, or None."""
    if spec is None or isinstance(spec, (int, float)):
        pair = (spec, spec)
    elif isinstance(spec, (tuple, list)) and len(spec) == 2:
        pair = (spec[0], spec[1])
    else:
        raise EmunetError(f'rate for {what} must be Mbit/s as a number, an (up, down) pair or '
                          f'None, got {spec!r}')
    for value in pair:
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise EmunetError(f'rate for {what} must be a positive number of Mbit/s or None '
                              f'(unshaped), got {value!r}')
    return (None if pair[0] is None else float(pair[0]),
            None if pair[1] is None else float(pair[1]))


class Shape(NamedTuple):
    """How a link's shaper is sized besides its rate: the queue (seconds at the rate), the
    MTU, and whether packets cross it one by one (per-packet mode, offloads off)."""

    queue_s: float = QUEUE_SECONDS
    mtu: int = DEFAULT_MTU
    per_packet: bool = False


def tbf_sizes(mbit: float, shape: Shape = Shape()) -> Tuple[int, int]:
    """``(burst, limit)`` in bytes of a tbf at ``mbit`` Mbit/s; ``limit`` is what tbf queues.

    Offload mode (as always): a 128 KiB bucket, so ~64 KiB GSO segments pass whole, and a
    queue of ``queue_s`` at the rate, at least 256 KiB, plus the bucket. Per-packet mode: the
    bucket is ``PACKET_BURST_SECONDS`` at the rate (at least a few frames), and the queue
    exactly ``queue_s`` at the rate (at least a few frames): 2 ms at 400 Mbit/s is 100 kB.
    """
    rate_bytes = mbit * 1e6 / 8
    if not shape.per_packet:
        burst = max(MIN_BURST_BYTES, int(rate_bytes * 0.001))
        return burst, burst + max(MIN_QUEUE_BYTES, int(rate_bytes * shape.queue_s))
    frame = shape.mtu + ETH_HEADER_BYTES
    burst = max(PACKET_BURST_FRAMES * frame, int(rate_bytes * PACKET_BURST_SECONDS))
    return burst, max(MIN_QUEUE_FRAMES * frame, int(rate_bytes * shape.queue_s))


def _tbf_args(mbit: float, shape: Shape = Shape()) -> List[str]:
    """tc arguments of a tbf shaping to ``mbit`` Mbit/s."""
    burst, limit = tbf_sizes(mbit, shape)
    return ['tbf', 'rate', f'{int(round(mbit * 1e6))}bit', 'burst', str(burst),
            'limit', str(limit)]


def _apply_shaping(netns: str, dev: str, old: Rate, new: Rate,
                   shape: Shape = Shape()) -> None:
    """Set egress of ``dev`` in ``netns`` to ``new`` Mbit/s (None: unshaped), given ``old``."""
    if new is None:
        if old is not None:
            _run(['tc', '-n', netns, 'qdisc', 'del', 'dev', dev, 'root'])
        return
    _run(['tc', '-n', netns, 'qdisc', 'replace', 'dev', dev, 'root'] + _tbf_args(new, shape))


def _set_offloads(netns: str, dev: str, on: bool) -> None:
    """Turn segmentation and receive offloads of ``dev`` on or off (``ethtool -K``)."""
    state = 'on' if on else 'off'
    args = []
    for feature in OFFLOADS:
        args += [feature, state]
    _run(['ip', 'netns', 'exec', netns, 'ethtool', '-K', dev] + args)


def _check_loss(percent: object, node: str) -> float:
    """``percent`` as a float in [0, 100], or an EmunetError naming the node and value."""
    if (isinstance(percent, bool) or not isinstance(percent, (int, float))
            or not 0 <= percent <= 100):
        raise EmunetError(f'loss towards {node!r} must be a percentage in [0, 100], '
                          f'got {percent!r}')
    return float(percent)


def loss_threshold(percent: float) -> int:
    """``numgen random mod LOSS_SCALE`` values below this are dropped: ``percent`` per 100."""
    return int(round(percent / 100 * LOSS_SCALE))


def _loss_rule(port: str, counter: str, percent: float) -> List[str]:
    """nft rule dropping ``percent`` of the IPv4 frames leaving the bridge through ``port``."""
    return ['oifname', f'"{port}"', 'ether', 'type', 'ip', 'numgen', 'random', 'mod',
            str(LOSS_SCALE), '<', str(loss_threshold(percent)), 'counter', 'name',
            f'"{counter}"', 'drop']


def _nft(netns: str, *args: str) -> str:
    return _run(['ip', 'netns', 'exec', netns, 'nft'] + list(args))


def _qdisc_counters(netns: str, dev: str) -> Dict[str, object]:
    """Counters of the root qdisc of ``dev``, from ``tc -s -j qdisc show``."""
    out = _run(['tc', '-n', netns, '-s', '-j', 'qdisc', 'show', 'dev', dev])
    try:
        entries = json.loads(out)
    except ValueError as exc:
        raise EmunetError(f'unparseable output of `tc -s -j qdisc show dev {dev}` in '
                          f'{netns}: {out[:200]!r}') from exc
    root = next((e for e in entries if e.get('root')), entries[0] if entries else {})
    return {
        'kind': root.get('kind'),
        'bytes': int(root.get('bytes', 0)),
        'packets': int(root.get('packets', 0)),
        'drops': int(root.get('drops', 0)),
        'overlimits': int(root.get('overlimits', 0)),
        'backlog': int(root.get('backlog', 0)),
    }


# --------------------------------------------------------------------------- topology


class Topology:
    """Nodes in their own namespaces on one shaped bridge.

    Args:
        nodes: node names (letters, digits, ``_``); addresses are assigned in this order,
            starting at the first host of ``subnet``.
        rates: per node Mbit/s, either one number (upload and download) or an
            ``(up, down)`` pair; None means unshaped, a missing node ``default_rate``.
        default_rate: rate of nodes not in ``rates``; None means unshaped.
        prefix: project prefix of namespace names (``cleanup_stale`` looks for it).
        subnet: IPv4 subnet inside 198.18.0.0/15 for node addresses.
        handle_sigterm: while open, turn SIGTERM into ``SystemExit`` so the network is torn
            down (only when the handler is SIG_DFL and this is the main thread).
        kill_grace: seconds processes get between SIGTERM and SIGKILL on close.
        loss: per node, percent of the packets towards it (its download) dropped at random in
            the switch; missing nodes lose nothing. Changeable live (``set_loss``).
        queue_ms: the switch ports' queue (tbf ``limit`` on the bridge side) as milliseconds
            at each port's rate; default 50. Changeable live (``set_queue``). Uploads (the
            nodes' own queues) keep the default.
        mtu: MTU of every veth (and so of the bridge), in bytes.
        per_packet: turn offloads off so shaping and loss act per packet; None (default)
            turns them off when there is loss or a queue shorter than the default.

    Use as a context manager, or call ``start()`` and ``close()``.

    Raises:
        EmunetError: bad arguments, missing prerequisites, or a failed ``ip``/``tc`` command.
    """

    def __init__(self, nodes: Sequence[str], rates: Optional[Mapping[str, RateSpec]] = None,
                 default_rate: RateSpec = None, prefix: str = DEFAULT_PREFIX,
                 subnet: str = DEFAULT_SUBNET, handle_sigterm: bool = True,
                 kill_grace: float = 2.0, loss: Optional[Mapping[str, float]] = None,
                 queue_ms: float = QUEUE_SECONDS * 1000, mtu: int = DEFAULT_MTU,
                 per_packet: Optional[bool] = None) -> None:
        self._nodes = list(nodes)
        self._check_nodes(self._nodes)
        rates = dict(rates or {})
        loss = dict(loss or {})
        for what, given in (('rates', rates), ('loss', loss)):
            unknown = sorted(set(given) - set(self._nodes))
            if unknown:
                raise EmunetError(f'{what} given for unknown nodes {unknown}; nodes are '
                                  f'{self._nodes}')
        self._loss = {n: _check_loss(loss.get(n, 0.0), n) for n in self._nodes}
        self._loss_handles: Dict[str, int] = {}
        self._loss_table_made = False
        self._queue_s = self._check_queue(queue_ms)
        self._mtu = self._check_mtu(mtu)
        if per_packet is False and (any(self._loss.values()) or self._shallow(self._queue_s)):
            raise EmunetError(f'per_packet=False with loss {loss} or queue_ms={queue_ms} '
                              f'(< {QUEUE_SECONDS * 1000:g}): loss and shallow queues act per '
                              f'packet only with offloads off; leave per_packet unset')
        self._per_packet_forced = per_packet
        self._per_packet = bool(per_packet) or any(self._loss.values()) or \
            self._shallow(self._queue_s)
        if not re.match(r'^[A-Za-z0-9_]{1,12}-$', prefix):
            raise EmunetError(f'prefix {prefix!r} must be 1-12 letters/digits/_ ending in "-", '
                              f'e.g. "mxps-"')
        self._prefix = prefix
        self._addrs, self._prefixlen = self._assign_addresses(subnet, self._nodes)
        default = _normalize_rate(default_rate, 'default_rate')
        self._wanted = {n: (_normalize_rate(rates[n], repr(n)) if n in rates else default)
                        for n in self._nodes}
        self._rates: Dict[str, Tuple[Rate, Rate]] = {n: (None, None) for n in self._nodes}
        self._handle_sigterm = handle_sigterm
        self._kill_grace = kill_grace
        self._lock = threading.RLock()
        self._procs: List[subprocess.Popen] = []
        self._schedules: List[RateSchedule] = []
        self._created: List[str] = []
        self._base = _run_base(prefix, os.getpid(), secrets.token_hex(_RUN_ID_BYTES))
        self._started = False
        self._closed = False
        self._prev_sigterm = None

    @staticmethod
    def _check_queue(queue_ms: object) -> float:
        if (isinstance(queue_ms, bool) or not isinstance(queue_ms, (int, float))
                or not queue_ms > 0):
            raise EmunetError(f'queue_ms must be a positive number of milliseconds, '
                              f'got {queue_ms!r}')
        return float(queue_ms) / 1000

    @staticmethod
    def _shallow(queue_s: float) -> bool:
        return queue_s < QUEUE_SECONDS

    @staticmethod
    def _check_mtu(mtu: object) -> int:
        lo, hi = MTU_RANGE
        if isinstance(mtu, bool) or not isinstance(mtu, int) or not lo <= mtu <= hi:
            raise EmunetError(f'mtu must be an integer number of bytes in [{lo}, {hi}], '
                              f'got {mtu!r}')
        return mtu

    @staticmethod
    def _check_nodes(nodes: List[str]) -> None:
        if not nodes:
            raise EmunetError('a topology needs at least one node, got none')
        for n in nodes:
            if not isinstance(n, str) or not _NODE_NAME_RE.match(n):
                raise EmunetError(f'node name {n!r} must be 1-40 letters, digits or "_"')
        dup = sorted({n for n in nodes if nodes.count(n) > 1})
        if dup:
            raise EmunetError(f'duplicate node names {dup}')

    @staticmethod
    def _assign_addresses(subnet: str, nodes: List[str]) -> Tuple[Dict[str, str], int]:
        try:
            net = ipaddress.ip_network(subnet)
        except ValueError as exc:
            raise EmunetError(f'subnet {subnet!r} is not a valid IPv4 network: {exc}') from exc
        if net.version != 4 or not net.subnet_of(ALLOWED_NETWORK):
            raise EmunetError(f'subnet {subnet!r} must lie inside {ALLOWED_NETWORK} (the '
                              f'benchmarking range) so no real address is ever used')
        hosts = list(net.hosts()) if net.num_addresses <= 65536 else None
        if hosts is None or len(hosts) < len(nodes):
            capacity = len(hosts) if hosts is not None else 'too many'
            raise EmunetError(f'subnet {subnet!r} holds {capacity} hosts, fewer than the '
                              f'{len(nodes)} nodes, or is larger than a /16')
        return {n: str(h) for n, h in zip(nodes, hosts)}, net.prefixlen

    # ----------------------------------------------------------------- naming and lookup

    @property
    def nodes(self) -> List[str]:
        """Node names in the order given."""
        return list(self._nodes)

    @property
    def bridge_netns(self) -> str:
        """Name of the namespace holding the bridge."""
        return f'{self._base}-br'

    @property
    def namespaces(self) -> List[str]:
        """Every namespace this topology creates (bridge first)."""
        return [self.bridge_netns] + [self.netns(n) for n in self._nodes]

    def _node(self, node: str) -> str:
        if node not in self._addrs:
            raise EmunetError(f'unknown node {node!r}; nodes are {self._nodes}')
        return node

    def addr(self, node: str) -> str:
        """IPv4 address of ``node`` (deterministic by the order nodes were given)."""
        return self._addrs[self._node(node)]

    def netns(self, node: str) -> str:
        """Namespace name of ``node``."""
        return f'{self._base}-n-{self._node(node)}'

    def _bridge_port(self, node: str) -> str:
        return f'p{self._nodes.index(node)}'

    def wrap(self, node: str, argv: Sequence[str],
             binds: Optional[Mapping[str, str]] = None) -> List[str]:
        """``argv`` prefixed so that it runs inside ``node``'s namespace.

        ``binds`` (``{path seen in the node: path on this machine}``) gives the process, and
        every process it starts, a private view of those paths, as if the node were a machine
        with files of its own (e.g. a secret file at the same path on every host, whose content
        differs on one). See ``_bind_prefix``.
        """
        return (['ip', 'netns', 'exec', self.netns(node)] + _bind_prefix(binds or {})
                + [str(a) for a in argv])

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> 'Topology':
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def start(self) -> 'Topology':
        """Create namespaces, bridge, links, addresses, routes and shaping.

        Leftovers of crashed runs with the same prefix are removed first (``cleanup_stale``).
        On any failure everything created so far is removed before the error propagates.
        """
        if self._started:
            raise EmunetError(f'topology {self._base} was already started')
        check_prerequisites(tools=self._tools_needed(self._per_packet,
                                                     any(self._loss.values())))
        cleanup_stale(self._prefix)
        self._started = True
        atexit.register(self.close)
        self._install_sigterm()
        try:
            self._write_state()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _tools_needed(per_packet: bool, lossy: bool) -> Dict[str, str]:
        tools = dict(BASE_TOOLS)
        if per_packet:
            tools['ethtool'] = 'turning offloads off (per-packet mode: loss or a shallow queue)'
        if lossy:
            tools['nft'] = 'random loss per link (an nftables rule in the switch)'
        return tools

    def _write_state(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        state = {'pid': os.getpid(), 'start_time': _pid_start_time(os.getpid()),
                 'namespaces': self.namespaces}
        with open(_state_path(self._base), 'w') as f:
            json.dump(state, f)

    def _add_netns(self, name: str) -> None:
        _run(['ip', 'netns', 'add', name])
        self._created.append(name)
        _run(['ip', '-n', name, 'link', 'set', 'lo', 'up'])
        if shutil.which('sysctl') and os.path.isdir('/proc/sys/net/ipv6'):
            _run(['ip', 'netns', 'exec', name, 'sysctl', '-q', '-w',
                  'net.ipv6.conf.all.disable_ipv6=1', 'net.ipv6.conf.default.disable_ipv6=1'])

    def _build(self) -> None:
        br = self.bridge_netns
        self._add_netns(br)
        _run(['ip', '-n', br, 'link', 'add', BRIDGE_IFACE, 'type', 'bridge'])
        _run(['ip', '-n', br, 'link', 'set', BRIDGE_IFACE, 'up'])
        for node in self._nodes:
            ns, port = self.netns(node), self._bridge_port(node)
            self._add_netns(ns)
            _run(['ip', '-n', ns, 'link', 'add', NODE_IFACE, 'mtu', str(self._mtu), 'type',
                  'veth', 'peer', 'name', port, 'mtu', str(self._mtu), 'netns', br])
            if self._per_packet:
                _set_offloads(ns, NODE_IFACE, on=False)
                _set_offloads(br, port, on=False)
            _run(['ip', '-n', br, 'link', 'set', port, 'master', BRIDGE_IFACE])
            _run(['ip', '-n', br, 'link', 'set', port, 'up'])
            _run(['ip', '-n', ns, 'addr', 'add', f'{self.addr(node)}/{self._prefixlen}',
                  'dev', NODE_IFACE])
            _run(['ip', '-n', ns, 'link', 'set', NODE_IFACE, 'up'])
            # On-link default route: "which address would reach the world" lookups (e.g. a
            # UDP connect to 10.255.255.255) resolve to the node's address; nothing is sent.
            _run(['ip', '-n', ns, 'route', 'add', 'default', 'dev', NODE_IFACE])
            up, down = self._wanted[node]
            self.set_rate(node, up, down)
        for node, percent in self._loss.items():
            if percent:
                self._apply_loss(node, percent)

    def _install_sigterm(self) -> None:
        if not self._handle_sigterm or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def on_sigterm(signum, frame):
            raise SystemExit(128 + signum)

        self._prev_sigterm = on_sigterm
        signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._prev_sigterm is None:
            return
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is self._prev_sigterm):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._prev_sigterm = None

    def close(self) -> None:
        """Stop schedules and tracked processes, then delete every namespace created.

        Idempotent; safe to call from atexit. Raises EmunetError only after trying everything,
        if some namespace could not be deleted.
        """
        with self._lock:
            if self._closed or not self._started:
                return
            self._closed = True
        errors = []
        for sched in list(self._schedules):
            sched.stop(raise_errors=False)
        procs = [p for p in self._procs if p.poll() is None]
        _kill_pids([p.pid for p in procs], self._kill_grace)
        for p in procs:
            try:
                p.wait(timeout=self._kill_grace)
            except subprocess.TimeoutExpired:
                errors.append(f'process {p.pid} ({p.args!r}) survived SIGKILL')
        for ns in reversed(self._created):
            try:
                _delete_netns(ns, self._kill_grace)
            except EmunetError as exc:
                errors.append(str(exc))
        if not errors:
            _remove_file(_state_path(self._base))
        self._restore_sigterm()
        atexit.unregister(self.close)
        if errors:
            raise EmunetError(f'cleanup of {self._base} incomplete (run cleanup_stale() later): '
                              + '; '.join(errors))

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran."""
        return self._closed

    def _check_open(self) -> None:
        if not self._started or self._closed:
            raise EmunetError(f'topology {self._base} is not open (use it inside `with`)')

    # ----------------------------------------------------------------- processes

    def popen(self, node: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace; it is stopped (by PID) on close.

        ``kwargs`` go to ``subprocess.Popen``; ``start_new_session`` defaults to True so a
        Ctrl-C at the terminal reaches only this process, which then tears the network down.
        ``binds=`` ({path in the node: path on this machine}) is taken first (see ``wrap``).
        """
        self._check_open()
        binds = kwargs.pop('binds', None)
        kwargs.setdefault('start_new_session', True)
        proc = subprocess.Popen(self.wrap(node, argv, binds=binds), **kwargs)
        with self._lock:
            self._procs.append(proc)
        return proc

    @property
    def processes(self) -> List[subprocess.Popen]:
        """Processes started with ``popen`` (running or not)."""
        return list(self._procs)

    def start_service(self, node: str, argv: Sequence[str], ready: str, log_path: str,
                      timeout: float = 30.0, binds: Optional[Mapping[str, str]] = None,
                      **kwargs) -> subprocess.Popen:
        """Start a long-running server (e.g. an sshd) in ``node`` and wait until it is ready.

        Its stdout and stderr go, line by line, to ``log_path`` (a thread copies them: a pipe
        nobody reads would block the server once full); it is ready when a line matches the
        regular expression ``ready`` (e.g. sshd's "Server listening on"). Like ``popen``'s
        processes it is stopped on close. ``kwargs`` go to ``subprocess.Popen``.

        Raises:
            EmunetError: the server exited or printed no ready line within ``timeout``
                seconds; it is stopped and the message quotes the end of its log.
        """
        self._check_open()
        proc = self.popen(node, argv, binds=binds, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
        try:
            watch = _LineWatch(proc.stdout, log_path, re.compile(ready))
        except BaseException:
            _kill_pids([proc.pid], self._kill_grace)
            raise
        woke = watch.wake.wait(timeout)
        if woke and watch.matched and proc.poll() is None:
            return proc
        if woke and not watch.matched:      # its output closed: it is exiting
            try:
                proc.wait(self._kill_grace)
            except subprocess.TimeoutExpired:
                pass
        rc = proc.poll()
        if rc is None:
            why = f'printed no line matching {ready!r} within {timeout:.0f} s'
        else:
            why = f'exited with code {rc} ' + ('right after its ready line' if watch.matched
                                                else 'before it was ready')
        _kill_pids([proc.pid], self._kill_grace)
        proc.wait()
        watch.join(self._kill_grace)
        with open(log_path, errors='replace') as f:
            tail = f.read()[-2000:]
        raise EmunetError(f'service {" ".join(map(str, argv))!r} in node {node!r} {why}; '
                          f'its log ({log_path}) ends with:\n{tail or "(nothing)"}')

    def node_pids(self, node: str) -> List[int]:
        """PIDs of every process now running in ``node``'s namespace (whoever started it)."""
        self._check_open()
        return _netns_pids(self.netns(node))

    def wait_node_idle(self, node: str, timeout: float, keep: Iterable[int] = ()) -> List[int]:
        """Wait until every process now in ``node``, other than ``keep``, has exited.

        For processes the caller did not start itself and so cannot ``wait()`` for, e.g. the
        ssh clients a launcher leaves behind when it exits. Woken by each exit (pidfds).

        Returns:
            PIDs still running after ``timeout`` seconds (empty: the node is idle).
        """
        keep = set(keep)
        return _wait_exits([p for p in self.node_pids(node) if p not in keep], timeout)

    # ----------------------------------------------------------------- shaping

    _UNSET = object()

    def set_rate(self, node: str, up_mbit: Rate, down_mbit: object = _UNSET) -> None:
        """Change ``node``'s shaping live. Mbit/s; None is unshaped; ``down_mbit`` defaults
        to ``up_mbit``.

        Lowering a rate drops what is queued beyond the new limit (see ``qdisc_stats``).
        """
        self._check_open()
        down = up_mbit if down_mbit is self._UNSET else down_mbit
        up, down = _normalize_rate((up_mbit, down), repr(node))
        with self._lock:
            old_up, old_down = self._rates[self._node(node)]
            _apply_shaping(self.netns(node), NODE_IFACE, old_up, up, self._shape('up'))
            self._rates[node] = (up, old_down)
            _apply_shaping(self.bridge_netns, self._bridge_port(node), old_down, down,
                           self._shape('down'))
            self._rates[node] = (up, down)

    def _shape(self, direction: str) -> Shape:
        """Sizing of the shapers of one direction: the switch ports' (``down``) queue is
        ``queue_ms``, the nodes' own (``up``) the default."""
        queue_s = self._queue_s if direction == 'down' else QUEUE_SECONDS
        return Shape(queue_s, self._mtu, self._per_packet)

    def _reshape(self) -> None:
        """Re-apply every shaper (after the queue or the mode changed)."""
        for node in self._nodes:
            up, down = self._rates[node]
            _apply_shaping(self.netns(node), NODE_IFACE, up, up, self._shape('up'))
            _apply_shaping(self.bridge_netns, self._bridge_port(node), down, down,
                           self._shape('down'))

    @property
    def queue_ms(self) -> float:
        """The switch ports' queue, in milliseconds at each port's rate."""
        return self._queue_s * 1000

    @property
    def mtu(self) -> int:
        """MTU of every veth."""
        return self._mtu

    @property
    def per_packet(self) -> bool:
        """True when offloads are off, so shaping and loss act on each packet."""
        return self._per_packet

    def set_queue(self, queue_ms: float) -> None:
        """Change the switch ports' queue live (every shaped download), in milliseconds.

        A queue shorter than the default switches the topology to per-packet mode first.
        """
        self._check_open()
        queue_s = self._check_queue(queue_ms)
        with self._lock:
            if self._shallow(queue_s):
                self._ensure_per_packet(f'queue_ms={queue_ms}')
            self._queue_s = queue_s
            self._reshape()

    def _ensure_per_packet(self, why: str) -> None:
        """Turn offloads off on every veth and resize the shapers for single packets."""
        if self._per_packet:
            return
        if self._per_packet_forced is False:
            raise EmunetError(f'{why} needs per-packet mode, but topology {self._base} was '
                              f'built with per_packet=False')
        check_prerequisites(tools=self._tools_needed(True, False))
        for node in self._nodes:
            _set_offloads(self.netns(node), NODE_IFACE, on=False)
            _set_offloads(self.bridge_netns, self._bridge_port(node), on=False)
        self._per_packet = True
        self._reshape()

    # ----------------------------------------------------------------- loss

    def set_loss(self, node: str, percent: float) -> None:
        """Drop ``percent`` of the packets towards ``node`` at random, from now on (0: none).

        Switches the topology to per-packet mode first if needed.
        """
        self._check_open()
        percent = _check_loss(percent, self._node(node))
        with self._lock:
            if percent:
                self._ensure_per_packet(f'loss towards {node!r}')
            self._apply_loss(node, percent)

    def loss(self, node: str) -> float:
        """Percent of the packets towards ``node`` dropped at random."""
        return self._loss[self._node(node)]

    def loss_drops(self, node: str) -> int:
        """Packets towards ``node`` dropped by its loss rule so far (0 if it never had one)."""
        self._check_open()
        if not self._loss_table_made:
            return 0
        out = _nft(self.bridge_netns, '-j', 'list', 'counter', 'bridge', LOSS_TABLE,
                   self._loss_counter(self._node(node)))
        for entry in json.loads(out).get('nftables', []):
            if 'counter' in entry:
                return int(entry['counter'].get('packets', 0))
        raise EmunetError(f'loss counter of {node!r} missing from `nft list counter`: '
                          f'{out[:200]!r}')

    def _loss_counter(self, node: str) -> str:
        return f'to_{node}'

    def _make_loss_table(self) -> None:
        """The table, its chain on bridged frames and one named counter per node, once."""
        if self._loss_table_made:
            return
        check_prerequisites(tools=self._tools_needed(False, True))
        lines = [f'add table bridge {LOSS_TABLE}',
                 f'add chain bridge {LOSS_TABLE} {LOSS_CHAIN} '
                 f'{{ type filter hook forward priority 0; policy accept; }}']
        lines += [f'add counter bridge {LOSS_TABLE} {self._loss_counter(n)}'
                  for n in self._nodes]
        _run(['ip', 'netns', 'exec', self.bridge_netns, 'nft', '-f', '-'],
             input_text='\n'.join(lines) + '\n')
        self._loss_table_made = True

    def _apply_loss(self, node: str, percent: float) -> None:
        """Install, replace or remove ``node``'s loss rule (its handle is kept)."""
        if percent:
            self._make_loss_table()
        handle = self._loss_handles.get(node)
        where = ['bridge', LOSS_TABLE, LOSS_CHAIN]
        if percent and handle is None:
            rule = _loss_rule(self._bridge_port(node), self._loss_counter(node), percent)
            out = _nft(self.bridge_netns, '-e', '-a', 'add', 'rule', *where, *rule)
            found = re.search(r'# handle (\d+)', out)
            if not found:
                raise EmunetError(f'nft did not echo the handle of the loss rule towards '
                                  f'{node!r}: {out.strip()!r}')
            self._loss_handles[node] = int(found.group(1))
        elif percent:
            rule = _loss_rule(self._bridge_port(node), self._loss_counter(node), percent)
            _nft(self.bridge_netns, 'replace', 'rule', *where, 'handle', str(handle), *rule)
        elif handle is not None:
            _nft(self.bridge_netns, 'delete', 'rule', *where, 'handle', str(handle))
            del self._loss_handles[node]
        self._loss[node] = percent

    def rate(self, node: str) -> Tuple[Rate, Rate]:
        """Current ``(up, down)`` of ``node`` in Mbit/s (None: unshaped)."""
        return self._rates[self._node(node)]

    def qdisc_stats(self, node: str) -> Dict[str, Dict[str, object]]:
        """Counters of ``node``'s shapers: ``{'up': {...}, 'down': {...}}``.

        Each holds ``kind`` (``tbf`` when shaped), ``bytes``, ``packets``, ``drops``,
        ``overlimits`` and ``backlog`` (bytes queued now). Counters survive rate changes.
        """
        self._check_open()
        return {'up': _qdisc_counters(self.netns(node), NODE_IFACE),
                'down': _qdisc_counters(self.bridge_netns, self._bridge_port(self._node(node)))}

    def run_schedule(self, events: Sequence[Tuple[float, Mapping[str, RateSpec]]]
                     ) -> 'RateSchedule':
        """Apply rate changes at offsets (seconds) from now, in a background thread.

        Each event maps nodes to a rate spec as in ``rates`` (number, (up, down) or None).
        """
        self._check_open()
        checked = []
        for t, changes in events:
            if not isinstance(t, (int, float)) or t < 0:
                raise EmunetError(f'schedule offset must be seconds >= 0, got {t!r}')
            checked.append((float(t), {self._node(n): _normalize_rate(r, repr(n))
                                       for n, r in changes.items()}))
        sched = RateSchedule(self, sorted(checked, key=lambda e: e[0]))
        with self._lock:
            self._schedules.append(sched)
        sched._start()
        return sched


class RateSchedule:
    """Background application of timed rate changes; made by ``Topology.run_schedule``.

    Attributes:
        log: ``(wall_time, node, up, down)`` for each change actually applied.
        errors: exceptions raised while applying changes (the schedule stops at the first).
    """

    def __init__(self, topo: Topology,
                 events: List[Tuple[float, Dict[str, Tuple[Rate, Rate]]]]) -> None:
        self._topo = topo
        self._events = events
        self._stop = threading.Event()
        self.log: List[Tuple[float, str, Rate, Rate]] = []
        self.errors: List[BaseException] = []
        self._thread = threading.Thread(target=self._loop, name='emunet-schedule', daemon=True)

    def _start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def _loop(self) -> None:
        for offset, changes in self._events:
            if self._stop.wait(max(0.0, self._t0 + offset - time.monotonic())):
                return
            for node, (up, down) in changes.items():
                try:
                    self._topo.set_rate(node, up, down)
                except Exception as exc:  # reported through .errors / stop()
                    self.errors.append(exc)
                    return
                self.log.append((time.time(), node, up, down))

    @property
    def done(self) -> bool:
        """True when every event was applied, or the schedule was stopped or failed."""
        return not self._thread.is_alive()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait for the schedule to finish; True if it did. Raises the first apply error."""
        self._thread.join(timeout)
        self._raise_errors()
        return self.done

    def stop(self, raise_errors: bool = True) -> None:
        """Stop applying further changes and wait for the thread."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if raise_errors:
            self._raise_errors()

    def _raise_errors(self) -> None:
        if self.errors:
            raise EmunetError(f'rate schedule failed: {self.errors[0]}') from self.errors[0]
