"""The worker's compiled data plane (``switchml._worker``, from ``src/switchml/csrc/worker.c``)
against its plain-Python reference (``protocol/kernels/stream.py``, ``numerics.py``,
``timers.py``), rule for rule.

* The numerics (block exponents, quantization, dequantization, residuals) on random arrays
  with NaN, Inf, subnormals, zeros and values at the types' edges: bit for bit.
* The results kernel on crafted batches: real RESULT datagrams of an operation, then copies
  with flipped bits, cut short, of another job, repeated, out of order, and NACKs: every array
  of the operation's state, the counters and what it returns, equal after each batch.
* Whole jobs over the in-memory fabric with loss, duplication and reordering, once on the
  compiled kernels and once on the reference (the same seed): the same results, residuals,
  counters and every datagram on the fabric, byte for byte.
* The layout header the C source is compiled with is what ``kernels/layout.py`` makes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from switchml import _worker as C
from switchml.protocol import kernels as K
from switchml.protocol.config import JobSpec, WorkerConfig
from switchml.protocol.dtypes import BFLOAT16, kernel_view
from switchml.protocol.endpoint import exchange
from switchml.protocol.kernels import frames, layout, numerics, runs, stream, timers
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import MessageType
from switchml.protocol.worker import WorkerEndpoint
from switchml.transport.memory import FaultModel, MemoryCluster, MemoryFabric


class RefState(NamedTuple):
    """The reference's hand-off: the arrays ``C.OpState`` holds, by name."""

    opv: np.ndarray
    lane: np.ndarray
    lanef: np.ndarray
    rtt: np.ndarray
    next_set: np.ndarray
    exps: np.ndarray
    nonf: np.ndarray
    x: np.ndarray
    xbits: np.ndarray
    out: np.ndarray
    res: np.ndarray
    tx8: np.ndarray
    tx16: np.ndarray
    tx32: np.ndarray
    cnt: np.ndarray
    sendq: np.ndarray
    sendlen: np.ndarray
    picked: np.ndarray
    order: np.ndarray
    runs: np.ndarray
    stride: int
    keep: np.ndarray | None
    contrib: np.ndarray | None


def _sending(st):  # the arrays a send takes: opv .. xbits, res, tx8 .. cnt
    return (*st[:9], st.res, *st[11:15])


def _typed(arrays):
    """The reference takes bfloat16 as ml_dtypes' type, where the C takes its bits (uint16):
    x, out and keep viewed so (xbits stays the bits)."""
    arrays = list(arrays)
    for i in (7, 9, 21):
        a = arrays[i]
        if a is not None and a.dtype == np.uint16:
            arrays[i] = a.view(BFLOAT16)
    return arrays


def _ref_state(*arrays):
    return RefState(*_typed(arrays))


REFERENCE = {
    "OpState": _ref_state,
    "worker_results": lambda st, d, starts, lens, nseg, start, limit, now: (
        stream.worker_results(d, starts, lens, nseg, start, limit, now, *st[:17],
                              np.empty(st.stride, np.uint8), keep=st.keep,
                              contrib=st.contrib)),
    "send_first": lambda st, count, now: stream.send_first(count, now, *_sending(st),
                                                           st.sendq, st.sendlen, keep=st.keep),
    "send_chunk": lambda st, p, retransmit, fast, now: stream.send_chunk(
        p, retransmit, fast, now, *_sending(st), st.sendlen, keep=st.keep),
    "take_nack": lambda st, chunk, slot, now: stream.take_nack(chunk, slot, now, st.opv,
                                                               st.lane, st.lanef, st.rtt, st.cnt),
    "mark_nack_resend": lambda st, i, p, chunk: stream.mark_nack_resend(i, p, chunk, st.opv,
                                                                        st.lane, st.tx8),
    "fire_timers": lambda st, now: timers.fire_timers(now, *_sending(st), st.sendq,
                                                      st.sendlen, st.picked, keep=st.keep),
    "next_deadline": lambda st: timers.next_deadline(st.lane, st.lanef, st.rtt),
    "plan_runs": runs.plan_runs,
    "probe_time": timers.probe_time, "block_exponents": numerics.block_exponents,
    "quantize_block": numerics.quantize_block, "dequantize_block": numerics.dequantize_block,
    "residual_block": numerics.residual_block,
    "first_foreign": frames.first_foreign,
}


def test_every_worker_kernel_the_package_exports_is_the_compiled_one():  # (and OpState)
    for name in REFERENCE:
        assert getattr(K, name) is getattr(C, name), name


