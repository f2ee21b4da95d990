"""Tests of mxps_tools.emunet: shaping accuracy, live rate changes, cleanup, safety of the root
namespace.

Most tests need root and iproute2 (they build real namespaces); they are skipped otherwise.
Throughput is measured with a small Python TCP sender/receiver run inside the namespaces.
Importing the tools imports neither MXNet nor the runtime, so the tests and the child processes
below simply ``import mxps_tools.emunet`` (as installed).
"""

import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from mxps_tools import emunet

#: TCP payload per Ethernet frame counted by tbf (MSS 1448 with timestamps, 1514-byte frame).
GOODPUT = 1448 / 1514
TOLERANCE = 0.10
PORT = 5001
TRANSFER_SECONDS = 2.5
#: Skip the start of a transfer (slow start, the tbf bucket's initial burst).
WARMUP_SECONDS = 0.5


def _prerequisites_missing():
    try:
        emunet.check_prerequisites()
    except emunet.EmunetError as exc:
        return str(exc)
    return None


needs_root = pytest.mark.skipif(_prerequisites_missing() is not None,
                                reason=f'emunet prerequisites: {_prerequisites_missing()}')

RECEIVER = textwrap.dedent('''
    import json, socket, sys, time
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(('0.0.0.0', int(sys.argv[1])))
    srv.listen(1)
    srv.settimeout(10)
    print('ready', flush=True)
    conn, _ = srv.accept()
    conn.settimeout(10)
    buf = bytearray(1 << 20)
    total, last, samples = 0, 0.0, []
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        total += n
        now = time.time()
        if now - last >= 0.02:
            samples.append((now, total))
            last = now
    samples.append((time.time(), total))
    print(json.dumps(samples), flush=True)
''')

SENDER = textwrap.dedent('''
    import socket, sys, time
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    chunk = b'\\0' * (128 * 1024)
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:
        conn.sendall(chunk)
    conn.close()
''')


