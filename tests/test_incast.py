"""``python -m mxps_tools.incast``: the push-alone incast benchmark.

Its pure parts (message sizes, goodput, the ideal round, percentiles, how receivers' records
combine into rounds and rounds into a summary, the grid) are tested without a network; the TCP
transport on loopback in this process (rounds complete, a stalled or confused sender is named);
the driver's wait for its node processes with local processes; and one tiny run end to end as a
user runs it (2 senders -> 1 receiver, 1% loss; needs root), which must leave no namespace.
"""
import json
import os
import re
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mxps_tools import emunet, incast

PREFIX = "mxpsic-"        # namespaces of these tests only

#: the emulated network: root (tests/conftest.py fails the test without it, naming why)
needs_root = pytest.mark.netns


# ------------------------------------------------------------------ sizes, goodput, ideal


@pytest.mark.parametrize("text, expected", [("4M", 4 << 20), ("256K", 256 << 10),
                                            ("50k", 50 << 10), ("1000", 1000), ("2MB", 2 << 20)])
def test_message_sizes_parse_with_binary_k_and_m(text, expected):
    assert incast.parse_size(text) == expected
    assert incast.parse_size(incast.size_label(expected).replace(" ", "")) == expected


@pytest.mark.parametrize("text", ["", "0", "-4M", "4G", "four"])
def test_bad_message_size_is_rejected_with_the_value_named(text):
    with pytest.raises(incast.IncastError, match=re.escape(repr(text))):
        incast.parse_size(text)


def test_goodput_is_the_rate_times_payload_per_frame():
    # 1448 payload bytes in every 1514-byte frame at MTU 1500: 47.8 MB/s of 50 MB/s.
    assert incast.goodput(400.0) == pytest.approx(50e6 * 1448 / 1514)
    assert incast.goodput(400.0, mtu=9000) == pytest.approx(50e6 * 8948 / 9014)
    assert incast.goodput(400.0, mtu=9000) > incast.goodput(400.0)
    with pytest.raises(incast.IncastError, match="MTU 40"):
        incast.goodput(400.0, mtu=40)


def test_ideal_round_is_every_senders_slice_over_one_receivers_goodput():
    one = incast.ideal_seconds(8, 4 << 20, 400.0)
    assert one == pytest.approx(8 * (4 << 20) / (50e6 * 1448 / 1514))
    assert 0.70 < one < 0.71
    # Two receivers each carry half; an odd byte goes to the first, which sets the pace.
    assert incast.ideal_seconds(8, 4 << 20, 400.0, receivers=2) == pytest.approx(one / 2)
    assert incast.ideal_seconds(2, 3, 400.0, receivers=2) == 2 * 2 / incast.goodput(400.0)


@given(st.integers(1, 10 ** 7), st.integers(1, 16))
def test_slices_cover_the_message_and_differ_by_at_most_one_byte(message, receivers):
    sizes = [incast.slice_bytes(message, receivers, r) for r in range(receivers)]
    assert sum(sizes) == message
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@settings(max_examples=200)
@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=60),
       st.floats(0, 100))
def test_percentile_matches_numpys_linear_interpolation(values, q):
    assert incast.percentile(values, q) == pytest.approx(np.percentile(values, q), abs=1e-9)


# ------------------------------------------------------------------ rounds and summaries


def _rec(k, go, done, delivered=100, expected=100, reason="complete", warmup=False, first=None):
    return {"round": k, "go": go, "first": first, "done": done, "delivered": delivered,
            "expected": expected, "reason": reason, "warmup": warmup}


def test_a_round_runs_from_the_last_go_to_the_last_receiver_done():
    r0 = [_rec(0, 10.0, 10.5, first=10.1), _rec(1, 10.5, 11.0)]
    r1 = [_rec(0, 10.2, 10.4, delivered=90, reason="ratio", first=10.3),
          _rec(1, 10.6, 11.3, reason="complete")]
    rounds = incast.combine_receivers([r0, r1])
    assert [r["seconds"] for r in rounds] == pytest.approx([0.3, 0.7])
    assert rounds[0]["start_lag"] == pytest.approx(-0.1)      # r0 heard data before r1's go
    assert rounds[0]["delivered"] == 190 and rounds[0]["expected"] == 200
    assert rounds[0]["reason"] == "complete+ratio" and rounds[1]["reason"] == "complete"
    assert rounds[1]["start_lag"] is None


def test_receivers_with_different_rounds_are_an_error():
    with pytest.raises(incast.IncastError, match=r"numbers of rounds: \[2, 1\]"):
        incast.combine_receivers([[_rec(0, 0, 1), _rec(1, 1, 2)], [_rec(0, 0, 1)]])
    with pytest.raises(incast.IncastError, match="disagree on the round"):
        incast.combine_receivers([[_rec(0, 0, 1)], [_rec(3, 0, 1)]])


