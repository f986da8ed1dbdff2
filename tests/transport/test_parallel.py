"""One rank over several I/O threads (transport/parallel.py) against a real switch on loopback:
exact sums, results bit-identical to one thread's, the thread count's choice, failures."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from switchml.control import new_job_spec
from switchml.protocol.config import WorkerConfig
from switchml.protocol.errors import ConfigError, OperationFailed
from switchml.protocol.parts import part_specs
from switchml.protocol.quantize import error_bound
from switchml.transport.parallel import ParallelClient, choose_threads, open_worker
from switchml.transport.udp import SwitchServer, WorkerClient


@pytest.fixture(scope="module")
def server():
    with SwitchServer(host="127.0.0.1", port=0) as s:
        yield s


def _ranks(server, spec, threads, work, config=None):
    """Run ``work(client, rank)`` on every rank of ``spec`` at once; return what each gave."""
    out, errors = [None] * spec.num_workers, []

    def rank(r):
        try:
            with open_worker(server.address, spec, r, config, threads=threads) as c:
                out[r] = work(c, r)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(spec.num_workers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def _inputs(n, size, seed=3):
    rng = np.random.default_rng(seed)
    # magnitudes over many binades, so that every block has its own exponent
    return [(rng.standard_normal(size) * np.exp(rng.uniform(-12, 12, size))).astype(np.float32)
            for _ in range(n)]


@pytest.mark.parametrize("threads", [2, 3])
def test_int32_sums_are_exact(server, threads):
    spec = new_job_spec(3, window=4, elements_per_packet=100)
    rng = np.random.default_rng(1)
    xs = [rng.integers(-2**20, 2**20, 12_345, dtype=np.int32) for _ in range(3)]
    got = _ranks(server, spec, threads, lambda c, r: c.allreduce(xs[r]))
    expected = np.sum(xs, axis=0, dtype=np.int64).astype(np.int32)
    for g in got:
        np.testing.assert_array_equal(g, expected)


def test_float_results_are_bit_identical_to_one_threads(server):
    """Every part starts on a block boundary, so every block exponent, and every bit of the
    sum, is what one thread gets; the sum is within the quantization bound of float64's."""
    size = 50_003
    xs = _inputs(2, size)
    residual_seed = _inputs(2, size, seed=9)

    def work(c, r):
        res = residual_seed[r] * np.float32(1e-6)
        return (c.allreduce(xs[r]), c.allreduce(xs[r], bits=16, residual=res), res)

    results = {}
    for threads in (1, 2, 3):
        spec = new_job_spec(2, window=8, elements_per_packet=256)
        results[threads] = _ranks(server, spec, threads, work)
    exact = xs[0].astype(np.float64) + xs[1]
    for threads in (2, 3):
        for rank in range(2):
            for one, many in zip(results[1][rank], results[threads][rank]):
                assert one.view(np.uint32).tobytes() == many.view(np.uint32).tobytes()
    # The bound, by hand: a block's exponent e has max|x| < 2**e over both ranks' inputs
    # (frexp's), each rank rounds by at most half a step, then float32 rounds the sum once.
    whole = size // 256 * 256
    peak = np.maximum(np.abs(xs[0][:whole]), np.abs(xs[1][:whole])).reshape(-1, 256).max(axis=1)
    bound = np.array([error_bound(int(e), 2) for e in np.frexp(peak.astype(np.float64))[1]])
    got = results[2][0][0][:whole].astype(np.float64)
    err = np.abs(got - exact[:whole]).reshape(-1, 256)
    slack = np.spacing(np.abs(got).astype(np.float32)).reshape(-1, 256)  # final rounding
    assert np.all(err <= bound[:, None] + slack)