def test_the_layout_header_is_generated_from_the_tables():
    header = Path(__file__).resolve().parents[2] / "src" / "switchml" / "csrc" / "layout.h"
    assert header.read_text() == layout.c_header()


# -- numerics --------------------------------------------------------------------------------

def _nasty(rng: np.random.Generator, n: int, dtype) -> np.ndarray:
    info = np.finfo(dtype)
    with np.errstate(over="ignore"):  # (float16: the largest overflow, to inf)
        x = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(dtype)
    picks = rng.integers(0, 10, n)
    x[picks == 0] = 0
    x[picks == 1] = info.max * rng.choice([-1, 1], (picks == 1).sum())
    x[picks == 2] = info.smallest_subnormal * rng.integers(1, 50, (picks == 2).sum())
    x[picks == 3] = info.tiny
    return x


HALVES_TOO = [np.float32, np.float64, np.float16, BFLOAT16]


@pytest.mark.parametrize("dtype", HALVES_TOO, ids=str)
@pytest.mark.parametrize("seed", range(6))
def test_block_exponents_match_the_reference(dtype, seed):
    rng = np.random.default_rng(seed)
    x = _nasty(rng, 997, dtype)
    if seed % 2:
        x[rng.integers(0, x.size, 3)] = [np.nan, np.inf, -np.inf]
    if seed == 4:
        x[:] = 0
    k = int(rng.integers(1, 64))
    nb = -(-x.size // k)
    got = (np.empty(nb, np.int64), np.empty(nb, np.uint8))
    want = (np.empty(nb, np.int64), np.empty(nb, np.uint8))
    C.block_exponents(kernel_view(x), k, *got)
    numerics.block_exponents(x, k, *want)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.parametrize("dtype", HALVES_TOO, ids=str)
@pytest.mark.parametrize("qtype", ["<i4", "<i2"])
@pytest.mark.parametrize("seed", range(4))
def test_quantize_dequantize_and_residual_match_the_reference_bit_for_bit(dtype, qtype, seed):
    rng = np.random.default_rng(seed)
    n_workers = int(rng.integers(1, 20))
    bits = 32 if qtype == "<i4" else 16
    p = bits - 1 - n_workers.bit_length()
    x = (rng.standard_normal(500) * 3).astype(dtype)
    nonfinite = seed % 2 == 1
    if nonfinite:
        x[[3, 77]] = [np.nan, np.inf]
    emax = int(np.frexp(np.max(np.abs(x[np.isfinite(x)])))[1])
    big = (1000 + p) if dtype == np.float64 else 120  # float64: a shift past 1000 (ldexp)
    for e in (emax, emax + 3, frames.EXP_ZERO, big, 1023, 127):
        got, want = np.empty(x.size, qtype), np.empty(x.size, qtype)
        if e == emax + 1500 and nonfinite:
            continue
        C.quantize_block(kernel_view(x), e, p, nonfinite, got)
        numerics.quantize_block(x, e, p, nonfinite, want)
        assert np.array_equal(got, want), e
        for out_type in HALVES_TOO:
            info = np.finfo(out_type)
            at_edge = e != frames.EXP_ZERO and e + n_workers.bit_length() >= info.maxexp
            for edge in {False, at_edge}:
                a, b = np.empty(x.size, out_type), np.empty(x.size, out_type)
                C.dequantize_block(got, e, p, nonfinite, kernel_view(a), n_workers, edge,
                                   float(info.max))
                numerics.dequantize_block(got, e, p, nonfinite, b, n_workers, edge,
                                          float(info.max))
                assert a.tobytes() == b.tobytes(), (e, out_type, edge)
            if np.dtype(out_type).itemsize == 2:
                continue  # residuals are float32 or float64
            ra, rb = np.empty(x.size, out_type), np.empty(x.size, out_type)
            C.residual_block(kernel_view(x), got, e, p, ra)
            numerics.residual_block(x, got, e, p, rb)
            assert ra.tobytes() == rb.tobytes(), (e, out_type)


def test_wrong_arrays_are_refused_with_a_message():
    with pytest.raises(TypeError, match="x has elements of int64"):
        C.quantize_block(np.zeros(4, np.int64), 0, 20, False, np.empty(4, np.int32))
    with pytest.raises(ValueError, match="out's size"):
        C.quantize_block(np.zeros(4, np.float32), 0, 20, False, np.empty(3, np.int32))
    with pytest.raises(TypeError, match="C-contiguous"):
        C.quantize_block(np.zeros(8, np.float32)[::2], 0, 20, False, np.empty(4, np.int32))
    with pytest.raises(TypeError, match="takes 9 arguments"):
        C.plan_runs(1, 2)


# -- the results kernel on crafted batches ---------------------------------------------------

def _operation(dtype=np.float32, bits=32, residual=False, size=700, seed=0, inplace=False,
                quorum=False):
    """A joined worker with an operation in flight (its first window sent), the switch, and
    the RESULT datagrams that answer every rank of a 1-rank job. ``inplace``: the output is
    the input (the kernels keep each input block as they send it). ``quorum``: a job of 2
    ranks with a quorum of 1 instead (its results carry a contributor bitmap)."""
    spec = JobSpec(job_id=5, token=0x1234_5678_9ABC, num_workers=2 if quorum else 1, window=4,
                   elements_per_packet=32, quorum=1 if quorum else None)
    sw, w_addr, sw_addr = SwitchDataplane(), ("127.0.0.1", 1), ("127.0.0.1", 2)
    w = WorkerEndpoint(spec=spec, rank=0, switch_address=sw_addr)
    w.join(0.0)
    exchange({w_addr: w, sw_addr: sw}, 0.0)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(size) * 10).astype(dtype)
    res = np.zeros(size, np.float32 if x.itemsize == 2 else dtype) if residual else None
    w.start_allreduce(x, x if inplace else np.empty_like(x), 0.0, bits=bits, residual=res)
    results = []
    for data, _ in w.datagrams_to_send(0.0):
        sw.receive_datagram(bytes(data), w_addr, 0.001)
        results += [bytes(d) for d, _ in sw.datagrams_to_send(0.001)]
    return w, results


