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


#: the emulated network: root and its tools (tests/conftest.py fails the test without them)
needs_root = pytest.mark.netns

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
    import json, signal, sys, time
    # Ctrl-C as a terminal delivers it, even when pytest itself was started in the background
    # by a non-interactive shell (which starts it with SIGINT ignored, and children inherit that)
    signal.signal(signal.SIGINT, signal.default_int_handler)
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


# ------------------------------------------------------------------ loss, queue, MTU (no root)


def test_shallow_queue_is_time_at_the_rate_with_a_floor_of_a_few_frames():
    shallow = emunet.Shape(queue_s=0.002, mtu=1500, per_packet=True)
    burst, limit = emunet.tbf_sizes(400.0, shallow)
    assert limit == 100_000                         # 2 ms at 50 MB/s
    assert 4 * 1514 <= burst < limit
    tiny_burst, tiny_limit = emunet.tbf_sizes(1.0, emunet.Shape(0.0001, 9000, True))
    assert tiny_limit == emunet.MIN_QUEUE_FRAMES * 9014
    assert tiny_burst == emunet.PACKET_BURST_FRAMES * 9014  # a jumbo frame always fits


def test_default_shaping_keeps_the_sizes_it_always_had():
    # The formula before loss and shallow queues existed: benchmarks keep their numbers.
    for mbit in (10.0, 100.0, 400.0, 1000.0):
        rate_bytes = mbit * 1e6 / 8
        burst = max(128 * 1024, int(rate_bytes * 0.001))
        assert emunet.tbf_sizes(mbit) == (burst, burst + max(256 * 1024, int(rate_bytes * 0.05)))


def test_loss_threshold_is_the_percentage_of_the_random_range():
    assert emunet.loss_threshold(0) == 0
    assert emunet.loss_threshold(5) == emunet.LOSS_SCALE // 20
    assert emunet.loss_threshold(0.1) == emunet.LOSS_SCALE // 1000
    assert emunet.loss_threshold(100) == emunet.LOSS_SCALE


def test_bad_loss_queue_and_mtu_are_rejected_with_the_value_named():
    with pytest.raises(emunet.EmunetError, match=r"loss towards 'b'.*120"):
        emunet.Topology(['a', 'b'], loss={'b': 120})
    with pytest.raises(emunet.EmunetError, match=r"loss given for unknown nodes \['z'\]"):
        emunet.Topology(['a'], loss={'z': 1})
    with pytest.raises(emunet.EmunetError, match='queue_ms.*-2'):
        emunet.Topology(['a'], queue_ms=-2)
    with pytest.raises(emunet.EmunetError, match='mtu.*70000'):
        emunet.Topology(['a'], mtu=70000)
    with pytest.raises(emunet.EmunetError, match='per_packet=False'):
        emunet.Topology(['a', 'b'], loss={'b': 1}, per_packet=False)


def test_per_packet_mode_is_chosen_by_loss_or_a_shallow_queue_only():
    assert not emunet.Topology(['a', 'b']).per_packet
    assert not emunet.Topology(['a', 'b'], queue_ms=100, mtu=9000).per_packet
    assert emunet.Topology(['a', 'b'], loss={'b': 0.5}).per_packet
    assert emunet.Topology(['a', 'b'], queue_ms=2).per_packet
    assert emunet.Topology(['a', 'b'], per_packet=True).per_packet


def test_check_prerequisites_names_missing_nft_and_ethtool_with_their_packages():
    present = {'ip', 'tc'}
    with pytest.raises(emunet.EmunetError) as info:
        emunet.check_prerequisites(which=lambda t: t if t in present else None, euid=0,
                                   tools=emunet.Topology._tools_needed(True, True))
    message = str(info.value)
    assert '`nft` not found' in message and 'install nftables' in message
    assert '`ethtool` not found' in message and 'install ethtool' in message
    assert '`ip`' not in message


# ------------------------------------------------------------------ loss, queue, MTU (root)

#: Datagrams of the loss measurement; the end markers that follow them are many enough that
#: not all are lost (5% ** 50).
DATAGRAMS = 2000
END_MARKERS = 50
LOSS_PERCENT = 5.0
#: Binomial bound: a correct rule fails it about once in 1.7 million runs (5 sigma).
SIGMAS = 5.0