def test_summary_leaves_out_warmup_and_divides_by_the_ideal():
    rounds = [{"round": 0, "seconds": 9.0, "delivered": 1, "expected": 2, "reason": "complete",
               "warmup": True, "start_lag": 0.5}]
    rounds += [{"round": k, "seconds": s, "delivered": d, "expected": 100, "reason": why,
                "warmup": False, "start_lag": 0.001}
               for k, (s, d, why) in enumerate([(1.0, 100, "complete"), (2.0, 100, "complete"),
                                                (3.0, 80, "deadline"), (6.0, 100, "complete")],
                                               start=1)]
    s = incast.summarise(rounds, ideal=2.0)
    assert s["rounds"] == 4
    assert s["mean_s"] == pytest.approx(3.0) and s["mean_over_ideal"] == pytest.approx(1.5)
    assert s["p99_s"] == pytest.approx(np.percentile([1, 2, 3, 6], 99))
    assert s["p99_over_ideal"] == pytest.approx(s["p99_s"] / 2.0)
    assert s["max_over_ideal"] == pytest.approx(3.0)
    assert s["delivered_mean"] == pytest.approx(0.95) and s["delivered_min"] == pytest.approx(0.8)
    assert s["reasons"] == {"complete": 3, "deadline": 1}
    assert s["start_lag_mean_s"] == pytest.approx(0.001)
    with pytest.raises(incast.IncastError, match="all 1 are warmup"):
        incast.summarise(rounds[:1], ideal=2.0)


def test_grid_is_the_issues_table_with_more_rounds_for_smaller_messages():
    points = incast.grid_points()
    assert len(points) == 3 * 2 * 4
    assert {(p.message, p.queue_ms, p.loss) for p in points} == {
        (m, q, l) for m in (4 << 20, 256 << 10, 50 << 10) for q in (100.0, 2.0)
        for l in (0.0, 1.0, 5.0, 10.0)}
    assert {p.message: p.rounds for p in points} == incast.GRID_ROUNDS
    assert incast.GRID_ROUNDS[50 << 10] > incast.GRID_ROUNDS[4 << 20]
    assert {p.rounds for p in incast.grid_points(rounds=7)} == {7}


@pytest.mark.parametrize("argv, named", [(["--senders", "0"], "--senders"),
                                         (["--loss", "120"], "--loss"),
                                         (["--transport", "carrier-pigeon"], "carrier-pigeon"),
                                         (["--message", "2", "-R", "3"], "--message 2"),
                                         (["--mtu", "40"], "MTU 40")])
def test_bad_settings_are_rejected_with_the_setting_named(argv, named):
    a = incast.build_parser().parse_args(argv)
    with pytest.raises(incast.IncastError, match=named):
        incast.check_args(a)