def _state(w):
    """The operation's arrays, as ``OpState`` takes them."""
    op, rec = w._op, w.recovery
    return [op.opv, op.lane, op.lanef, rec.rtt, w._next_set, op.exps, op.nonf, op.xk,
            op.xbits, op.outk, op.res, op.tx8, op.tx16, op.tx32, w._cnt, op.sendq, op.sendlen,
            op.picked, op.run_order, op.runs, op.stride,
            None if op.keep is None else kernel_view(op.keep), op.contrib]


def _copy(state):
    """Copies of the arrays, the int16 and int32 views sharing the byte buffer again; a
    ``C.OpState`` over them and the reference's ``RefState``."""
    arrays = [a.copy() for a in state[:20]] + [state[20]]
    arrays.append(None if state[21] is None else state[21].copy())
    arrays.append(None if state[22] is None else state[22].copy())
    tx8 = arrays[11]
    arrays[12], arrays[13] = tx8.view(np.int16), tx8.view(np.int32)
    if state[9] is state[7]:  # in place: out is x
        arrays[9] = arrays[7]
    return arrays


def test_a_failed_sharded_send_keeps_every_unsent_lane_once():
    # With shards the planned order is not the queue's (lanes by shard: 1, 3 to shard 1 and
    # 0 to shard 0 come out as 0, 1, 3): a failed sendmsg (a bad socket here; a full buffer on
    # a real link) must leave each queued lane queued once. Rebuilt in place, lane 1 was lost
    # and lane 0 left twice.
    w, _ = _operation(np.float32, 32, False)
    state = _copy(_state(w))
    st = C.OpState(*state)
    opv, sendq = state[0], state[15]
    opv[K.OP.NQ] = 3
    sendq[:3] = [1, 0, 3]
    dests = np.zeros((2, 16), np.uint8)
    dests[:, 0] = 2  # AF_INET
    allowed = np.array([1, 2], np.int64)
    stats = np.zeros(layout.ST.N, np.int64)
    assert C.send_queued(st, -1, 16, 60_000, stats, dests, allowed) is False
    assert stats[layout.ST.ERRNO] != 0
    assert opv[K.OP.NQ] == 3 and sorted(sendq[:3].tolist()) == [0, 1, 3]


def _mutations(results: list[bytes], rng: np.random.Generator) -> list[bytes]:
    out = []
    for d in results:
        b = bytearray(d)
        kind = int(rng.integers(0, 8))
        if kind == 0:
            b[int(rng.integers(0, len(b)))] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:
            b = b[:int(rng.integers(0, len(b)))]
        elif kind == 2:
            b[8] ^= 0xFF  # another job
        elif kind == 3:
            b[3] = 6  # a NACK's type on a result's body
        elif kind == 4:
            b = b[:40]
            b[3], b[4], b[32], b[33] = 6, 0, 0, 0  # a well-formed NACK of this chunk
        elif kind == 5:
            b[-1] ^= 1  # a quorum result without this rank (or a payload bit: elsewhere)
        elif kind == 6:
            b[39] = 0x80  # a look-ahead exponent far below this rank's (clamps its data)
        out.append(bytes(b))
    return out


