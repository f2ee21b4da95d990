"""The server's rate grant to the workers pushing to it (mxps.ltp.share)."""
import pytest

from mxps.ltp import share
from mxps.ltp.share import Share


def _feed(s, workers, rate, seconds, start=0.0, nbytes=9000, loss_every=None):
    """Packets of ``nbytes`` from each of ``workers`` at ``rate`` bytes/s each, round robin;
    with ``loss_every`` k, every k-th packet number of a worker never arrives."""
    per = nbytes / rate
    t, pn = start, {w: 0 for w in workers}
    while t < start + seconds:
        for w in workers:
            pn[w] += 1
            if loss_every and pn[w] % loss_every == 0:
                continue
            s.on_packet(w, nbytes, t, pn[w])
        t += per
    return t


def test_no_grant_before_the_first_rate_sample():
    s = Share(4)
    assert s.grant(0.0) == 0.0
    s.on_packet(0, 9000, 0.0, 1)
    assert s.capacity is None and s.grant(0.001) == 0.0


def test_each_active_worker_gets_an_equal_share_of_what_arrives_with_headroom():
    s = Share(8)
    end = _feed(s, range(8), 50e6 / 8, 0.5)
    assert s.capacity == pytest.approx(50e6, rel=0.05)
    assert s.grant(end) == pytest.approx(share.HEADROOM * 50e6 / 8, rel=0.05)


def test_workers_silent_for_longer_than_active_do_not_count():
    s = Share(8)
    end = _feed(s, range(8), 50e6 / 8, 0.3)
    end = _feed(s, range(2), 25e6, 0.3 + share.ACTIVE, start=end)
    assert s.grant(end) == pytest.approx(share.HEADROOM * s.capacity / 2, rel=1e-9)


def test_packets_lost_on_the_way_count_as_sent_so_the_grant_does_not_shrink_with_loss():
    lossless, lossy = Share(4), Share(4)
    _feed(lossless, range(4), 10e6, 0.5)
    _feed(lossy, range(4), 10e6, 0.5, loss_every=10)        # 10% never arrive
    assert lossy.capacity == pytest.approx(lossless.capacity, rel=0.05)


def test_duplicates_and_late_packets_add_nothing():
    s = Share(1)
    for t in range(100):
        s.on_packet(0, 1000, t * 1e-3, t + 1)
        s.on_packet(0, 1000, t * 1e-3, t + 1)                # duplicate
        if t > 2:
            s.on_packet(0, 1000, t * 1e-3, t - 2)            # late
    assert s.capacity == pytest.approx(1e6, rel=0.15)


def test_a_batch_read_after_a_pause_does_not_set_the_capacity():
    s = Share(1)
    end = _feed(s, [0], 10e6, 1.0)
    for i in range(64):                        # a burst the socket buffer held: one instant
        s.on_packet(0, 9000, end + 0.011, 10 ** 6 + i)
    assert s.capacity == pytest.approx(10e6, rel=0.05)