def _transfer(topo, src, dst, seconds=TRANSFER_SECONDS):
    """Send TCP from ``src`` to ``dst`` for ``seconds``; (wall_time, bytes received) samples."""
    rx = topo.popen(dst, [sys.executable, '-c', RECEIVER, str(PORT)],
                    stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == 'ready'
    tx = topo.popen(src, [sys.executable, '-c', SENDER, topo.addr(dst), str(PORT), str(seconds)])
    out, _ = rx.communicate(timeout=seconds + 15)
    assert tx.wait(timeout=10) == 0
    assert rx.returncode == 0
    return json.loads(out)


def _mbit(samples, t_from, t_to):
    """Goodput in Mbit/s between wall times ``t_from`` and ``t_to`` (nearest samples)."""
    inside = [s for s in samples if t_from <= s[0] <= t_to]
    assert len(inside) >= 2, f'too few samples in [{t_from}, {t_to}]'
    (t0, b0), (t1, b1) = inside[0], inside[-1]
    return (b1 - b0) * 8 / (t1 - t0) / 1e6


def _steady_mbit(samples):
    start = samples[0][0]
    return _mbit(samples, start + WARMUP_SECONDS, samples[-1][0] - 0.05)


def _assert_close(measured, configured):
    expected = configured * GOODPUT
    assert abs(measured - expected) <= TOLERANCE * expected, (
        f'measured {measured:.1f} Mbit/s, expected {expected:.1f} '
        f'({configured} Mbit/s configured)')


def _netns_names():
    out = subprocess.run(['ip', 'netns', 'list'], check=True, capture_output=True, text=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _root_network_state():
    def run(*argv):
        return subprocess.run(list(argv), check=True, capture_output=True, text=True).stdout
    return run('ip', '-o', 'addr'), run('ip', 'route'), run('ip', '-o', 'link')


@pytest.fixture(scope='module')
def topo():
    """One topology shared by the throughput tests: a, b unshaped unless a test shapes them."""
    with emunet.Topology(['a', 'b']) as t:
        yield t


# ------------------------------------------------------------------ no root needed


def test_check_prerequisites_names_missing_tc_when_not_on_path(tmp_path, monkeypatch):
    ip_path = emunet.shutil.which('ip') or '/usr/sbin/ip'
    os.symlink(ip_path, tmp_path / 'ip')
    monkeypatch.setenv('PATH', str(tmp_path))
    with pytest.raises(emunet.EmunetError, match='`tc` not found'):
        emunet.check_prerequisites(euid=0)


def test_check_prerequisites_names_root_and_every_missing_tool():
    with pytest.raises(emunet.EmunetError) as info:
        emunet.check_prerequisites(which=lambda tool: None, euid=1000)
    message = str(info.value)
    assert 'needs root' in message and '`ip` not found' in message and '`tc` not found' in message


def test_addresses_are_deterministic_and_inside_benchmarking_range():
    t = emunet.Topology(['sched', 's0', 's1', 'w0', 'w1'], subnet='198.19.7.0/24')
    assert [t.addr(n) for n in t.nodes] == [f'198.19.7.{i}' for i in range(1, 6)]
    for n in t.nodes:
        assert ipaddress.ip_address(t.addr(n)) in ipaddress.ip_network('198.18.0.0/15')
        assert t.wrap(n, ['true', 1]) == ['ip', 'netns', 'exec', t.netns(n), 'true', '1']
    assert emunet.Topology(['sched', 's0']).addr('s0') == '198.18.0.2'


@pytest.mark.parametrize('subnet', ['10.0.0.0/24', '198.20.0.0/24', '198.18.0.0/32', 'nonsense'])
def test_subnet_outside_range_or_too_small_is_rejected(subnet):
    with pytest.raises(emunet.EmunetError, match='subnet'):
        emunet.Topology(['a', 'b'], subnet=subnet)


def test_bad_names_and_rates_are_rejected_with_the_value_named():
    with pytest.raises(emunet.EmunetError, match="'a-b'"):
        emunet.Topology(['a-b'])
    with pytest.raises(emunet.EmunetError, match='duplicate'):
        emunet.Topology(['a', 'a'])
    with pytest.raises(emunet.EmunetError, match=r"unknown nodes \['z'\]"):
        emunet.Topology(['a'], rates={'z': 10.0})
    with pytest.raises(emunet.EmunetError, match='-5'):
        emunet.Topology(['a'], rates={'a': -5})


# ------------------------------------------------------------------ shaping


@needs_root
@pytest.mark.parametrize('rate', [50.0, 200.0])
def test_upload_limited_throughput_matches_configured_rate(topo, rate, record_property):
    topo.set_rate('a', rate, None)
    topo.set_rate('b', None, None)
    measured = _steady_mbit(_transfer(topo, 'a', 'b'))
    record_property('mbit', measured)
    print(f'upload {rate} Mbit/s -> {measured:.1f} Mbit/s goodput')
    _assert_close(measured, rate)
    assert topo.qdisc_stats('a')['up']['kind'] == 'tbf'


@needs_root
@pytest.mark.parametrize('rate', [50.0, 200.0])
def test_download_limited_throughput_matches_configured_rate(topo, rate):
    topo.set_rate('a', None, None)
    topo.set_rate('b', None, rate)
    before = topo.qdisc_stats('b')['down']['bytes']
    measured = _steady_mbit(_transfer(topo, 'a', 'b'))
    print(f'download {rate} Mbit/s -> {measured:.1f} Mbit/s goodput')
    _assert_close(measured, rate)
    stats = topo.qdisc_stats('b')
    assert stats['down']['bytes'] - before > measured * 1e6 / 8  # > one second of traffic
    assert topo.rate('b') == (None, rate)


@needs_root
def test_live_rate_change_by_schedule_takes_effect(topo):
    topo.set_rate('a', 200.0, None)
    topo.set_rate('b', None, None)
    switch = 1.5
    sched = topo.run_schedule([(switch, {'a': (50.0, None)})])
    samples = _transfer(topo, 'a', 'b', seconds=3.5)
    sched.join(timeout=1)
    assert [entry[1:] for entry in sched.log] == [('a', 50.0, None)]
    applied = sched.log[0][0]
    before = _mbit(samples, samples[0][0] + WARMUP_SECONDS, applied - 0.05)
    after = _mbit(samples, applied + 0.3, samples[-1][0] - 0.05)
    print(f'live change 200 -> 50 Mbit/s: {before:.1f} -> {after:.1f} Mbit/s goodput, '
          f'stats {topo.qdisc_stats("a")["up"]}')
    _assert_close(before, 200.0)
    _assert_close(after, 50.0)
    assert topo.rate('a') == (50.0, None)


# ------------------------------------------------------------------ cleanup and safety


@needs_root
def test_with_block_removes_namespaces_and_stops_processes_and_leaves_root_unchanged():
    root_before = _root_network_state()
    with emunet.Topology(['sched', 's0', 'w0'], rates={'s0': 100.0}) as t:
        names = set(t.namespaces)
        assert names <= _netns_names()
        proc = t.popen('s0', ['sleep', '60'])
        # MXNet's launcher finds "this machine's IP" with a UDP connect; it must be the node's.
        out = subprocess.run(t.wrap('w0', [sys.executable, '-c',
                                           'import socket; s = socket.socket(2, 2); '
                                           's.connect(("10.255.255.255", 1)); '
                                           'print(s.getsockname()[0])']),
                             check=True, capture_output=True, text=True).stdout.strip()
        assert out == t.addr('w0')
    assert not names & _netns_names()
    assert proc.poll() is not None
    assert t.closed
    assert _root_network_state() == root_before


@needs_root
def test_exception_inside_block_still_cleans_up():
    with pytest.raises(ZeroDivisionError):
        with emunet.Topology(['x', 'y'], default_rate=10.0) as t:
            names = set(t.namespaces)
            proc = t.popen('x', ['sleep', '60'])
            1 / 0
    assert not names & _netns_names()
    assert proc.poll() is not None


CRASHING_CHILD = textwrap.dedent('''
    import json, time
    from mxps_tools import emunet
    t = emunet.Topology(['x', 'y'], rates={'x': 20.0}).start()
    p = t.popen('y', ['sleep', '60'])
    print(json.dumps({'namespaces': t.namespaces, 'pid': p.pid}), flush=True)
    time.sleep(60)
''')


@needs_root
def test_cleanup_stale_removes_leftovers_of_a_sigkilled_run_and_a_new_topology_works():
    child = subprocess.Popen([sys.executable, '-c', CRASHING_CHILD],
                             stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(child.stdout.readline())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    leftovers = set(info['namespaces'])
    assert leftovers <= _netns_names()
    assert emunet._pid_alive(info['pid'])

    removed = emunet.cleanup_stale()

    assert leftovers <= set(removed)
    assert not leftovers & _netns_names()
    assert not emunet._pid_alive(info['pid'])
    with emunet.Topology(['x', 'y'], rates={'x': 20.0}) as t:
        assert t.rate('x') == (20.0, 20.0)
        samples = _transfer(t, 'x', 'y', seconds=0.5)
        assert samples[-1][1] > 0


EXITING_CHILD = textwrap.dedent('''
    import json, sys, time
    from mxps_tools import emunet
    if sys.argv[1] == 'atexit':
        t = emunet.Topology(['x', 'y']).start()
        p = t.popen('y', ['sleep', '60'])
        print(json.dumps({'namespaces': t.namespaces, 'pid': p.pid}), flush=True)
        sys.exit(0)
    with emunet.Topology(['x', 'y']) as t:
        p = t.popen('y', ['sleep', '60'])
        print(json.dumps({'namespaces': t.namespaces, 'pid': p.pid}), flush=True)
        time.sleep(60)
''')


@needs_root
@pytest.mark.parametrize('how', ['SIGINT', 'SIGTERM', 'atexit'])
def test_owner_process_cleans_up_on_ctrl_c_sigterm_and_plain_exit(how):
    child = subprocess.Popen([sys.executable, '-c', EXITING_CHILD, how],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(child.stdout.readline())
        if how != 'atexit':
            child.send_signal(getattr(signal, how))
        _, err = child.communicate(timeout=15)
        assert 'EmunetError' not in err
    finally:
        if child.poll() is None:
            child.kill()
    assert not set(info['namespaces']) & _netns_names()
    assert not emunet._pid_alive(info['pid'])


@needs_root
def test_cleanup_stale_keeps_namespaces_of_a_live_run(topo):
    emunet.cleanup_stale()
    assert set(topo.namespaces) <= _netns_names()