def test_importing_the_benchmark_imports_neither_mxnet_nor_the_runtime():
    code = ("import sys, mxps_tools.incast; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mxnet', 'mxps')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=dict(os.environ, DMLC_ROLE="server")).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ TCP transport, loopback


def _spec(senders, message, port, sender=-1, timeout=5.0):
    return incast.Endpoint(senders=senders, sender=sender, message_bytes=message, port=port,
                           round_timeout=timeout, rate_mbit=400.0, mtu=1500)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_rounds_complete_with_every_senders_message():
    port, message, rounds = _free_port(), 300_000, 3
    receiver = incast.TcpReceiver(_spec(2, message, port))
    senders = [incast.TcpSender(_spec(2, message, port, sender=i), "127.0.0.1")
               for i in range(2)]
    try:
        receiver.accept(timeout=5)

        def push(s):
            for k in range(rounds):
                s.send(k, memoryview(bytearray(message)))

        threads = [threading.Thread(target=push, args=(s,)) for s in senders]
        for t in threads:
            t.start()
        got = [receiver.receive_round(k) for k in range(rounds)]
        for t in threads:
            t.join(timeout=5)
        assert got == [(2 * message, "complete")] * rounds
        assert receiver.first_byte is not None
    finally:
        for s in senders:
            s.close()
        receiver.close()


def test_tcp_round_that_times_out_names_the_round_and_the_silent_sender():
    port, message = _free_port(), 1000
    receiver = incast.TcpReceiver(_spec(2, message, port, timeout=0.3))
    senders = [incast.TcpSender(_spec(2, message, port, sender=i), "127.0.0.1")
               for i in range(2)]
    try:
        receiver.accept(timeout=5)
        senders[0].send(0, memoryview(bytearray(message)))
        with pytest.raises(incast.IncastError, match=r"round 0: senders \[1\] delivered \[0\]"):
            receiver.receive_round(0)
    finally:
        for s in senders:
            s.close()
        receiver.close()


def test_tcp_message_of_another_round_is_an_error_naming_both_rounds():
    port, message = _free_port(), 1000
    receiver = incast.TcpReceiver(_spec(1, message, port))
    sender = incast.TcpSender(_spec(1, message, port, sender=0), "127.0.0.1")
    try:
        receiver.accept(timeout=5)
        sender.send(4, memoryview(bytearray(message)))
        with pytest.raises(incast.IncastError, match="round 0: sender 0 sent round 4"):
            receiver.receive_round(0)
    finally:
        sender.close()
        receiver.close()


def test_receiver_waiting_for_senders_names_those_connected():
    port = _free_port()
    receiver = incast.TcpReceiver(_spec(2, 10, port))
    sender = incast.TcpSender(_spec(2, 10, port, sender=1), "127.0.0.1")
    try:
        with pytest.raises(incast.IncastError, match=r"only senders \[1\] of 2 connected"):
            receiver.accept(timeout=0.3)
    finally:
        sender.close()
        receiver.close()


# ------------------------------------------------------------------ driver


def test_wait_for_nodes_fails_fast_with_the_failed_nodes_log(tmp_path):
    log = tmp_path / "s1.log"
    log.write_text("Traceback ...\nConnectionRefusedError: sender 1 could not connect\n")
    slow = subprocess.Popen(["sleep", "30"])
    failed = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    try:
        with pytest.raises(incast.IncastError) as info:
            incast._wait_processes({"r0": (slow, str(tmp_path / "r0.log")),
                                    "s1": (failed, str(log))}, timeout=20)
        assert "node s1 exited with code 3" in str(info.value)
        assert "sender 1 could not connect" in str(info.value)
        assert slow.poll() is None              # woken by the failure, not by the deadline
    finally:
        slow.kill()
        slow.wait()


def test_wait_for_nodes_names_one_still_running_at_the_deadline(tmp_path):
    slow = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(incast.IncastError, match="node r0 still running after 0 s"):
            incast._wait_processes({"r0": (slow, str(tmp_path / "r0.log"))}, timeout=0.2)
    finally:
        slow.kill()
        slow.wait()


def _our_namespaces():
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.startswith(PREFIX)]


@needs_root
@pytest.mark.parametrize("receivers, loss, cc", [(1, 1.0, "cubic"), (2, 0.0, None)])
def test_tiny_tcp_incast_runs_end_to_end_and_leaves_nothing_behind(tmp_path, receivers, loss, cc):
    out = tmp_path / "incast.json"
    cmd = [sys.executable, "-m", "mxps_tools.incast", "--transport", "tcp", "--senders", "2",
           "--receivers", str(receivers), "--message", "64K", "--queue-ms", "2",
           "--loss", str(loss), "--rounds", "4", "--warmup", "1", "--round-timeout", "20",
           "--out", str(out), "--netns-prefix", PREFIX] + (["--tcp-cc", cc] if cc else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "| 64 KB | 2 ms | %g%% |" % loss in done.stdout
    record = json.loads(out.read_text())
    assert (record["senders"], record["receivers"]) == (2, receivers)
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        assert record["tcp_congestion_control"] == (cc or f.read().strip())
    (point,) = record["points"]
    s = point["summary"]
    assert s["rounds"] == 4 and len(point["rounds"]) == 5
    assert s["delivered_mean"] == 1.0 and s["reasons"] == {"complete": 4}
    assert s["ideal_s"] == pytest.approx(incast.ideal_seconds(2, 64 << 10, 400.0,
                                                              receivers=receivers))
    # The links are shaped: no round beats the ideal by more than the shapers' few-frame bucket.
    assert s["p50_over_ideal"] > 0.85
    if not loss:
        assert point["counters"]["loss_drops"] == 0
    assert not _our_namespaces()
    assert not emunet.cleanup_stale(PREFIX)


def test_tcp_sender_uses_the_congestion_control_asked_for_and_names_an_unknown_one():
    port = _free_port()
    receiver = incast.TcpReceiver(_spec(1, 10, port))
    spec = incast.Endpoint(1, 0, 10, port, 5.0, 400.0, 1500, tcp_cc="reno")
    sender = incast.TcpSender(spec, "127.0.0.1")
    try:
        used = sender.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        assert used.rstrip(b"\0") == b"reno"
        with pytest.raises(incast.IncastError, match="--tcp-cc no_such_cc"):
            incast.TcpSender(incast.Endpoint(1, 0, 10, port, 5.0, 400.0, 1500,
                                             tcp_cc="no_such_cc"), "127.0.0.1")
    finally:
        sender.close()
        receiver.close()
