"""End-to-end all-reduce through :class:`MemoryCluster`: the real switch and worker endpoints on a
seeded virtual-time network, checked against a float64 reference.

Accuracy contract (``switchml.protocol.quantize``): per block, the sum is off by at most
``error_bound(emax, n)`` (``emax`` = max block exponent over the ranks) before the final rounding
to the output dtype, which adds at most half an ulp of the result. int32 sums are exact.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchml.protocol.config import WorkerConfig
from switchml.protocol.errors import LocalProtocolError
from switchml.protocol.errors import OperationFailed as OperationFailedError
from switchml.protocol.events import OperationAborted, OperationCompleted
from switchml.protocol.quantize import block_exponent, error_bound
from switchml.protocol.wire import MessageType, unpack_header
from switchml.protocol.worker import WorkerState
from switchml.transport.memory import FaultModel, MemoryCluster

FLOATS = (np.float32, np.float64, np.float16)
DTYPES = (*FLOATS, np.int32)
SWITCH = MemoryCluster.SWITCH

# -- Helpers ---------------------------------------------------------------------------------


def make_inputs(n: int, size: int, dtype, seed: int = 0) -> list[np.ndarray]:
    """Per-rank inputs whose magnitude varies from block to block and within blocks.

    Floats: |x| < 16 (so 16 ranks cannot overflow float16); int32: |x| < 2**20 (exact sums).
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if np.dtype(dtype) == np.int32:
            out.append(rng.integers(-(2**20), 2**20, size, dtype=np.int32))
        else:
            block_scale = 2.0 ** rng.integers(-4, 5, max(1, -(-size // 7)))
            x = rng.uniform(-1.0, 1.0, size) * 2.0 ** rng.integers(-6, 1, size)
            x *= np.repeat(block_scale, 7)[:size]
            out.append(x.astype(dtype))
    return out


def reference_and_tolerance(inputs: list[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Return the float64 reference sum and the per-element tolerance for a float all-reduce.

    tolerance = error_bound(emax of the block, n)          (quantization, documented)
              + n * eps64 * sum|x|                          (the float64 reference's own rounding)
              + one ulp of the output dtype at |ref| + bound (the final rounding: half an ulp,
                                                              measured at a magnitude >= the result)
    """
    n = len(inputs)
    dtype = inputs[0].dtype
    flat = [x.reshape(-1) for x in inputs]
    x64 = np.stack([x.astype(np.float64) for x in flat])
    ref = x64.sum(axis=0)
    tol = np.empty(ref.size)
    for b in range(0, ref.size, k):
        emax = max(block_exponent(x[b:b + k])[0] for x in flat)
        tol[b:b + k] = error_bound(emax, n)
    tol += n * np.finfo(np.float64).eps * np.abs(x64).sum(axis=0)
    with np.errstate(over="ignore"):
        top = np.minimum(np.abs(ref) + tol, float(np.finfo(dtype).max))  # spacing(inf) is nan
        tol += np.spacing(top.astype(dtype)).astype(np.float64)
    return ref, tol


def assert_allreduce_ok(outs: list[np.ndarray], inputs: list[np.ndarray], k: int) -> None:
    """Every rank holds the same array, and it is the sum within the documented bound."""
    dtype = inputs[0].dtype
    for r, o in enumerate(outs):
        assert o.dtype == dtype and o.shape == inputs[0].shape
        assert np.array_equal(o, outs[0], equal_nan=True), f"rank {r} differs from rank 0"
    if dtype == np.int32:
        ref = np.stack([x.astype(np.int64) for x in inputs]).sum(axis=0)
        assert np.array_equal(outs[0].astype(np.int64), ref)
        return
    ref, tol = reference_and_tolerance(inputs, k)
    got = outs[0].reshape(-1).astype(np.float64)
    assert np.all(np.isfinite(got)), "finite inputs gave a non-finite sum"
    err = np.abs(got - ref)
    bad = np.flatnonzero(~(err <= tol))
    assert bad.size == 0, (
        f"{bad.size} elements out of bound; first at {bad[0]}: got {got[bad[0]]!r}, "
        f"ref {ref[bad[0]]!r}, err {err[bad[0]]:.3g} > tol {tol[bad[0]]:.3g}")


def run_once(n: int, inputs, *, window: int, k: int, faults: FaultModel | None = None,
             seed: int = 0) -> tuple[MemoryCluster, list[np.ndarray]]:
    c = MemoryCluster(num_workers=n, window=window, elements_per_packet=k, faults=faults,
                      seed=seed)
    return c, c.allreduce(inputs)


# -- Sums for n, dtype and size ---------------------------------------------------------------

K, W = 32, 4
SIZES = {
    "one": 1,
    "k-1": K - 1,
    "k": K,
    "k+1": K + 1,
    "3windows+5": 3 * W * K + 5,
    "odd": 1001,
}


@pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16])
def test_sum_matches_reference(n: int, dtype, size: int) -> None:
    inputs = make_inputs(n, size, dtype, seed=1000 * n + size)
    c, outs = run_once(n, inputs, window=W, k=K)
    assert_allreduce_ok(outs, inputs, K)
    for w in c.workers:
        assert w.state is WorkerState.READY
        assert w.counters["operations_completed"] == 1
        assert w.counters["retransmissions"] == 0  # loss-free: nothing may time out


def test_multidimensional_arrays_keep_their_shape() -> None:
    inputs = [x.reshape(10, 33) for x in make_inputs(3, 330, np.float32, seed=5)]
    _, outs = run_once(3, inputs, window=2, k=16)
    assert all(o.shape == (10, 33) for o in outs)
    assert_allreduce_ok([o.reshape(-1) for o in outs], [x.reshape(-1) for x in inputs], 16)


def test_empty_array_completes_without_traffic() -> None:
    c = MemoryCluster(num_workers=2, window=2, elements_per_packet=8)
    c.join()
    sent = c.fabric.stats["sent"]
    outs = c.allreduce([np.empty(0, np.float32)] * 2)
    assert [o.size for o in outs] == [0, 0]
    assert c.fabric.stats["sent"] == sent
    # ... and the ranks stay in step: the next operation is still correct.
    inputs = make_inputs(2, 40, np.float32, seed=6)
    assert_allreduce_ok(c.allreduce(inputs), inputs, 8)


@pytest.mark.slow
def test_large_float32_allreduce() -> None:
    """40 M elements in total (n=2, 20 M float32 each, 16000-element packets, window 16)."""
    n, size, k = 2, 20_000_003, 16000
    rng = np.random.default_rng(42)
    inputs = [rng.standard_normal(size, dtype=np.float32) for _ in range(n)]
    for x in inputs:  # vary the block exponents
        x[: size // 2] *= np.float32(1e-3)
        x[size // 3: size // 3 + 5 * k] *= np.float32(1e4)
    c, outs = run_once(n, inputs, window=16, k=k)
    assert np.array_equal(outs[0], outs[1])
    assert c.switch.stats()["elements_aggregated"][c.spec.job_id] == size
    # Check block-wise (bounded memory).
    step = 64 * k
    for lo in range(0, size, step):
        part_in = [x[lo:lo + step] for x in inputs]
        ref, tol = reference_and_tolerance(part_in, k)
        err = np.abs(outs[0][lo:lo + step].astype(np.float64) - ref)
        assert np.all(err <= tol), f"block range starting at {lo} out of bound"


# -- Several operations on one cluster --------------------------------------------------------

OP_SEQUENCE = [
    (np.float32, 5 * 16 + 3),   # L=6 > W=4
    (np.float32, 5 * 16 + 3),   # same size again, new data: a wrong carry returns the old sum
    (np.int32, 20),             # L=2 < W
    (np.float64, 3 * 4 * 16),   # exactly 3 windows
    (np.float16, 17),           # L=2 < W
    (np.int32, 1),              # L=1
    (np.float32, 3 * 16),       # L=3 < W, after ops that used 1 and 2 lanes
    (np.float32, 3 * 16),
    (np.int32, 9 * 16 + 1),
    (np.float64, 1),
]


def run_sequence(c: MemoryCluster, seed: int) -> list[list[np.ndarray]]:
    results = []
    for i, (dtype, size) in enumerate(OP_SEQUENCE):
        inputs = make_inputs(c.spec.num_workers, size, dtype, seed=seed + i)
        outs = c.allreduce(inputs)
        assert_allreduce_ok(outs, inputs, c.spec.elements_per_packet)
        results.append(outs)
    return results


def test_consecutive_operations_of_different_sizes_and_dtypes() -> None:
    c = MemoryCluster(num_workers=3, window=4, elements_per_packet=16)
    results = run_sequence(c, seed=10)
    # The two same-size float32 pairs got different data and must have different sums.
    assert not np.array_equal(results[0][0], results[1][0])
    assert not np.array_equal(results[6][0], results[7][0])
    for w in c.workers:
        assert w.counters["operations_completed"] == len(OP_SEQUENCE)
        assert w.drops["stale_result"] == 0 and w.drops["bad_slot"] == 0


def test_consecutive_operations_under_faults_match_loss_free_run() -> None:
    faults = FaultModel(loss_rate=0.05, duplicate_rate=0.05, reorder_rate=0.2)
    clean = run_sequence(MemoryCluster(num_workers=3, window=4, elements_per_packet=16), 20)
    c = MemoryCluster(num_workers=3, window=4, elements_per_packet=16, faults=faults, seed=3)
    faulty = run_sequence(c, 20)
    for a, b in zip(clean, faulty):
        for o_clean, o_faulty in zip(a, b):
            assert np.array_equal(o_clean, o_faulty)
    assert c.fabric.stats["lost"] > 0 and c.fabric.stats["reordered"] > 0


def run_pipelined(c: MemoryCluster, ops: list[list[np.ndarray]],
                  max_time_s: float = 600.0) -> list[list[np.ndarray]]:
    """Run the operations with no barrier between them: each rank starts its next operation as
    soon as its previous one completed (as a training loop does), while slower ranks may still
    be recovering the previous one."""
    if c.workers[0].state is WorkerState.NEW:
        c.join()
    fab = c.fabric
    n = c.spec.num_workers
    outs = [[np.empty_like(x) for x in inputs] for inputs in ops]
    started = [0] * n
    done = [0] * n
    seen_events = [len(fab.events[a]) for a in c.addresses]

    def start(r: int) -> None:
        j = started[r]
        c.workers[r].start_allreduce(ops[j][r], outs[j][r], fab.now)
        started[r] += 1
        fab.flush(c.addresses[r])

    for r in range(n):
        start(r)
    while True:
        for r, a in enumerate(c.addresses):
            while seen_events[r] < len(fab.events[a]):
                ev = fab.events[a][seen_events[r]]
                seen_events[r] += 1
                if isinstance(ev, OperationAborted):
                    raise OperationFailedError(f"rank {r}: {ev.reason}")
                if isinstance(ev, OperationCompleted):
                    done[r] += 1
                    if started[r] < len(ops):
                        start(r)
        if all(d == len(ops) for d in done):
            return outs
        assert fab.step(), "the fabric went idle"
        assert fab.now < max_time_s


def test_next_operation_starts_while_a_peer_recovers_the_last_result() -> None:
    """Rank 0 finishes op 0 and starts op 1 on the same slot while rank 1 still has to recover
    op 0's (lost) result. Op 1 must use the other set of the slot, so that the switch still
    holds op 0's result for rank 1's retransmission (a wrong set carry overwrites it)."""
    n, k = 2, 4
    c = MemoryCluster(num_workers=n, window=4, elements_per_packet=k,
                      worker_config=WorkerConfig(op_timeout_s=2.0, max_rto_s=0.5))
    a1 = c.addresses[1]
    dropped = []

    def drop_first_result_to_rank1(payload: bytes, src, dst) -> bool:
        h = unpack_header(payload)
        if h.type is MessageType.RESULT and dst == a1 and h.seq == 0 and not dropped:
            dropped.append(h)
            return True
        return False

    c.fabric.drop_filter = drop_first_result_to_rank1
    ops = [make_inputs(n, k, np.int32, seed=1),       # L=1: lane 0 once (odd)
           make_inputs(n, 3 * k, np.int32, seed=2),   # L=3 < W
           make_inputs(n, 9 * k, np.float32, seed=3)]  # L=9 > W
    outs = run_pipelined(c, ops)
    assert len(dropped) == 1
    assert c.switch.results_resent >= 1
    for inputs, got in zip(ops, outs):
        assert_allreduce_ok(got, inputs, k)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pipelined_operations_under_faults(seed: int) -> None:
    n, window, k = 3, 4, 8
    faults = FaultModel(loss_rate=0.1, duplicate_rate=0.05, reorder_rate=0.2)
    sizes = [(np.int32, 8), (np.float32, 20), (np.int32, 100), (np.float16, 9),
             (np.float32, 1), (np.float64, 70), (np.int32, 17), (np.float32, 33)]
    ops = [make_inputs(n, size, dtype, seed=seed * 100 + i)
           for i, (dtype, size) in enumerate(sizes)]
    expected = run_pipelined(MemoryCluster(num_workers=n, window=window, elements_per_packet=k),
                             ops)
    c = MemoryCluster(num_workers=n, window=window, elements_per_packet=k, faults=faults,
                      seed=seed)
    got = run_pipelined(c, ops)
    for inputs, e, g in zip(ops, expected, got):
        assert_allreduce_ok(e, inputs, k)
        for r in range(n):
            assert np.array_equal(g[r], e[r])
    assert c.fabric.stats["lost"] > 0 and c.switch.results_resent > 0


# -- In place ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("faults", [None, FaultModel(loss_rate=0.1, reorder_rate=0.2)],
                         ids=["clean", "lossy"])
def test_in_place(dtype, faults) -> None:
    n, size, k = 3, 10 * 16 + 7, 16
    inputs = make_inputs(n, size, dtype, seed=77)
    _, expected = run_once(n, inputs, window=4, k=k)
    arrays = [x.copy() for x in inputs]
    c = MemoryCluster(num_workers=n, window=4, elements_per_packet=k, faults=faults, seed=9)
    c.wait(c.start(arrays))  # outs default to the inputs: in place
    for a, e in zip(arrays, expected):
        assert np.array_equal(a, e)
    assert_allreduce_ok(arrays, inputs, k)


# -- Non-finite values ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_poisons_exactly_its_block(dtype, bad) -> None:
    n, k, window, blocks = 4, 8, 2, 7
    inputs = make_inputs(n, k * blocks - 3, dtype, seed=31)
    inputs[2][1 * k + 5] = bad        # block 1: sent in the look-ahead phase (block < window)
    inputs[0][4 * k] = bad            # block 4: a later block
    inputs[3][6 * k + 1] = np.nan     # block 6: the last, partial block, a different rank
    _, outs = run_once(n, inputs, window=window, k=k)
    poisoned = {1, 4, 6}
    for o in outs:
        assert np.array_equal(o, outs[0], equal_nan=True)
    for b in range(blocks):
        blk = outs[0][b * k:(b + 1) * k]
        if b in poisoned:
            assert np.all(np.isnan(blk)), f"block {b} should be all NaN"
        else:
            assert np.all(np.isfinite(blk)), f"block {b} should be finite"
            assert_allreduce_ok([blk], [x[b * k:(b + 1) * k] for x in inputs], k)


def test_block_with_only_nonfinite_values_is_nan() -> None:
    k = 4
    inputs = [np.zeros(3 * k, np.float32) for _ in range(2)]
    inputs[0][k:2 * k] = np.inf  # the whole block is non-finite: its finite exponent is "zero"
    inputs[1][:] = 1.0
    _, outs = run_once(2, inputs, window=2, k=k)
    assert np.all(np.isnan(outs[0][k:2 * k]))
    assert np.array_equal(outs[0][:k], np.full(k, 1.0, np.float32))
    assert np.array_equal(outs[0][2 * k:], np.full(k, 1.0, np.float32))


# -- Zeros, subnormals, huge magnitudes -------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_zeros_are_exact(dtype) -> None:
    n, k = 16, 8
    inputs = [np.zeros(5 * k + 1, dtype) for _ in range(n)]
    if np.dtype(dtype).kind == "f":
        inputs[3][:] = -0.0
    inputs[0][2 * k + 1] = 3  # one non-zero block between all-zero blocks
    _, outs = run_once(n, inputs, window=2, k=k)
    expected = np.zeros(5 * k + 1, dtype)
    expected[2 * k + 1] = 3
    for o in outs:
        assert np.array_equal(o, expected)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_subnormals_n16(dtype) -> None:
    n, k, size = 16, 8, 6 * 8 + 3
    tiny = np.finfo(dtype).smallest_subnormal
    rng = np.random.default_rng(3)
    inputs = [(rng.integers(-100, 101, size) * tiny).astype(dtype) for _ in range(n)]
    assert np.any(inputs[0] != 0) and np.all(np.abs(inputs[0]) < np.finfo(dtype).tiny)
    _, outs = run_once(n, inputs, window=3, k=k)
    assert_allreduce_ok(outs, inputs, k)
    # Integer multiples of the smallest subnormal sum exactly (no bits are lost).
    exact = np.stack([x.astype(np.float64) for x in inputs]).sum(axis=0)
    assert np.array_equal(outs[0].astype(np.float64), exact)


@pytest.mark.parametrize("dtype,huge", [(np.float32, 1e38), (np.float64, 1e300),
                                        (np.float16, 6e4)], ids=["float32", "float64", "float16"])
def test_huge_magnitudes_n16(dtype, huge) -> None:
    n, k, size = 16, 8, 6 * 8 + 5
    rng = np.random.default_rng(4)
    inputs = []
    for r in range(n):
        # |x| <= huge / 16 elsewhere: 16 of them cannot overflow the output dtype.
        x = rng.uniform(-1, 1, size) * (huge / 16)
        x[0] = huge if r % 2 == 0 else -huge          # cancels: 8 * huge - 8 * huge = 0
        x[1] = huge / 16 * 0.99                       # all ranks positive: sum ~ 0.99 huge
        x[k:2 * k] = rng.uniform(-1, 1, k) * 1e-3     # a small block next to huge ones
        x[2 * k:2 * k + n] = rng.uniform(-1, 1, n) * 1e-3
        x[2 * k + r] = huge                           # huge next to tiny, in one rank only
        inputs.append(x.astype(dtype))
    _, outs = run_once(n, inputs, window=2, k=k)
    assert_allreduce_ok(outs, inputs, k)
    assert abs(float(outs[0][0])) <= error_bound(block_exponent(inputs[0][:k])[0], n)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype,n", [(np.float64, 1), (np.float64, 2), (np.float32, 128),
                                     (np.float16, 3)])
def test_dtype_max_does_not_overflow(dtype, n) -> None:
    inputs = [np.zeros(1, dtype) for _ in range(n)]
    inputs[0][0] = np.finfo(dtype).max
    _, outs = run_once(n, inputs, window=1, k=1)
    assert np.isfinite(outs[0][0]), f"finfo({np.dtype(dtype).name}).max summed to {outs[0][0]}"
    assert_allreduce_ok(outs, inputs, 1)


# -- Seeded faults: bit-identical results -----------------------------------------------------

FAULTS = {
    "loss1": FaultModel(loss_rate=0.01),
    "loss10": FaultModel(loss_rate=0.10),
    "dup5": FaultModel(duplicate_rate=0.05),
    "reorder20": FaultModel(reorder_rate=0.2),
    "combined": FaultModel(loss_rate=0.10, duplicate_rate=0.05, reorder_rate=0.2,
                           jitter_s=30e-6),
}
FAULT_OPS = [(np.float32, 40 * 32 + 11), (np.int32, 700), (np.float16, 150), (np.float64, 90)]


@pytest.mark.parametrize("name", list(FAULTS))
def test_faults_give_bit_identical_results(name: str) -> None:
    faults = FAULTS[name]
    n, window, k = 4, 8, 32
    clean = MemoryCluster(num_workers=n, window=window, elements_per_packet=k)
    faulty = MemoryCluster(num_workers=n, window=window, elements_per_packet=k, faults=faults,
                           seed=1234)
    for i, (dtype, size) in enumerate(FAULT_OPS):
        inputs = make_inputs(n, size, dtype, seed=500 + i)
        expected = clean.allreduce(inputs)
        assert_allreduce_ok(expected, inputs, k)
        got = faulty.allreduce(inputs)
        for r in range(n):
            assert np.array_equal(got[r], expected[r]), f"op {i} rank {r} differs under {name}"
    stats = faulty.fabric.stats
    workers = faulty.workers
    sw = faulty.switch
    if faults.loss_rate:
        assert stats["lost"] > 0
        assert sum(w.counters["retransmissions"] for w in workers) > 0
    else:
        assert stats["lost"] == 0
    if faults.duplicate_rate:
        assert stats["duplicated"] > 0
        handled = (sw.drops["duplicate"] + sw.drops["late_duplicate"] + sw.drops["stale"]
                   + sum(w.drops["duplicate_result"] + w.drops["stale_result"]
                         for w in workers))
        assert handled > 0, "duplicates were generated but none reached a dedup path"
    if faults.reorder_rate:
        assert stats["reordered"] > 0
    assert stats["delivered"] > clean.fabric.stats["delivered"] * 0.5


# -- Property: exact int32 sums under random faults -------------------------------------------


@settings(derandomize=True, max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 6),
    window=st.integers(1, 5),
    k=st.sampled_from([1, 3, 16, 50]),
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    loss=st.sampled_from([0.0, 0.02, 0.1, 0.25]),
    dup=st.sampled_from([0.0, 0.05, 0.2]),
    reorder=st.sampled_from([0.0, 0.1, 0.4]),
    pipelined=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_int32_sums_exact_under_faults(n, window, k, sizes, loss, dup, reorder,
                                                pipelined, seed) -> None:
    faults = FaultModel(loss_rate=loss, duplicate_rate=dup, reorder_rate=reorder)
    # At 25% loss a JOIN exchange fails 44% of the time: give joining (virtual) time enough
    # that the property tested is the sums, not the odds of 8 failed JOIN retries in 10 s.
    c = MemoryCluster(num_workers=n, window=window, elements_per_packet=k, faults=faults,
                      seed=seed, worker_config=WorkerConfig(join_timeout_s=120.0))
    rng = np.random.default_rng(seed)
    bound = 2**31 // 8  # 6 ranks cannot overflow int32
    ops = [[rng.integers(-bound, bound, size, dtype=np.int32) for _ in range(n)]
           for size in sizes]
    results = run_pipelined(c, ops) if pipelined else [c.allreduce(inputs) for inputs in ops]
    for inputs, outs in zip(ops, results):
        expected = np.stack([x.astype(np.int64) for x in inputs]).sum(axis=0)
        for o in outs:
            assert np.array_equal(o.astype(np.int64), expected)


# -- Failure detection ------------------------------------------------------------------------

FAIL_CONFIG = WorkerConfig(op_timeout_s=2.0, max_rto_s=0.5, initial_rto_s=0.05, min_rto_s=0.01)


def step_tracking(c: MemoryCluster, ranks: list[int], until, max_time_s: float = 100.0):
    """Step the fabric until ``until()``; return per rank the virtual time of its last result
    and of its OperationAborted event (None if none)."""
    fab = c.fabric
    seen = {r: c.workers[r].counters["results_received"] for r in ranks}
    last_progress = {r: fab.now for r in ranks}
    failed_at: dict[int, float | None] = {r: None for r in ranks}
    while not until():
        assert fab.step(), "the fabric went idle"
        assert fab.now < max_time_s, "no failure within bounded virtual time"
        for r in ranks:
            got = c.workers[r].counters["results_received"]
            if got != seen[r]:
                seen[r], last_progress[r] = got, fab.now
            if failed_at[r] is None and any(
                    isinstance(e, OperationAborted) for e in fab.events[c.addresses[r]]):
                failed_at[r] = fab.now
    return last_progress, failed_at


def failures(c: MemoryCluster, r: int) -> list[OperationAborted]:
    return [e for e in c.fabric.events[c.addresses[r]] if isinstance(e, OperationAborted)]


def start_and_progress(c: MemoryCluster, size: int, results: int) -> list[int]:
    """Start an operation on every rank, run until rank 0 has ``results`` results; return
    the operations' sequence numbers."""
    inputs = make_inputs(c.spec.num_workers, size, np.float32, seed=8)
    handles = c.start(inputs, [np.empty_like(x) for x in inputs])
    c.fabric.run(lambda: c.workers[0].counters["results_received"] >= results)
    assert c.workers[0].state is WorkerState.BUSY  # really mid-operation
    return [h.seq for h in handles]


def fail_after_op_timeout(c: MemoryCluster, ranks: list[int], seqs: list[int],
                          cfg: WorkerConfig) -> dict[int, OperationAborted]:
    """Step until every rank of ``ranks`` failed; each failed once, in the operation it was in,
    ``op_timeout_s`` (plus at most one RTO) after its last result. Their failure events."""
    last, failed_at = step_tracking(c, ranks, lambda: all(failures(c, r) for r in ranks))
    events = {}
    for r in ranks:
        (ev,) = failures(c, r)
        assert ev.seq == seqs[r]
        idle = failed_at[r] - last[r]
        assert cfg.op_timeout_s - 1e-9 <= idle <= cfg.op_timeout_s + cfg.max_rto_s + 1e-3
        events[r] = ev
    return events


def assert_failed_endpoint_refuses(c: MemoryCluster, r: int) -> None:
    w = c.workers[r]
    assert w.state is WorkerState.ERROR
    assert w.counters["operations_failed"] == 1
    x = np.ones(4, np.float32)
    with pytest.raises(LocalProtocolError, match="state error"):
        w.start_allreduce(x, x.copy(), c.fabric.now)
    assert w.state is WorkerState.ERROR


def test_detached_worker_is_named_by_the_others() -> None:
    cfg = FAIL_CONFIG
    c = MemoryCluster(num_workers=4, window=4, elements_per_packet=16, worker_config=cfg)
    seqs = start_and_progress(c, 24 * 16, results=6)
    c.fabric.detach(c.addresses[2])
    survivors = [0, 1, 3]
    for r, ev in fail_after_op_timeout(c, survivors, seqs, cfg).items():
        assert "rank(s) [2]" in ev.reason, ev.reason
        assert "no progress" in ev.reason
        assert c.workers[r].counters["waiting_received"] > 0
        assert_failed_endpoint_refuses(c, r)
    assert c.switch.waiting_sent > 0
    assert not any(isinstance(e, OperationCompleted) and e.seq == seqs[0]
                   for r in survivors for e in c.fabric.events[c.addresses[r]])


def test_two_detached_workers_are_both_named_via_wait() -> None:
    c = MemoryCluster(num_workers=5, window=2, elements_per_packet=8, worker_config=FAIL_CONFIG)
    inputs = make_inputs(5, 10 * 8, np.float32, seed=8)
    handles = c.start(inputs, [np.empty_like(x) for x in inputs])
    c.fabric.run(lambda: c.workers[0].counters["results_received"] >= 3)
    t_detach = c.fabric.now
    c.fabric.detach(c.addresses[1])
    c.fabric.detach(c.addresses[3])
    survivors = [0, 2, 4]
    with pytest.raises(OperationFailedError, match=r"rank\(s\) \[1, 3\]"):
        c.wait([handles[r] for r in survivors])
    bound = FAIL_CONFIG.op_timeout_s + FAIL_CONFIG.max_rto_s + 0.01
    assert c.fabric.now <= t_detach + bound
    for r in survivors:
        assert "rank(s) [1, 3]" in failures(c, r)[0].reason


def test_rank_that_never_starts_is_named() -> None:
    c = MemoryCluster(num_workers=3, window=2, elements_per_packet=8, worker_config=FAIL_CONFIG)
    inputs = make_inputs(3, 40, np.int32)
    handles = c.start(inputs[:2], [np.empty_like(x) for x in inputs[:2]], ranks=[0, 1])
    t0 = c.fabric.now
    with pytest.raises(OperationFailedError, match=r"rank\(s\) \[2\]"):
        c.wait(handles)
    assert c.fabric.now == pytest.approx(t0 + FAIL_CONFIG.op_timeout_s)


def test_detached_switch_is_named() -> None:
    cfg = FAIL_CONFIG
    c = MemoryCluster(num_workers=3, window=4, elements_per_packet=16, worker_config=cfg)
    seqs = start_and_progress(c, 24 * 16, results=5)
    c.fabric.detach(SWITCH)
    ranks = [0, 1, 2]
    for r, ev in fail_after_op_timeout(c, ranks, seqs, cfg).items():
        assert "no answer from the switch at switch:48864" in ev.reason, ev.reason
        assert "rank(s)" not in ev.reason
        assert c.workers[r].counters["retransmissions"] > 0
        assert_failed_endpoint_refuses(c, r)


MISMATCHED_OPERATIONS = {
    # name: (the odd rank, everybody's (size, dtype, bits), the odd rank's); k = 16, window 4
    "last_chunk_shorter": (1, (48, np.float32, 32), (40, np.float32, 32)),
    "fewer_chunks": (1, (48, np.int32, 32), (32, np.int32, 32)),
    "fewer_lanes": (0, (160, np.float32, 32), (16, np.float32, 32)),
    "float_vs_int": (2, (48, np.float32, 32), (48, np.int32, 32)),
    "other_bits": (1, (64, np.float32, 16), (64, np.float32, 32)),
}


@pytest.mark.parametrize("case", list(MISMATCHED_OPERATIONS))
def test_ranks_that_disagree_about_an_operation_all_fail_fast(case: str) -> None:
    """A rank that all-reduces another size, type or width: every rank gets an error saying the
    ranks disagree, long before the timeout, and nobody returns a wrong sum."""
    odd, usual, other = MISMATCHED_OPERATIONS[case]
    c = MemoryCluster(num_workers=3, window=4, elements_per_packet=16, worker_config=FAIL_CONFIG)
    c.join()
    t0 = c.fabric.now
    for r in range(3):
        size, dtype, bits = other if r == odd else usual
        x = np.ones(size, dtype)
        c.workers[r].start_allreduce(x, np.empty_like(x), t0, bits=bits)
        c.fabric.flush(c.addresses[r])
    c.fabric.run(lambda: all(failures(c, r) for r in range(3)))
    assert c.fabric.now - t0 < FAIL_CONFIG.op_timeout_s / 2
    for r in range(3):
        (ev,) = failures(c, r)
        assert "the ranks disagree" in ev.reason, ev.reason
        assert "same size, dtype and bits" in ev.reason
        assert c.workers[r].state is WorkerState.ERROR
        assert not any(isinstance(e, OperationCompleted) for e in c.fabric.events[c.addresses[r]])
        # The others name the odd rank; the odd rank names (some of) the others.
        if r != odd:
            assert f"rank(s) [{odd}]" in ev.reason, ev.reason
        else:
            assert re.search(r"rank\(s\) \[\d(, \d)?\]", ev.reason), ev.reason
            assert f"[{odd}" not in ev.reason and f" {odd}]" not in ev.reason
    assert c.switch.stats()["mismatch_sent"] >= 3


# -- Stale results ----------------------------------------------------------------------------


def test_replayed_result_of_previous_operation_is_dropped() -> None:
    n, window, k, size = 2, 2, 4, 16  # int32: L=4, E=2; lane 0 carries chunks 0 and 2
    c = MemoryCluster(num_workers=n, window=window, elements_per_packet=k)
    a0 = c.addresses[0]
    results: list[bytes] = []
    requests: list[bytes] = []

    def tap(payload: bytes, src, dst) -> bool:
        h = unpack_header(payload)
        if h.chunk == 0 and h.type is MessageType.RESULT and dst == a0:
            results.append(payload)
        if h.chunk == 0 and h.type is MessageType.REQUEST and src == a0:
            requests.append(payload)
        return False

    c.fabric.drop_filter = tap
    first = make_inputs(n, size, np.int32, seed=1)
    c.allreduce(first)
    (old,) = results

    second = make_inputs(n, size, np.int32, seed=2)
    outs = [np.zeros_like(x) for x in second]
    handles = c.start(second, outs)
    # The replay matches rank 0's in-flight packet in everything but the operation: same chunk,
    # slot and set (lane 0 flipped twice in the first operation).
    old_h, req_h = unpack_header(old), unpack_header(requests[-1])
    assert (old_h.chunk, old_h.slot, old_h.set_bit) == (req_h.chunk, req_h.slot, req_h.set_bit)
    assert req_h.seq == handles[0].seq == old_h.seq + 1
    w = c.workers[0]
    w.receive_datagram(old, SWITCH, c.fabric.now)
    c.fabric.flush(a0)
    assert w.drops["stale_result"] == 1
    assert w.counters["results_received"] == 4  # only the first operation's
    assert np.array_equal(outs[0], np.zeros(size, np.int32))
    c.wait(handles)
    expected = second[0].astype(np.int64) + second[1]
    assert np.array_equal(outs[0], expected) and np.array_equal(outs[1], expected)
    assert w.drops["stale_result"] == 1


def test_sequence_numbers_wrap_around() -> None:
    """seq is 32 bits and wraps; the switch orders rounds with serial-number arithmetic."""
    n, k = 3, 4
    faults = FaultModel(loss_rate=0.1, duplicate_rate=0.1, reorder_rate=0.3)
    c = MemoryCluster(num_workers=n, window=2, elements_per_packet=k, faults=faults, seed=3)
    c.join()
    for w in c.workers:
        w._seq = 2**32 - 2  # white-box: fast-forward to just before the wrap
    ops = [make_inputs(n, 5 * k + 1, dtype, seed=i)
           for i, dtype in enumerate([np.float32, np.int32, np.float32, np.int32, np.float64])]
    outs = run_pipelined(c, ops)
    for inputs, got in zip(ops, outs):
        assert_allreduce_ok(got, inputs, k)
    seqs = [e.seq for e in c.fabric.events[c.addresses[0]] if isinstance(e, OperationCompleted)]
    assert seqs == [2**32 - 2, 2**32 - 1, 0, 1, 2]


def test_replayed_requests_of_finished_rounds_are_dropped_by_the_switch() -> None:
    """A request of rank 0 that the switch sees again after rank 0 moved on: first while the
    set still holds that (complete) round -> late_duplicate, then after the set was reused by a
    newer round -> stale. Either way nothing is sent and later results are unaffected."""
    n, k = 2, 4
    c = MemoryCluster(num_workers=n, window=2, elements_per_packet=k)
    a0 = c.addresses[0]
    captured: list[bytes] = []

    def tap(payload: bytes, src, dst) -> bool:
        if src == a0 and unpack_header(payload).type is MessageType.REQUEST:
            captured.append(payload)
        return False

    c.fabric.drop_filter = tap
    c.allreduce(make_inputs(n, k, np.int32, seed=1))  # op 0: one chunk, slot 0, set 0
    (old,) = captured
    c.fabric.drop_filter = None
    c.allreduce(make_inputs(n, k, np.int32, seed=2))  # op 1: slot 0, set 1 (rank 0 moved on)
    sw = c.switch
    sent = c.fabric.stats["sent"]
    sw.receive_datagram(old, a0, c.fabric.now)
    c.fabric.flush(SWITCH)
    assert sw.drops["late_duplicate"] == 1
    assert c.fabric.stats["sent"] == sent
    inputs = make_inputs(n, k, np.int32, seed=3)
    outs = c.allreduce(inputs)                         # op 2: slot 0, set 0 again
    assert_allreduce_ok(outs, inputs, k)
    sent = c.fabric.stats["sent"]
    sw.receive_datagram(old, a0, c.fabric.now)
    c.fabric.flush(SWITCH)
    assert sw.drops["stale"] == 1
    assert c.fabric.stats["sent"] == sent
    inputs = make_inputs(n, 3 * k, np.int32, seed=4)
    assert_allreduce_ok(c.allreduce(inputs), inputs, k)


# -- Local misuse -----------------------------------------------------------------------------


def _misuse_cases():
    x = np.ones(8, np.float32)
    ro = np.ones(8, np.float32)
    ro.flags.writeable = False
    return {
        "int64": (np.ones(8, np.int64), np.ones(8, np.int64), "unsupported dtype int64"),
        "complex": (np.ones(8, np.complex64), np.ones(8, np.complex64),
                    "unsupported dtype complex64"),
        "bool": (np.ones(8, bool), np.ones(8, bool), "unsupported dtype bool"),
        "big-endian": (x.astype(">f4"), x.astype(">f4"), "unsupported dtype"),
        "size mismatch": (x, np.ones(9, np.float32), "out must match data"),
        "dtype mismatch": (x, np.ones(8, np.float64), "out must match data"),
        "non-contiguous data": (np.ones(16, np.float32)[::2], x.copy(), "C-contiguous"),
        "non-contiguous out": (x, np.ones(16, np.float32)[::2], "C-contiguous"),
        "read-only out": (x, ro, "writeable"),
        "not an array": ([1.0] * 8, x.copy(), "numpy array"),
    }


MISUSE = _misuse_cases()


def assert_first_operation_still_works(c: MemoryCluster) -> None:
    """The ranks are still in step (both start operation 0) and a correct operation works."""
    inputs = make_inputs(2, 10, np.float32, seed=3)
    outs = [np.empty_like(a) for a in inputs]
    handles = c.start(inputs, outs)
    assert [h.seq for h in handles] == [0, 0]
    c.wait(handles)
    assert_allreduce_ok(outs, inputs, 4)


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_raises_and_leaves_state_unchanged(case: str) -> None:
    data, out, message = MISUSE[case]
    c = MemoryCluster(num_workers=2, window=2, elements_per_packet=4)
    c.join()
    w = c.workers[0]
    sent = c.fabric.stats["sent"]
    with pytest.raises(LocalProtocolError, match=message) as info:
        w.start_allreduce(data, out, c.fabric.now)
    if "dtype" in message:
        assert "float32" in str(info.value) and "int32" in str(info.value)  # lists the supported
    c.fabric.flush(c.addresses[0])
    assert w.state is WorkerState.READY
    assert c.fabric.stats["sent"] == sent
    assert_first_operation_still_works(c)


def test_start_while_busy_raises_and_the_operation_continues() -> None:
    c = MemoryCluster(num_workers=2, window=2, elements_per_packet=4)
    inputs = make_inputs(2, 30, np.int32, seed=4)
    outs = [np.empty_like(a) for a in inputs]
    (s0,) = c.start(inputs[:1], outs[:1], ranks=[0])
    with pytest.raises(LocalProtocolError, match="state busy"):
        c.workers[0].start_allreduce(inputs[0], outs[0], c.fabric.now)
    assert c.workers[0].state is WorkerState.BUSY
    (s1,) = c.start(inputs[1:], outs[1:], ranks=[1])
    c.wait([s0, s1])
    assert_allreduce_ok(outs, inputs, 4)
    assert c.workers[0].counters["operations_completed"] == 1


def test_start_before_join_raises() -> None:
    c = MemoryCluster(num_workers=2, window=2, elements_per_packet=4)
    x = np.ones(4, np.float32)
    with pytest.raises(LocalProtocolError, match="state new"):
        c.workers[0].start_allreduce(x, x.copy(), 0.0)
    assert c.workers[0].state is WorkerState.NEW
    assert c.fabric.stats["sent"] == 0
    inputs = make_inputs(2, 9, np.float32, seed=5)
    assert_allreduce_ok(c.allreduce(inputs), inputs, 4)  # joins, then sums


# -- Determinism ------------------------------------------------------------------------------


def _seeded_run(seed: int):
    faults = FaultModel(loss_rate=0.1, duplicate_rate=0.05, reorder_rate=0.2, jitter_s=20e-6)
    c = MemoryCluster(num_workers=3, window=4, elements_per_packet=16, faults=faults, seed=seed)
    outs = []
    for i, (dtype, size) in enumerate(FAULT_OPS):
        outs.append(c.allreduce(make_inputs(3, size, dtype, seed=i)))
    counters = [dict(w.counters) for w in c.workers]
    return dict(c.fabric.stats), c.fabric.now, c.switch.stats(), counters, outs


def test_same_seed_same_run() -> None:
    a, b = _seeded_run(11), _seeded_run(11)
    assert a[0] == b[0]
    assert a[1] == b[1]  # the same virtual end time, exactly
    assert a[2] == b[2]
    assert a[3] == b[3]
    for oa, ob in zip(a[4], b[4]):
        assert all(np.array_equal(x, y) for x, y in zip(oa, ob))
    other = _seeded_run(12)
    assert (other[0], other[1]) != (a[0], a[1])  # the seed really drives the faults


def test_an_operation_that_cannot_be_allocated_changes_nothing(monkeypatch) -> None:
    """Building an operation's arrays can fail (MemoryError): the worker stays ready, its
    sequence number unchanged, so the ranks stay in step and the next operation works."""
    import switchml.protocol.worker as worker_module
    c = MemoryCluster(num_workers=2, window=2, elements_per_packet=4)
    c.join()
    real = worker_module.Operation

    def no_memory(**kwargs):
        raise MemoryError("no room for the operation")

    monkeypatch.setattr(worker_module, "Operation", no_memory)
    (h,) = c.start([np.ones(8, np.float32)], [np.empty(8, np.float32)], ranks=[0])
    assert h.done() and "could not start" in str(h.exception())
    assert c.workers[0].state is WorkerState.READY
    monkeypatch.setattr(worker_module, "Operation", real)
    assert_first_operation_still_works(c)


def test_closing_with_an_operation_in_flight_is_not_a_job_failure() -> None:
    c = MemoryCluster(num_workers=2, window=2, elements_per_packet=4)
    (h,) = c.start([np.ones(64, np.float32)], [np.empty(64, np.float32)], ranks=[0])
    session = c.sessions[0]
    session.close(c.fabric.now)
    assert h.done() and "closed locally" in str(h.exception())
    assert session.error is None
    with pytest.raises(LocalProtocolError, match="the session is closed"):
        session.submit(np.ones(4, np.float32), now=c.fabric.now)
