"""The worker's compiled receive-and-send loop (``transport/fastpath.py``): with it and
without it the ranks get bit-for-bit the same sums, through a clean switch and a lossy one
(where NACKs, WAITING replies and timers send the loop back to Python mid-batch)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from switchml.control import new_job_spec
from switchml.protocol.config import SwitchConfig, WorkerConfig
from switchml.protocol.switch import SwitchDataplane
from switchml.transport import fastpath
from switchml.transport.faults import LossyEndpoint
from switchml.transport.udp import SwitchServer, WorkerClient

pytestmark = pytest.mark.skipif(not fastpath.available(), reason="no Linux libc here")


def _inputs(n: int, numel: int, dtype, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "i":
        return [rng.integers(-1000, 1000, numel).astype(dtype) for _ in range(n)]
    return [(rng.standard_normal(numel) * 10 ** rng.uniform(-3, 3, numel)).astype(dtype)
            for _ in range(n)]


def _run(monkeypatch, *, fast: bool, loss: float, dtype, bits: int, n: int = 3,
         numel: int = 60_000, ops: int = 2, shards: int = 1):
    """Every rank's outputs and counters, through a switch (of ``shards`` shards) that loses
    ``loss`` both ways."""
    monkeypatch.setenv("SWITCHML_FASTPATH", "1" if fast else "0")
    servers = []
    for i in range(shards):
        dp = SwitchDataplane(SwitchConfig(nack_gap=4, shard_index=i, shard_count=shards))
        if loss:
            dp = LossyEndpoint(dp, loss, seed=7 + i)
        servers.append(SwitchServer(host="127.0.0.1", port=0, dataplane=dp).start())
    spec = new_job_spec(n, window=16, elements_per_packet=358)
    xs = _inputs(n, numel, dtype, seed=1)
    outs: dict[int, list[np.ndarray]] = {}
    counters: dict[int, dict] = {}
    addresses = [s.address for s in servers]
    try:
        def rank(r: int) -> None:
            cfg = WorkerConfig(op_timeout_s=30, min_rto_s=0.005)
            with WorkerClient(addresses if shards > 1 else addresses[0], spec, r, cfg) as w:
                outs[r] = [w.allreduce(xs[r], bits=bits) for _ in range(ops)]
                counters[r] = w.counters
                assert (w._fast is not None) == fast
        _each_rank(n, rank)
    finally:
        for s in servers:
            s.stop()
    return xs, outs, counters


def _each_rank(n: int, rank) -> None:  # type: ignore[no-untyped-def]
    """Run ``rank(r)`` for r < n, each in a thread; raise what any of them raised."""
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            rank(r)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


@pytest.mark.parametrize("dtype,bits,shards", [(np.float32, 32, 1), (np.int32, 32, 1),
                                               (np.float64, 16, 1), (np.float32, 32, 3)])
@pytest.mark.parametrize("loss", [0.0, 0.03])
def test_the_compiled_loop_gives_what_the_python_pump_gives(monkeypatch, dtype, bits, shards,
                                                           loss):
    # With 3 shards the loop sends each lane's requests to its shard (lane i to shard i mod 3)
    # and takes results from the three addresses on an unconnected socket.
    xs, fast_outs, fast_counters = _run(monkeypatch, fast=True, loss=loss, dtype=dtype,
                                        bits=bits, shards=shards)
    _, slow_outs, _ = _run(monkeypatch, fast=False, loss=loss, dtype=dtype, bits=bits,
                           shards=shards)
    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for r in fast_outs:
        for op, (a, b) in enumerate(zip(fast_outs[r], slow_outs[r])):
            np.testing.assert_array_equal(a, b, err_msg=f"rank {r}, operation {op}")
            np.testing.assert_array_equal(a, fast_outs[0][op])
    if dtype == np.int32:
        np.testing.assert_array_equal(fast_outs[0][0], total.astype(np.int32))
    else:  # within the fixed-point bound of each block: n ranks' rounding, each at most half
        # a quantum of 2**(e - P) with 2**e < 2 x the block's max (P = 29 - 16 for n = 3 in
        # 16 bits, 27 in 32): n x 2**-P x the block's max
        k = 358 * 32 // bits
        p_bits = 13 if bits == 16 else 29
        blocks = -(-total.size // k)
        mx = np.max(np.abs(np.stack(xs)), axis=0).astype(np.float64)
        bound = np.repeat(np.maximum.reduceat(mx, np.arange(0, blocks * k, k)), k)[:total.size]
        rounding = np.abs(total) * np.finfo(dtype).eps  # the sum, rounded to the output dtype
        assert np.all(np.abs(fast_outs[0][0] - total) <= 3 * 2.0 ** -p_bits * bound + rounding)
    if loss:  # the loop handed loss recovery to Python and took the results back
        assert sum(c["retransmissions"] for c in fast_counters.values()) > 0
    assert all(c["recv_calls"] > 0 for c in fast_counters.values())


def test_a_switch_gone_mid_operation_is_reported_as_icmp_errors_from_the_loop():
    """The switch stops while an operation is in flight (the worker in its compiled loop):
    the port-unreachable errors the loop's recvmmsg gets are counted and named in the
    failure, as the Python pump names them, within the operation timeout."""
    from switchml.protocol.errors import OperationFailed
    server = SwitchServer(host="127.0.0.1", port=0).start()
    spec = new_job_spec(2, window=8, elements_per_packet=64)
    cfg = WorkerConfig(op_timeout_s=2.0, min_rto_s=0.01)
    other = threading.Thread(target=lambda: WorkerClient(server.address, spec, 1, cfg).close())
    with WorkerClient(server.address, spec, 0, cfg) as w:
        assert w._fast is not None
        other.start()
        other.join(timeout=30)  # rank 1 joined and left: rank 0's operation waits for it
        handle = w.allreduce_async(np.ones(5000, np.float32))
        server.stop()
        with pytest.raises(OperationFailed, match="ICMP port-unreachable"):
            handle.wait(timeout=20)
        assert w.counters["icmp_errors"] > 0


def test_a_first_window_the_compiled_send_leaves_is_sent_by_python(monkeypatch):
    """An operation's first window goes out through the compiled sender as it starts. When
    its ``sendmsg`` fails (here: the first of each operation, EAGAIN, nothing sent; a full
    socket buffer on a real link) the lanes stay queued and go through Python's sender at
    once: the operations complete exactly (int32), with no re-send, and the failure is
    counted as a blocked send."""
    import errno

    from switchml.transport.fastpath import ST, FastPath
    real, failed = FastPath.send, set()

    held = []  # the states seen, kept alive so that no id is reused

    def failing_first(self, state):  # type: ignore[no-untyped-def]
        if (id(self), id(state)) not in failed:  # each rank's first send of each operation
            failed.add((id(self), id(state)))  # (each operation has an OpState of its own)
            held.append(state)
            self.stats[ST.ERRNO] = errno.EAGAIN
            return False
        return real(self, state)

    monkeypatch.setattr(FastPath, "send", failing_first)
    n, numel = 2, 100_000
    spec = new_job_spec(n, window=128, elements_per_packet=358)
    xs = [np.arange(numel, dtype=np.int32) * (r + 1) for r in range(n)]
    outs: dict[int, list[np.ndarray]] = {}
    counters: dict[int, dict] = {}
    with SwitchServer(host="127.0.0.1", port=0) as server:
        def rank(r: int) -> None:
            cfg = WorkerConfig(op_timeout_s=30, initial_rto_s=0.5, min_rto_s=0.5,
                               min_reorder_window_s=0.5)
            with WorkerClient(server.address, spec, r, cfg) as w:
                assert w._fast is not None
                outs[r] = [w.allreduce(xs[r]) for _ in range(3)]
                counters[r] = {**w.counters, "datagrams": w._sender.datagrams}
        _each_rank(n, rank)
    for r in range(n):
        for out in outs[r]:
            np.testing.assert_array_equal(out, xs[0] * 3)
    assert len(failed) == n * 3  # (the fake failed each operation's first send)
    assert all(c["send_blocked"] >= 3 for c in counters.values())
    # nothing lost (no re-send) and nothing sent twice: the datagrams sent are the requests
    # the kernels built, and a few control messages (JOIN, LEAVE)
    assert sum(c.get("retransmissions", 0) for c in counters.values()) == 0
    for c in counters.values():
        assert c["packets_sent"] <= c["datagrams"] < c["packets_sent"] + 16, c