def _batch(datagrams: list[bytes]):
    buf = np.frombuffer(b"".join(datagrams) or b"\0", np.uint8).copy()
    lens = np.array([len(d) for d in datagrams], np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    return buf, starts, lens


@pytest.mark.parametrize("kind", [(np.float32, 32, False), (np.float64, 32, False),
                                  (np.int32, 32, False), (np.float32, 16, True),
                                  (np.float64, 16, True), (np.float32, 16, False),
                                  (np.float16, 32, False), (np.float16, 16, True),
                                  (BFLOAT16, 32, False), (BFLOAT16, 16, True)],
                         ids=lambda k: f"{np.dtype(k[0]).name}/{k[1]}/{int(k[2])}")
@pytest.mark.parametrize("inplace", [False, True, "quorum"], ids=["apart", "inplace", "quorum"])
@pytest.mark.parametrize("seed", range(4))
def test_results_kernel_matches_the_reference_on_hostile_batches(kind, inplace, seed):
    dtype, bits, residual = kind
    quorum = inplace == "quorum"
    w, results = _operation(dtype, bits, residual, seed=seed, inplace=inplace is True,
                            quorum=quorum)
    rng = np.random.default_rng(100 + seed)
    state = _state(w)
    assert (state[21] is not None) == (inplace is True)
    assert (state[22] is not None) == quorum
    mine, ref = _copy(state), _copy(state)
    cstate, rstate = C.OpState(*mine), _ref_state(*ref)
    now = 0.002
    batches = [results, _mutations(results, rng), results[::-1] + results,
               _mutations(results[::-1], rng)]
    for datagrams in batches:
        buf, starts, lens = _batch(datagrams)
        i = 0
        while i < len(datagrams):
            got = C.worker_results(cstate, buf, starts, lens, len(datagrams), i,
                                   len(datagrams) + 1, now)
            want = REFERENCE["worker_results"](rstate, buf, starts, lens, len(datagrams), i,
                                               len(datagrams) + 1, now)
            assert tuple(got) == tuple(want)
            for a, b, name in zip(mine[:17] + mine[21:], ref[:17] + ref[21:], range(23)):
                assert (a is None) == (b is None), name
                assert a is None or a.tobytes() == b.tobytes(), f"array {name} differs"
            nxt, code = got
            if code == K.WS.FULL:
                for s in (mine, ref):
                    s[0][K.OP.NQ] = 0
            i = nxt + (1 if code in (K.WS.OTHER,) else 0)
            if code == K.WS.OP_COMPLETE:
                i = nxt
        now += 0.001


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BFLOAT16], ids=str)
@pytest.mark.parametrize("bits", [32, 16])
def test_a_rank_left_out_of_a_quorum_round_sends_its_block_clamped(dtype, bits):
    """Rank 0 of a 2-rank job with a quorum of 1 gets its first window's results as rank 1
    made them: without rank 0 (the bitmap) and with a look-ahead exponent 3 below rank 0's.
    Its next chunks carry its blocks scaled to the agreed exponent, each element clamped to
    +-(2**P - 1) (computed here with numpy), so the switch's sum cannot overflow; compiled
    and reference kernels agree, count the results left out and the blocks clamped, and note
    one contributor per block."""
    w, results = _operation(dtype, bits, seed=3, quorum=True)
    agreed = []
    crafted = []
    for d in results:
        b = bytearray(d)
        assert b[4] & 0x10 and b[-1] == 0b01  # a quorum result: rank 0 alone
        b[-1] = 0b10  # only rank 1 is in
        exp_next = int.from_bytes(b[38:40], "little", signed=True) - 3
        b[38:40] = exp_next.to_bytes(2, "little", signed=True)
        agreed.append(exp_next)
        crafted.append(bytes(b))
    state = _state(w)
    mine, ref = _copy(state), _copy(state)
    cstate, rstate = C.OpState(*mine), _ref_state(*ref)
    buf, starts, lens = _batch(crafted)
    got = C.worker_results(cstate, buf, starts, lens, len(crafted), 0, 99, 0.002)
    want = REFERENCE["worker_results"](rstate, buf, starts, lens, len(crafted), 0, 99, 0.002)
    assert tuple(got) == tuple(want)
    for a, b in zip(mine[:17] + mine[21:], ref[:17] + ref[21:]):
        assert (a is None) == (b is None) and (a is None or a.tobytes() == b.tobytes())
    cnt, opv = mine[14], mine[0]
    assert cnt[K.WC.LEFT_OUT] == len(crafted) == 4
    assert cnt[K.WC.CLAMPED] == 4  # every block's own exponent is above the agreed one
    # The released chunks 4..7 hold blocks 0..3, each scaled to its agreed exponent.
    x = np.asarray(w._op.x, np.float64)
    k, P = int(opv[K.OP.K]), int(opv[K.OP.P])
    lim = 2.0 ** P - 1
    qtype = np.int32 if bits == 32 else np.int16
    for blk, e in enumerate(agreed):
        row = mine[11][blk * int(state[20]):(blk + 1) * int(state[20])]
        assert int.from_bytes(bytes(row[24:28]), "little") == blk + 4  # the chunk
        sent = np.frombuffer(bytes(row[40:40 + k * qtype().itemsize]), qtype)
        want_q = np.clip(np.rint(np.ldexp(x[blk * k:(blk + 1) * k], P - e)), -lim, lim)
        assert np.array_equal(sent, want_q.astype(qtype))
        assert (np.abs(sent) == lim).any()  # something was clamped
    assert list(mine[22][:4]) == [0, 0, 0, 0]  # the first window held exponents only