def test_each_part_is_a_job_on_the_switch(server):
    spec = new_job_spec(2, window=6, elements_per_packet=64)
    ids = {p.job_id for p in part_specs(spec, 3)}

    def work(c, r):
        c.allreduce(np.ones(10_000, np.float32))
        return set(server.stats()["elements_aggregated"]) & ids, c.counters

    (seen, counters), _ = _ranks(server, spec, 3, work)
    assert seen == ids
    assert counters["threads"] == 3
    assert counters["packets_sent"] >= -(-10_000 // 64)


def test_a_small_operation_stays_on_one_part(server):
    spec = new_job_spec(2, window=8, elements_per_packet=64)

    def work(c, r):
        got = c.allreduce(np.full(300, r + 1, np.float32))  # 5 blocks < 2 part windows of 4
        return got, [p.counters.get("packets_sent", 0) for p in c.parts]

    (got, sent), _ = _ranks(server, spec, 2, work)
    np.testing.assert_array_equal(got, np.full(300, 3, np.float32))
    assert sent[0] > 0 and sent[1] == 0


def test_a_rank_that_leaves_fails_the_others_operation_in_bounded_time(server):
    spec = new_job_spec(2, window=4, elements_per_packet=64)
    config = WorkerConfig(op_timeout_s=1.0, max_rto_s=0.5, max_restarts=0)
    left = threading.Event()

    def work(c, r):
        c.allreduce(np.ones(2_000, np.float32))
        if r == 1:
            left.set()
            return None
        left.wait(10)
        time.sleep(0.3)  # rank 1 has left
        t0 = time.monotonic()
        with pytest.raises(OperationFailed):
            c.allreduce(np.ones(2_000, np.float32))
        return time.monotonic() - t0

    took = _ranks(server, spec, 2, work, config)[0]
    assert took < config.op_timeout_s + 5


def test_thread_count_choice():
    loop = ("127.0.0.1", 9)
    assert choose_threads(loop) == 1  # loopback: no line rate to plan for
    assert choose_threads(loop, requested=3) == 3
    assert choose_threads(loop, WorkerConfig(threads=2)) == 2
    assert choose_threads(loop, WorkerConfig(threads=2), requested=4) == 4
    # 10 Gbit/s = 312.5 M elements/s at 7.4 ns each = 2.3 cores, at 80% each: 3 threads
    cost = {"ns_per_element": 7.4}
    assert choose_threads(loop, rate_bps=10e9, cores=16, **cost) == 3
    assert choose_threads(loop, rate_bps=100e9, cores=16, **cost) == 16  # capped by the cores
    assert choose_threads(loop, rate_bps=100e9, cores=16, local_ranks=8, **cost) == 2
    assert choose_threads(loop, rate_bps=1e9, cores=16, **cost) == 1
    # by default, this machine's calibrated cost: some thread count, within the cores
    assert 1 <= choose_threads(loop, rate_bps=100e9, cores=4) <= 4
    with pytest.raises(ConfigError, match="threads must be an integer in 1..64"):
        choose_threads(loop, requested=0)
    with pytest.raises(ConfigError, match="threads must be None or an integer"):
        WorkerConfig(threads=65)


def test_open_worker_gives_a_plain_client_for_one_thread(server):
    spec = new_job_spec(1, window=4, elements_per_packet=64)
    with open_worker(server.address, spec, 0, threads=1) as c:
        assert type(c) is WorkerClient
    with open_worker(server.address, spec, 0, threads=2) as c:
        assert isinstance(c, ParallelClient) and len(c.parts) == 2
        np.testing.assert_array_equal(c.allreduce(np.arange(1000, dtype=np.int32)),
                                      np.arange(1000, dtype=np.int32))


def test_catch_up_is_all_parts_or_none(server):
    """A rank of a quorum job over two I/O threads: when one part refuses to fall back to a
    live rank's position, the part that had fallen back resumes where it stood (it could
    not run another all-reduce otherwise), and the refusal is raised."""
    from switchml.protocol.errors import LocalProtocolError
    spec = new_job_spec(2, window=4, elements_per_packet=100, quorum=2)

    def work(c, r):
        c.allreduce(np.ones(5_000, np.float32))
        if r == 0:
            def refuse():
                raise LocalProtocolError("part 1 refuses")
            c.parts[1].catch_up = refuse
            with pytest.raises(LocalProtocolError, match="part 1 refuses"):
                c.catch_up()
            c.parts[0].position()  # (raises for a part that fell back and did not resume)
        return c.allreduce(np.full(5_000, 2.0, np.float32))

    got = _ranks(server, spec, 2, work)
    assert all((g == 4.0).all() for g in got)
