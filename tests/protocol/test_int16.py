"""16-bit fixed point: the switch sums INT16 payloads; workers quantize and keep residuals."""

from __future__ import annotations

import numpy as np
import pytest
from test_switch import join

from switchml.protocol.config import JobSpec
from switchml.protocol.endpoint import exchange
from switchml.protocol.errors import LocalProtocolError
from switchml.protocol.quantize import block_exponent, error_bound, scale_bits
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import (
    ControlInfo,
    ElementType,
    Flags,
    Header,
    MessageType,
    pack_header,
    unpack_header,
    unpack_mismatch,
    unpack_payload,
)
from switchml.protocol.worker import WorkerEndpoint
from switchml.transport.memory import FaultModel, MemoryCluster

TOKEN = 99


def _join(sw: SwitchDataplane, n: int, k: int) -> None:
    for r in range(n):
        (o,) = join(sw, 1, TOKEN, r, ControlInfo(n, 2, k), ("w", r))
        assert o.header.type is MessageType.JOINED


def _req(rank: int, values: list[int], *, elem=ElementType.INT16, chunk=0) -> bytes:
    dt = "<i2" if elem is ElementType.INT16 else "<i4"
    payload = np.array(values, dtype=dt).tobytes()
    h = Header(MessageType.REQUEST, 1, rank=rank, token=TOKEN, seq=0, chunk=chunk, slot=0,
               count=len(values), elem=elem, flags=int(Flags.HAS_DATA))
    return pack_header(h) + payload


def test_switch_sums_int16_payloads_and_answers_in_int16():
    sw = SwitchDataplane()
    _join(sw, 2, k=4)
    sw.receive_datagram(_req(0, [1, -2, 3000, 7, 1, 1, 1, 1]), ("w", 0), 0)
    assert sw.datagrams_to_send(0) == []
    sw.receive_datagram(_req(1, [10, 20, -3000, 1, 1, 1, 1, 2]), ("w", 1), 0)
    out = sw.datagrams_to_send(0)
    assert len(out) == 2
    h = unpack_header(bytes(out[0][0]))
    assert h.elem is ElementType.INT16 and h.count == 8
    assert unpack_payload(bytes(out[0][0]), h).tolist() == [11, 18, 0, 8, 2, 2, 2, 3]


def test_int16_payload_may_hold_twice_the_int32_elements_but_no_more():
    sw = SwitchDataplane()
    _join(sw, 1, k=4)  # 16 bytes per slot: 8 int16
    sw.receive_datagram(_req(0, list(range(9))), ("w", 0), 0)
    assert sw.datagrams_to_send(0) == []
    assert sw.drops["bad_payload"] == 1


