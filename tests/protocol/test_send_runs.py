"""The worker's send path for GSO transports (``WorkerEndpoint.poll_transmit`` with ``gso``):
the requests the kernels queue, cut into runs by ``kernels.plan_runs``, must be exactly the
datagrams that ``datagrams_to_send`` gives one by one, in the same order, and every run must be
one that the kernel's UDP_SEGMENT accepts. Results must be read right wherever a batch puts them."""

from __future__ import annotations

import numpy as np
import pytest

from switchml.protocol import kernels as K
from switchml.protocol.config import JobSpec
from switchml.protocol.endpoint import Batch, exchange
from switchml.protocol.events import OperationCompleted
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.worker import WorkerEndpoint

SA = ("switch", 1)
MAX_SEGMENTS, MAX_BYTES = 64, 65000


def _cut(runs) -> list[bytes]:
    """A GSO run's datagrams, as the kernel cuts them: ``size`` bytes each, the last of each
    buffer possibly shorter."""
    out = []
    for bufs, size, _addr in runs:
        data = b"".join(bytes(b) for b in bufs)
        out.extend(data[o:o + size] for o in range(0, len(data), size))
    return out


def _check_run_rules(runs) -> None:
    for bufs, size, _addr in runs:
        data = b"".join(bytes(b) for b in bufs)
        sizes = [len(data[o:o + size]) for o in range(0, len(data), size)]
        assert len(sizes) <= MAX_SEGMENTS and len(data) <= MAX_BYTES
        assert all(s == size for s in sizes[:-1]) and 0 < sizes[-1] <= size


class World:
    """A switch and n workers in memory; ``use_runs``: drain the workers and the switch with
    poll_transmit's GSO runs (else datagrams_to_send). Results are handed over as one batch
    per rank, as recvmmsg would."""

    def __init__(self, n: int, k: int, window: int, use_runs: bool) -> None:
        self.sw = SwitchDataplane()
        spec = JobSpec(job_id=3, token=4, num_workers=n, window=window, elements_per_packet=k)
        self.addrs = [(f"w{r}", 5) for r in range(n)]
        self.ws = [WorkerEndpoint(spec=spec, rank=r, switch_address=SA) for r in range(n)]
        self.use_runs = use_runs
        for r, w in enumerate(self.ws):
            w.join(0.0)
            self.up(r, w.datagrams_to_send(0.0))
            self.down()  # CHALLENGE
            self.up(r, w.datagrams_to_send(0.0))
        self.down()

    def drain(self, r: int) -> list[bytes]:
        w = self.ws[r]
        if not self.use_runs:
            return [bytes(d) for d, _ in w.datagrams_to_send(0.0)]
        tx = w.poll_transmit(0.0, gso=(MAX_SEGMENTS, MAX_BYTES))
        assert not tx.groups and tx.compiled is None
        _check_run_rules(tx.runs)
        return [bytes(d) for d, _ in tx.datagrams] + _cut(tx.runs)

    def up(self, r: int, datagrams) -> None:
        for d in datagrams:
            self.sw.receive_datagram(bytes(d[0] if isinstance(d, tuple) else d),
                                     self.addrs[r], 0.0)

    def down(self) -> None:
        """The switch's output to each rank: one datagram at a time, or (``use_runs``) its
        ``poll_transmit`` with GSO runs, cut as the kernel cuts them."""
        per: dict[int, list[bytes]] = {}
        if self.use_runs:
            tx = self.sw.poll_transmit(0.0, gso=(MAX_SEGMENTS, MAX_BYTES))
            assert not tx.groups and tx.compiled is None
            _check_run_rules(tx.runs)
            pairs = [(bytes(d), addr) for d, addr in tx.datagrams]
            pairs += [(d, run[2]) for run in tx.runs for d in _cut([run])]
        else:
            pairs = [(bytes(d), addr) for d, addr in self.sw.datagrams_to_send(0.0)]
        for d, addr in pairs:
            per.setdefault(self.addrs.index(addr), []).append(d)
        for r, ds in per.items():
            lens = np.array([len(d) for d in ds], np.int64)
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
            buf = np.frombuffer(bytearray(b"".join(ds)), np.uint8)
            self.ws[r].receive_many(Batch(buf, starts, lens, np.zeros(len(ds), np.int64),
                                          len(ds), lambda _k: SA), 0.0)