UDP_RECEIVER = textwrap.dedent('''
    import json, socket, sys
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)       # SO_RCVBUFFORCE (root)
    sock.bind(('0.0.0.0', int(sys.argv[1])))
    sock.settimeout(10)
    print('ready', flush=True)
    _, sender = sock.recvfrom(16)               # the sender's hello: its address
    sock.sendto(b'go', sender)                  # lossless direction; resolves ARP both ways
    data, ends, hellos = set(), 0, 1
    while ends == 0:
        payload = sock.recv(2048)
        if payload.startswith(b'end'):
            ends += 1
        elif payload == b'hello':               # a retry sent before the go arrived
            hellos += 1
        else:
            data.add(int(payload[:8]))
    sock.settimeout(0.3)                        # the rest of the end markers, then quiet
    try:
        while True:
            payload = sock.recv(2048)
            ends += payload.startswith(b'end')
    except socket.timeout:
        pass
    print(json.dumps({'data': len(data), 'ends': ends, 'hellos': hellos}), flush=True)
''')

UDP_SENDER = textwrap.dedent('''
    import socket, sys
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(0.2)                        # a hello the loss rule drops is sent again
    dest = (sys.argv[1], int(sys.argv[2]))
    for hellos in range(1, 101):                # hello until the receiver answers
        sock.sendto(b'hello', dest)
        try:
            sock.recv(16)
            break
        except socket.timeout:
            continue
    for seq in range(int(sys.argv[3])):
        sock.sendto(b'%08d' % seq + bytes(1016), dest)
    for _ in range(int(sys.argv[4])):
        sock.sendto(b'end', dest)
    print(hellos, flush=True)
''')


def _udp_burst(topo, src, dst):
    """Send DATAGRAMS 1-KB datagrams and END_MARKERS markers; what ``dst`` received."""
    rx = topo.popen(dst, [sys.executable, '-c', UDP_RECEIVER, str(PORT)],
                    stdout=subprocess.PIPE, text=True)
    assert rx.stdout.readline().strip() == 'ready'
    tx = topo.popen(src, [sys.executable, '-c', UDP_SENDER, topo.addr(dst), str(PORT),
                          str(DATAGRAMS), str(END_MARKERS)], stdout=subprocess.PIPE, text=True)
    out, _ = rx.communicate(timeout=40)
    sent_hellos, _ = tx.communicate(timeout=10)
    assert tx.returncode == 0 and rx.returncode == 0
    got = json.loads(out)
    got['hellos_sent'] = int(sent_hellos)
    return got


def _within_binomial(dropped, attempts, percent):
    p = percent / 100
    mean, sd = attempts * p, (attempts * p * (1 - p)) ** 0.5
    return abs(dropped - mean) <= SIGMAS * sd, f'{dropped} of {attempts}, expected {mean:.0f} ' \
                                               f'+- {SIGMAS * sd:.0f}'


@needs_root
def test_loss_rule_drops_the_configured_share_of_datagrams_and_nothing_else():
    # The sender's upload is shaped so its socket buffer paces it: no drop anywhere but the rule.
    with emunet.Topology(['a', 'b'], rates={'a': (100.0, None)},
                         loss={'b': LOSS_PERCENT}) as t:
        got = _udp_burst(t, 'a', 'b')
        counted = t.loss_drops('b')
        assert t.qdisc_stats('a')['up']['drops'] == 0
    # the hellos cross the rule too (a dropped one is sent again after 0.2 s)
    lost = (DATAGRAMS + END_MARKERS + got['hellos_sent']) - (got['data'] + got['ends']
                                                             + got['hellos'])
    print(f'{LOSS_PERCENT}% loss: {lost} of {DATAGRAMS + END_MARKERS} datagrams lost, '
          f'{counted} counted by the rule')
    assert counted == lost                      # every loss is the rule's, and per datagram
    ok, why = _within_binomial(DATAGRAMS - got['data'], DATAGRAMS, LOSS_PERCENT)
    assert ok, why