@pytest.mark.parametrize("seed", range(3))
def test_timers_and_nacks_match_the_reference(seed):
    w, _ = _operation(np.float32, 32, False, seed=seed)
    state = _state(w)
    mine, ref = _copy(state), _copy(state)
    cstate, rstate = C.OpState(*mine), _ref_state(*ref)
    rng = np.random.default_rng(seed)
    for a in (mine, ref):
        a[3][K.R.SRTT], a[3][K.R.MIN_RTT], a[3][K.R.PROBED_AT] = 0.01, 0.008, 0.0
        a[0][K.OP.NQ] = 0
    for step in range(12):
        now = 0.05 * (step + 1)
        assert C.fire_timers(cstate, now) == REFERENCE["fire_timers"](rstate, now)
        assert C.next_deadline(cstate) == REFERENCE["next_deadline"](rstate)
        assert C.probe_time(mine[3]) == timers.probe_time(ref[3])
        chunk = int(rng.integers(0, 12))
        slot = int(mine[1][K.LN.SLOT, chunk % int(mine[0][K.OP.E])]) + int(rng.integers(0, 2))
        pa = C.take_nack(cstate, chunk, slot, now)
        pb = REFERENCE["take_nack"](rstate, chunk, slot, now)
        assert pa == pb
        if pa >= 0:
            ia = C.send_chunk(cstate, pa, True, True, now)
            ib = REFERENCE["send_chunk"](rstate, pb, True, True, now)
            assert ia == ib
            C.mark_nack_resend(cstate, ia, pa, chunk)
            REFERENCE["mark_nack_resend"](rstate, ib, pb, chunk)
        for a, b in zip(mine[:17], ref[:17]):
            assert a.tobytes() == b.tobytes()
        for s in (mine, ref):
            s[0][K.OP.NQ] = 0


@pytest.mark.parametrize("seed", range(5))
def test_plan_runs_matches_the_reference(seed):
    rng = np.random.default_rng(seed)
    lanes, stride = 40, 1000
    nq = int(rng.integers(0, 100))
    sendq = rng.integers(0, lanes, nq).astype(np.int64)
    sendlen = np.where(rng.random(lanes) < 0.8, stride, rng.integers(41, stride, lanes))
    sendlen = sendlen.astype(np.int64)
    for shards in (1, 3):
        a = (np.empty(nq, np.int64), np.empty((nq, 5), np.int64))
        b = (np.empty(nq, np.int64), np.empty((nq, 5), np.int64))
        na = C.plan_runs(sendq, nq, sendlen, stride, shards, 16, 20_000, *a)
        nb = runs.plan_runs(sendq, nq, sendlen, stride, shards, 16, 20_000, *b)
        assert na == nb
        assert np.array_equal(a[0][:nq], b[0][:nq]) and np.array_equal(a[1][:na], b[1][:nb])


# -- whole jobs over the in-memory fabric ----------------------------------------------------

DATA_TYPES = {int(t) for t in (MessageType.REQUEST, MessageType.RESULT, MessageType.WAITING,
                                MessageType.NACK)}