@pytest.mark.parametrize("k,window,numel", [(64, 8, 5000), (16, 4, 37), (358, 128, 100_000)])
def test_gso_runs_carry_exactly_the_datagrams_sent_one_by_one(k, window, numel):
    rng = np.random.default_rng(k)
    xs = [rng.standard_normal(numel).astype(np.float32) for _ in range(2)]
    worlds = [World(2, k, window, use_runs) for use_runs in (False, True)]
    outs = [[np.zeros(numel, np.float32) for _ in range(2)] for _ in worlds]
    for wd, o in zip(worlds, outs):
        for r in range(2):
            wd.ws[r].start_allreduce(xs[r], o[r], 0.0)
    sent = 0
    for _ in range(10_000):
        moved = False
        for r in range(2):
            plain, gso = worlds[0].drain(r), worlds[1].drain(r)
            assert gso == plain  # the same bytes, in the same order
            sent += len(gso)
            moved |= bool(plain)
            worlds[0].up(r, plain)
            worlds[1].up(r, gso)
        worlds[0].down()
        worlds[1].down()
        if not moved:
            break
    assert sent > 2 * (-(-numel // k))
    expected = xs[0].astype(np.float64) + xs[1]
    for wd, o in zip(worlds, outs):
        assert any(isinstance(e, OperationCompleted)
                   for e in iter(wd.ws[0].next_event, None))
        np.testing.assert_allclose(o[0], expected, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(o[0], o[1])
    np.testing.assert_array_equal(outs[0][0], outs[1][0])


def _plan(lanes, lens, stride, shards=1, max_segments=64, max_bytes=65000):
    q = np.array(lanes, np.int64)
    sendlen = np.zeros(max(lanes) + 1, np.int64)
    for i, n in zip(lanes, lens):
        sendlen[i] = n
    order = np.empty(len(q), np.int64)
    runs = np.empty((len(q), 5), np.int64)
    nr = K.plan_runs(q, len(q), sendlen, stride, shards, max_segments, max_bytes, order, runs)
    return [(q[order[a:a + c]].tolist(), size, bool(contig), shard)
            for a, c, size, contig, shard in runs[:nr].tolist()]


def test_plan_runs_cuts_at_gaps_short_segments_and_limits():
    # Consecutive full lanes are one contiguous run; a gap makes the run gather (one system
    # call still); a short datagram ends its run; the segment limit cuts a long one.
    assert _plan([3, 4, 5], [100] * 3, stride=100) == [([3, 4, 5], 100, True, 0)]
    assert _plan([3, 4, 5, 9, 10, 11, 0], [100] * 5 + [60, 100], stride=100) == [
        ([3, 4, 5, 9, 10, 11], 100, False, 0), ([0], 100, True, 0)]
    assert _plan([7, 8, 9, 0, 1], [100] * 5, stride=100) == [([7, 8, 9, 0, 1], 100, False, 0)]
    assert _plan(list(range(7)), [100] * 7, stride=100, max_segments=3) == [
        ([0, 1, 2], 100, True, 0), ([3, 4, 5], 100, True, 0), ([6], 100, True, 0)]
    assert _plan(list(range(5)), [100] * 5, stride=100, max_bytes=250) == [
        ([0, 1], 100, True, 0), ([2, 3], 100, True, 0), ([4], 100, True, 0)]
    # Header-only datagrams (shorter than a row) gather from rows that are not adjacent.
    assert _plan([0, 1, 2], [40, 40, 40], stride=100) == [([0, 1, 2], 40, False, 0)]
    # Shards: lane i goes to shard i mod 2, each in queue order.
    assert _plan([0, 1, 2, 3, 4], [100] * 5, stride=100, shards=2) == [
        ([0, 2, 4], 100, False, 0), ([1, 3], 100, False, 1)]


def test_results_at_odd_offsets_are_read_as_aligned_ones():
    """A batch that puts results at odd offsets (an in-memory batch of mixed sizes) gives the
    worker exactly what aligned ones give."""
    spec = JobSpec(job_id=5, token=6, num_workers=1, window=4, elements_per_packet=16)
    for bits, dtype in ((32, np.float32), (16, np.float32), (32, np.int32)):
        outs = []
        for shift in (0, 1, 3):
            sw = SwitchDataplane()
            w = WorkerEndpoint(spec=spec, rank=0, switch_address=SA)
            w.join(0.0)
            exchange({("w", 2): w, SA: sw}, 0.0)
            x = (np.arange(200) - 77).astype(dtype) * (3 if dtype == np.int32 else 0.37)
            out = np.zeros_like(x)
            w.start_allreduce(x, out, 0.0, bits=bits)
            for _ in range(1000):
                for d, _ in w.datagrams_to_send(0.0):
                    sw.receive_datagram(bytes(d), ("w", 2), 0.0)
                res = [bytes(d) for d, _ in sw.datagrams_to_send(0.0)]
                if not res:
                    break
                starts, blob = [], bytearray(b"\x00" * shift)
                for d in res:
                    starts.append(len(blob))
                    blob += d + b"\x00" * shift
                lens = np.array([len(d) for d in res], np.int64)
                w.receive_many(Batch(np.frombuffer(blob, np.uint8), np.array(starts, np.int64),
                                     lens, np.zeros(len(res), np.int64), len(res),
                                     lambda _k: SA), 0.0)
            assert any(isinstance(e, OperationCompleted) for e in iter(w.next_event, None))
            outs.append(out)
        if dtype == np.int32:
            np.testing.assert_array_equal(outs[0], x)
        else:
            # 16 bits: about 15 bits of the block max (|x| < 64 here: a quantum of 2**-9)
            np.testing.assert_allclose(outs[0], x, rtol=0, atol=2.0**-9 if bits == 16 else 1e-5)
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])
