"""Hostile input and shared use at the UDP level: exact results or errors, bounded memory."""

from __future__ import annotations

import functools
import socket
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchml.control import new_job_spec
from switchml.protocol.config import SwitchConfig, WorkerConfig
from switchml.protocol.wire import HEADER
from switchml.transport.udp import SwitchServer, WorkerClient

SECRET = b"a-test-secret-of-enough-bytes"


@pytest.fixture(scope="module")
def server():
    with SwitchServer(port=0, config=SwitchConfig(secret=SECRET, pool_slots=64)) as s:
        yield s


def _rank_mains(server, spec, rounds, results, key, *, misbehave=None, op_timeout_s=20.0):
    """For every rank of ``spec``, a function running ``rounds`` int32 all-reduces."""
    def rank_main(r):
        try:
            cfg = WorkerConfig(secret=SECRET, op_timeout_s=op_timeout_s)
            with WorkerClient(server.address, spec, r, cfg) as w:
                outs = []
                for i in range(rounds):
                    if misbehave is not None and r == 0:
                        misbehave(w, i)
                    x = np.full(30_000, (i + 1) * (r + 1), np.int32)
                    outs.append(w.allreduce(x).copy())
                results[(key, r)] = outs
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[(key, r)] = exc
    return [functools.partial(rank_main, r) for r in range(spec.num_workers)]


@pytest.mark.slow
def test_misbehaving_job_never_changes_another_jobs_results(server, run_threads):
    """Job A's rank 0 floods the switch with its own replayed, re-ranked and re-slotted
    requests (valid token!) between operations; job B's sums stay exact."""
    a = new_job_spec(2, window=4, elements_per_packet=4096)
    b = new_job_spec(3, window=4, elements_per_packet=4096)
    flood_socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def misbehave(w, i):
        # From its own socket (the right source address): old operations, other ranks, slots
        # outside its range (B's slots sit right after A's), oversized counts.
        base = w.endpoint.slot_base
        for seq in range(max(0, i - 3), i + 1):
            for slot in range(max(0, base - 2), base + 12):
                for rank in (0, 1, 2, 7):
                    payload = np.full(256, 10**6, "<i4").tobytes()
                    hdr = HEADER.pack(0x4D53, 1, 1, 2, seq % 2, rank, a.job_id, a.token, seq,
                                      seq, slot, 256, 1, 0, 0, 0)
                    w.sock.send(hdr + payload)
                    flood_socket.sendto(hdr + payload, server.address)  # wrong source

    results: dict = {}
    # (A's own operations may end in an error under its flood, which the test allows: within
    # 5 s, not the 20 s B's get.)
    mains = (_rank_mains(server, a, 6, results, "a", misbehave=misbehave, op_timeout_s=5.0)
             + _rank_mains(server, b, 12, results, "b"))
    run_threads(lambda i: mains[i](), len(mains), 120)
    flood_socket.close()
    for r in range(3):
        outs = results[("b", r)]
        assert not isinstance(outs, Exception), outs
        for i, o in enumerate(outs):
            assert np.array_equal(o, np.full(30_000, (i + 1) * 6, np.int32)), (r, i)
    # A's own results: exact or an error, never a wrong sum.
    for r in range(2):
        outs = results[("a", r)]
        if not isinstance(outs, Exception):
            for i, o in enumerate(outs):
                assert np.array_equal(o, np.full(30_000, (i + 1) * 3, np.int32))
    st_ = server.stats()
    assert st_["internal_errors"] == 0
    assert st_["drops"].get("bad_slot", 0) + st_["drops"].get("bad_rank", 0) > 0


@settings(derandomize=True, max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.binary(max_size=2000),
    st.builds(lambda t, f, s, r, j, tok, seq, c, slot, cnt, e, pad: HEADER.pack(
        0x4D53, 1, t, f, s, r, j, tok, seq, c, slot, cnt, e, 0, 0, 0) + pad,
        st.sampled_from([1, 2, 3, 4, 18, 19, 20, 21, 22, 31, 99]), st.integers(0, 255),
        st.integers(0, 1), st.integers(0, 65535), st.integers(0, 2**32 - 1),
        st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
        st.integers(0, 2**32 - 1), st.integers(0, 65535), st.integers(0, 3),
        st.binary(max_size=300)),
    st.builds(lambda n, w, k, job, tok: HEADER.pack(
        0x4D53, 1, 18, 0, 0, 0, job, tok, 0, 0, 0, 16, 0, 0, 0, 0)
        + struct.pack("<IIII", n, w, k, 0),
        st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
        st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)),
))
def test_udp_fuzz_never_crashes_or_grows_the_switch(server, data):
    _send_and_wait_handled(server, [data])
    st_ = server.stats()
    assert st_["internal_errors"] == 0
    assert st_["memory_bytes"] <= 64 * 2 * (40 + 4 * 16366)  # bounded by the pool


def _send_and_wait_handled(server, datagrams: list[bytes], timeout_s: float = 5.0) -> None:
    """Send ``datagrams`` to the switch and return once its I/O thread has taken them all
    (its ``packets_in`` counts every datagram, an empty one included)."""
    before = server.stats()["packets_in"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for d in datagrams:
            s.sendto(d, server.address)
    deadline = time.monotonic() + timeout_s
    while server.stats()["packets_in"] < before + len(datagrams):
        assert time.monotonic() < deadline, "the switch did not take the datagrams in time"
        time.sleep(0.005)


def test_switch_still_serves_after_the_fuzzing(server, run_threads):
    """On its own too: a seeded batch of the fuzz's shapes first, whichever tests ran before."""
    rng = np.random.default_rng(7)
    junk = [rng.bytes(int(n)) for n in rng.integers(0, 2000, 100)]
    junk += [HEADER.pack(0x4D53, 1, int(t) % 256, 0, 0, int(r), int(j), 0, 0, 0, 0, 16, 1, 0, 0, 0)
             + rng.bytes(64) for t, r, j in rng.integers(0, 2**16, (100, 3))]
    _send_and_wait_handled(server, junk)
    assert server.stats()["internal_errors"] == 0
    spec = new_job_spec(2, window=4, elements_per_packet=1024)
    results: dict = {}
    mains = _rank_mains(server, spec, 3, results, "after")
    run_threads(lambda i: mains[i](), len(mains), 60)
    for r in range(2):
        assert [o[0] for o in results[("after", r)]] == [3, 6, 9]
    assert server.stats()["internal_errors"] == 0