@needs_root
def test_tcp_completes_under_loss_and_loses_single_packets_not_super_packets():
    with emunet.Topology(['a', 'b'], rates={'b': (None, 400.0)},
                         loss={'b': LOSS_PERCENT}) as t:
        samples = _transfer(t, 'a', 'b', seconds=1.0)
        dropped, down = t.loss_drops('b'), t.qdisc_stats('b')['down']
    assert samples[-1][1] > 1_000_000           # the receiver saw EOF after >1 MB: done
    # tbf counts GSO segments; the rule counts what crosses the bridge. Super-packets of ~44
    # segments would make drops ~44x rarer than 5% of the segments.
    ok, why = _within_binomial(dropped, dropped + down['packets'] + down['drops'],
                               LOSS_PERCENT)
    assert ok, why
    assert down['bytes'] / down['packets'] <= 1500 + emunet.ETH_HEADER_BYTES


def _tbf_limit(entry):
    """tc shows a tbf's limit as latency: (limit - burst) / rate."""
    opts = entry['options']
    return opts['lat'] * 1e-6 * opts['rate'] + opts['burst']


def _json_of(argv):
    return json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)


@needs_root
def test_queue_mtu_and_offloads_are_applied_and_the_queue_changes_live():
    with emunet.Topology(['a', 'b'], default_rate=400.0, queue_ms=2, mtu=9000) as t:
        br, port_b = t.bridge_netns, 'p1'
        burst, limit = emunet.tbf_sizes(400.0, emunet.Shape(0.002, 9000, True))
        down = _json_of(['tc', '-n', br, '-j', 'qdisc', 'show', 'dev', port_b])[0]
        assert down['kind'] == 'tbf' and down['options']['rate'] == 50_000_000
        assert abs(_tbf_limit(down) - limit) <= 0.01 * limit and limit == 100_000
        up = _json_of(['tc', '-n', t.netns('b'), '-j', 'qdisc', 'show', 'dev', 'eth0'])[0]
        assert _tbf_limit(up) == pytest.approx(50e6 * emunet.QUEUE_SECONDS, rel=0.01)

        for ns, dev in ((t.netns('a'), 'eth0'), (br, 'p0'), (br, port_b), (br, 'br0')):
            assert _json_of(['ip', '-n', ns, '-j', 'link', 'show', dev])[0]['mtu'] == 9000
        for ns, dev in ((t.netns('b'), 'eth0'), (br, port_b)):
            features = subprocess.run(['ip', 'netns', 'exec', ns, 'ethtool', '-k', dev],
                                      check=True, capture_output=True, text=True).stdout
            for name in ('tcp-segmentation-offload', 'generic-segmentation-offload',
                         'generic-receive-offload', 'tx-udp-segmentation'):
                assert f'{name}: off' in features, f'{name} still on for {dev} in {ns}'

        t.set_queue(100)
        down = _json_of(['tc', '-n', br, '-j', 'qdisc', 'show', 'dev', port_b])[0]
        assert _tbf_limit(down) == pytest.approx(5_000_000, rel=0.01)
        assert t.queue_ms == 100 and t.per_packet


@needs_root
def test_loss_changes_live_and_is_removed_at_zero():
    with emunet.Topology(['a', 'b']) as t:
        assert not t.per_packet and t.loss_drops('b') == 0
        t.set_loss('b', 10)
        assert t.per_packet and t.loss('b') == 10
        rules = subprocess.run(['ip', 'netns', 'exec', t.bridge_netns, 'nft', 'list', 'chain',
                                'bridge', emunet.LOSS_TABLE, emunet.LOSS_CHAIN],
                               check=True, capture_output=True, text=True).stdout
        assert f'< {emunet.loss_threshold(10)}' in rules and 'oifname "p1"' in rules
        t.set_loss('b', 0)
        rules = subprocess.run(['ip', 'netns', 'exec', t.bridge_netns, 'nft', 'list', 'chain',
                                'bridge', emunet.LOSS_TABLE, emunet.LOSS_CHAIN],
                               check=True, capture_output=True, text=True).stdout
        assert 'numgen' not in rules


@needs_root
def test_failed_loss_rule_removes_everything_built_so_far(monkeypatch):
    monkeypatch.setattr(emunet, '_loss_rule', lambda port, counter, percent: ['nonsense'])
    topo = emunet.Topology(['a', 'b'], loss={'b': 1})
    with pytest.raises(emunet.EmunetError, match='nft.*nonsense'):
        topo.start()
    assert not set(topo.namespaces) & _netns_names()
    assert topo.closed