class _Recording(MemoryFabric):
    """A fabric that hashes every data datagram it carries (REQUEST, RESULT, WAITING, NACK),
    in order. (Control messages carry random nonces.)"""

    def _transmit(self, src, dst, payload, t):
        if len(payload) > 3 and payload[3] in DATA_TYPES:
            self.digest.update(repr((src, dst)).encode() + bytes(payload))
        return super()._transmit(src, dst, payload, t)


def _job(kind, seed: int) -> tuple:
    dtype, bits, residual = kind
    fabric = _Recording(FaultModel(loss_rate=0.05, duplicate_rate=0.02, reorder_rate=0.1,
                                   latency_s=1e-4, jitter_s=5e-5), seed)
    fabric.digest = hashlib.sha256()
    config = WorkerConfig(initial_rto_s=0.01, max_rto_s=0.05, fast_retransmit=seed % 2 == 1)
    c = MemoryCluster(num_workers=3, window=4, elements_per_packet=64, seed=seed,
                      fabric=fabric, worker_config=config)
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal(1500) * 5).astype(dtype) for _ in range(3)]
    outs = [np.empty_like(x) for x in xs]
    res = ([np.zeros(x.size, np.float32 if x.itemsize == 2 else x.dtype) for x in xs]
           if residual else None)
    for _ in range(2):
        c.wait(c.start(xs, outs, bits=bits, residuals=res))
    return ([o.tobytes() for o in outs], [r.tobytes() for r in res or []],
            [dict(w.counters) for w in c.workers], [dict(w.drops) for w in c.workers],
            fabric.digest.hexdigest())


@pytest.mark.parametrize("kind", [(np.float32, 32, False), (np.int32, 32, False),
                                  (np.float64, 16, True), (np.float16, 32, False),
                                  (BFLOAT16, 16, True)],
                         ids=lambda k: f"{np.dtype(k[0]).name}/{k[1]}/{int(k[2])}")
@pytest.mark.parametrize("seed", [1, 2])
def test_jobs_under_loss_run_identically_on_the_compiled_kernels_and_the_reference(
        kind, seed, monkeypatch):
    compiled = _job(kind, seed)
    for name, f in REFERENCE.items():
        monkeypatch.setattr(K, name, f)
    reference = _job(kind, seed)
    assert compiled[0] == reference[0]  # results
    assert compiled[1] == reference[1]  # residuals
    assert compiled[2] == reference[2]  # counters
    assert compiled[3] == reference[3]  # drops
    assert compiled[4] == reference[4]  # every datagram on the fabric
    assert sum(c["retransmissions"] for c in compiled[2]) > 0  # (loss was recovered)


def test_inconsistent_state_is_refused_not_written_past():
    """A review's crashes, each now a ValueError: an operation whose packet count disagrees
    with its blocks and lanes (a negative copy size followed), a send queue naming lanes the
    operation lacks, and a receive batch's field offsets before its rows."""
    w, _ = _operation(np.float32, 32, False)
    state = _copy(_state(w))
    state[0][K.OP.T] += 50
    with pytest.raises(ValueError, match="disagree"):
        C.OpState(*state)
    state[0][K.OP.T] -= 50
    st = C.OpState(*state)
    state[0][K.OP.NQ] = len(state[15]) + 1
    no_shards = (np.zeros((0, 16), np.uint8), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="send queue"):
        C.send_queued(st, -1, 16, 60_000, np.zeros(layout.ST.N, np.int64), *no_shards)
    state[0][K.OP.NQ] = 0  # a sharded switch's addresses: one sender number per 16-byte row
    for dests, allowed in ((np.zeros((2, 16), np.uint8), np.zeros(1, np.int64)),
                           (np.zeros((2, 8), np.uint8), np.zeros(2, np.int64)),
                           (np.zeros((1, 16), np.uint8), np.zeros(1, np.int64))):
        with pytest.raises(ValueError, match="dests must be 16-byte sockaddr_in rows"):
            C.send_queued(st, -1, 16, 60_000, np.zeros(layout.ST.N, np.int64), dests, allowed)
    msgs, names, control = (np.zeros((4, 64), np.uint8), np.zeros((4, 16), np.uint8),
                            np.zeros((4, 32), np.uint8))
    out = np.zeros(8, np.int64)
    with pytest.raises(ValueError, match="offsets"):
        C.split_mmsg(msgs, 0, -1_000_000, names, control, 1, 2048, 1, 17, 104, out, out.copy(),
                     out.copy())