def test_mixed_widths_in_one_round_are_inconsistent():
    sw = SwitchDataplane()
    _join(sw, 2, k=4)
    sw.receive_datagram(_req(0, [1, 2]), ("w", 0), 0)
    sw.receive_datagram(_req(1, [1, 2], elem=ElementType.INT32), ("w", 1), 0)
    (reply, addr), (_, contributor) = sw.datagrams_to_send(0)  # the refused rank, rank 0
    assert contributor == ("w", 0)
    h = unpack_header(reply)
    assert (h.type, addr) == (MessageType.MISMATCH, ("w", 1))
    m = unpack_mismatch(unpack_payload(reply, h))
    assert (m.theirs.elem, m.mine.elem) == (ElementType.INT16, ElementType.INT32)
    assert sw.drops["inconsistent_chunk"] == 1


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_16_bit_allreduce_within_its_bound_and_residual_accounts_for_the_rest(n):
    rng = np.random.default_rng(n)
    k = 64
    c = MemoryCluster(num_workers=n, elements_per_packet=k, window=4,
                      faults=FaultModel(loss_rate=0.05, reorder_rate=0.1), seed=n)
    c.join()
    xs = [(rng.standard_normal(1000) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
          for _ in range(n)]
    outs = [np.empty_like(x) for x in xs]
    residuals = [np.full_like(x, np.nan) for x in xs]
    c.wait(c.start(xs, outs, bits=16, residuals=residuals))
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
    block = 2 * k  # 16-bit elements per packet
    for b in range(0, ref.size, block):
        emax = max(block_exponent(x[b:b + block])[0] for x in xs)
        tol = error_bound(emax, n, bits=16) + np.spacing(np.float32(np.abs(ref[b:b + block]).max()))
        assert np.max(np.abs(outs[0][b:b + block] - ref[b:b + block])) <= tol
        # a residual is at most half a 16-bit quantum of its block
        quantum = 2.0 ** (emax - scale_bits(n, 16))
        assert np.all(np.abs(np.stack(residuals)[:, b:b + block]) <= 0.5 * quantum * 1.0001)
    # what was sent (x - residual) sums exactly to the result
    sent = np.sum([x.astype(np.float64) - r for x, r in zip(xs, residuals)], axis=0)
    assert np.allclose(sent, outs[0], rtol=0, atol=np.spacing(np.abs(ref).max()) * 2)
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])
    # 16-bit chunks carry twice the elements: about half the packets of a 32-bit operation
    sent16 = c.workers[0].counters["packets_sent"] - c.workers[0].counters["retransmissions"]
    assert sent16 <= -(-1000 // block) + 4 + 1


def test_16_bit_is_refused_for_integers_and_bad_residuals():
    w = WorkerEndpoint(spec=JobSpec(job_id=1, token=2, num_workers=1), rank=0,
                       switch_address=("s", 1))
    w.join(0.0)
    exchange({("w", 0): w, ("s", 1): SwitchDataplane()}, 0.0)
    x = np.ones(10, np.int32)
    with pytest.raises(LocalProtocolError, match="bits=16 is for float data"):
        w.start_allreduce(x, x, 0.0, bits=16)
    f = np.ones(10, np.float32)
    with pytest.raises(LocalProtocolError, match="bits must be 32 or 16"):
        w.start_allreduce(f, f, 0.0, bits=8)
    with pytest.raises(LocalProtocolError, match="residual must be"):
        w.start_allreduce(f, f, 0.0, residual=np.ones(3, np.float32))
    with pytest.raises(LocalProtocolError, match="must not share memory with data or out"):
        w.start_allreduce(f, np.empty_like(f), 0.0, bits=16, residual=f)
    with pytest.raises(LocalProtocolError, match="must not share memory with data or out"):
        o = np.empty_like(f)
        w.start_allreduce(f, o, 0.0, bits=16, residual=o)
    assert w.start_allreduce(f, f, 0.0, bits=16, residual=np.zeros(10, np.float32)) == 0


@pytest.mark.parametrize("x_type,res_type", [(np.float32, np.float32), (np.float32, np.float64),
                                             (np.float64, np.float64), (np.float64, np.float32),
                                             (np.float16, np.float32)])
def test_the_residual_is_what_rounding_took_in_any_float_type(x_type, res_type):
    # One worker: the switch's sum is its own quantized input, so x = result + residual, to
    # the residual's own rounding; whichever float types the input and residual have (the
    # kernels write a float32 input's residual in float32, others are staged).
    rng = np.random.default_rng(7)
    c = MemoryCluster(num_workers=1, elements_per_packet=64, window=4)
    c.join()
    x = (rng.standard_normal(700) * 3.0).astype(x_type)
    out, res = np.empty_like(x), np.full(x.size, np.nan, res_type)
    c.wait(c.start([x], [out], bits=16, residuals=[res]))
    lost = x.astype(np.float64) - out.astype(np.float64)
    assert np.all(np.isfinite(res)) and np.count_nonzero(res) > 100  # rounding took something
    assert np.allclose(res, lost, rtol=1e-6, atol=float(np.spacing(np.float32(3.0))))
    block = 128
    for b in range(0, x.size, block):
        quantum = 2.0 ** (block_exponent(x[b:b + block].astype(np.float32))[0]
                          - scale_bits(1, 16))
        assert np.all(np.abs(res[b:b + block]) <= 0.5 * quantum * 1.0001)
