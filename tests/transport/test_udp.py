"""The UDP path end to end: switch server, worker clients in several processes, failures."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import socket
import time

import numpy as np
import pytest
import udp_procs

from switchml.control import encode_job_spec, new_job_spec
from switchml.protocol.config import WorkerConfig
from switchml.protocol.errors import LocalProtocolError, OperationFailed, SwitchMLError
from switchml.protocol.wire import HEADER_SIZE, Header, MessageType, pack_header
from switchml.transport.udp import SwitchServer, WorkerClient

CTX = mp.get_context("spawn")


@pytest.fixture
def server():
    with SwitchServer(host="127.0.0.1", port=0) as s:
        yield s


def _run_job(server, n, numel, dtype, ops, *, window=8, k=4096):
    spec = encode_job_spec(new_job_spec(n, window=window, elements_per_packet=k))
    q = CTX.Queue()
    procs = [CTX.Process(target=udp_procs.allreduce_worker,
                         args=(server.address, spec, r, numel, dtype, ops, q))
             for r in range(n)]
    for p in procs:
        p.start()
    return procs, q


def _collect(procs, q, n, timeout=120):
    rows = [q.get(timeout=timeout) for _ in range(n)]
    for p in procs:
        p.join(timeout=30)
    return sorted(rows, key=lambda r: r[0])


def _check(rows, n, numel, dtype, ops):
    for rank, _outs, _counters, err in rows:
        assert err is None, f"rank {rank}: {err}"
    for op in range(ops):
        ref = np.sum([udp_procs.rank_input(r, numel, dtype, op).astype(np.float64)
                      for r in range(n)], axis=0)
        first = rows[0][1][op]
        for _rank, outs, _c, _e in rows:
            assert np.array_equal(outs[op], first), "ranks disagree"
        if np.dtype(dtype).kind == "i":
            assert np.array_equal(first, ref.astype(dtype))
        else:
            tol = np.max(np.abs(ref)) * 2.0**-20 + 1e-30
            assert np.max(np.abs(first.astype(np.float64) - ref)) <= tol


@pytest.mark.parametrize("n,dtype", [(2, "float32"), (3, "int32"), (4, "float64")])
def test_processes_allreduce_over_udp(server, n, dtype):
    numel, ops = 300_001, 3
    procs, q = _run_job(server, n, numel, dtype, ops)
    rows = _collect(procs, q, n)
    _check(rows, n, numel, dtype, ops)
    assert server.stats()["internal_errors"] == 0


def test_two_concurrent_jobs_are_isolated(server):
    numel, ops = 200_000, 4
    a = _run_job(server, 2, numel, "float32", ops)
    b = _run_job(server, 3, numel, "int32", ops)
    rows_a = _collect(*a, 2)
    rows_b = _collect(*b, 3)
    _check(rows_a, 2, numel, "float32", ops)
    _check(rows_b, 3, numel, "int32", ops)
    # Both jobs left: their slots are back in the pool.
    deadline = time.monotonic() + 5
    while server.stats()["jobs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stats()["slots_in_use"] == 0


@pytest.mark.slow
def test_dead_worker_fails_the_others_in_bounded_time(server):
    n, op_timeout = 3, 2.0
    spec = encode_job_spec(new_job_spec(n, window=8, elements_per_packet=4096))
    q = CTX.Queue()
    procs = [CTX.Process(target=udp_procs.dying_worker,
                         args=(server.address, spec, r, 1, op_timeout, q)) for r in range(n)]
    for p in procs:
        p.start()
    rows = sorted([q.get(timeout=60) for _ in range(n - 1)])
    for p in procs:
        p.join(timeout=30)
    assert [r[0] for r in rows] == [0, 2]
    for _rank, outcome, seconds in rows:
        assert outcome.startswith("OperationFailed"), outcome
        assert "rank(s) [1]" in outcome, outcome
        assert seconds < op_timeout + 3.0


def test_switch_gone_fails_in_bounded_time():
    srv = SwitchServer(port=0).start()
    spec = new_job_spec(1, window=4, elements_per_packet=1024)
    w = WorkerClient(srv.address, spec, 0, WorkerConfig(op_timeout_s=1.5, max_rto_s=0.3))
    assert np.array_equal(w.allreduce(np.arange(10, dtype=np.int32)), np.arange(10))
    srv.stop()
    t0 = time.monotonic()
    with pytest.raises(OperationFailed, match="switch at 127.0.0.1"):
        w.allreduce(np.ones(100_000, np.float32))
    assert time.monotonic() - t0 < 4.0
    with pytest.raises(LocalProtocolError, match="failed earlier"):
        w.allreduce_async(np.ones(10, np.float32))
    w.close()


def test_join_without_switch_fails_with_clear_error():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(OperationFailed, match=f"127.0.0.1:{port}"):
        WorkerClient(("127.0.0.1", port), new_job_spec(2), 0, WorkerConfig(join_timeout_s=1.0))
    assert time.monotonic() - t0 < 5.0


@pytest.mark.parametrize("host", ["nosuchhost.invalid", "::1", "[::1]"])
def test_a_switch_host_that_does_not_resolve_to_ipv4_is_named(host):
    import re

    from switchml.protocol.errors import ConfigError
    with pytest.raises(ConfigError, match=f"can't resolve the switch host '{re.escape(host)}' "
                                          "to an IPv4 address .*dotted IPv4 address"):
        WorkerClient((host, 9), new_job_spec(2), 0)


@pytest.mark.parametrize("switch, spec, rank, config, message", [
    (("127.0.0.1", 1), new_job_spec(2), "0", None, "rank must be an integer, got '0'"),
    (("127.0.0.1", "x"), new_job_spec(2), 0, None, r"with a port 0\.\.65535, got \('127"),
    ("127.0.0.1:1", new_job_spec(2), 0, None, "got the string '127.0.0.1:1'"),
    (("127.0.0.1", 70000), new_job_spec(2), 0, None, "with a port 0..65535"),
    (("127.0.0.1", 1), None, 0, None, "spec must be a JobSpec, got NoneType"),
    (("127.0.0.1", 1), new_job_spec(2), 0, {"secret": b"x"},
     "config must be a WorkerConfig or None, got dict"),
])
def test_a_worker_given_the_wrong_kind_of_argument_says_which(switch, spec, rank, config,
                                                              message):
    with pytest.raises(SwitchMLError, match=message):
        WorkerClient(switch, spec, rank, config)


def test_a_client_of_a_default_spec_sends_datagrams_that_fit_the_path(server):
    """The WorkerClient's own docstring example: ``new_job_spec(n)`` without a chunk size sends
    datagrams that fit an Ethernet MTU (it sent 64 KB datagrams, fragmented by IP on any path
    but loopback); given the switch, chunks fit this host's path to it (loopback: 64 KB)."""
    for spec, mtu in ((new_job_spec(1), 1500),
                      (new_job_spec(1, switch=server.address), 65536)):
        with WorkerClient(server.address, spec, 0) as w:
            x = np.arange(50_000, dtype=np.float32)
            assert np.array_equal(w.allreduce(x), x)
            c = w.counters
        largest = 20 + 8 + HEADER_SIZE + 4 * spec.elements_per_packet
        assert largest <= mtu
        assert c["payload_bytes_sent"] <= c["packets_sent"] * 4 * spec.elements_per_packet


def test_async_handles_and_argument_errors(server):
    spec = new_job_spec(1, window=4, elements_per_packet=1000)
    with WorkerClient(server.address, spec, 0) as w:
        xs = [np.full(5000, i, np.float32) for i in range(5)]
        handles = [w.allreduce_async(x) for x in xs]
        for i, h in enumerate(handles):
            assert np.array_equal(h.wait(timeout=30), xs[i])
        # non-contiguous input and output views work (copied internally)
        base = np.arange(20, dtype=np.int32)
        out = np.zeros(20, np.int32)
        w.allreduce(base[::2], out[::2])
        assert np.array_equal(out[::2], base[::2])
        with pytest.raises(LocalProtocolError, match="unsupported dtype"):
            w.allreduce(np.ones(3, np.int64))
        with pytest.raises(LocalProtocolError, match="out must match"):
            w.allreduce(np.ones(3, np.float32), np.ones(4, np.float32))
        sent = w.counters["packets_sent"]
        read_only = np.frombuffer(bytes(40), np.float32)  # refused before anything is sent
        with pytest.raises(LocalProtocolError, match="out is read-only"):
            w.allreduce(np.ones(10, np.float32), read_only)
        assert w.counters["packets_sent"] == sent
        x = np.ones(10, np.float32)
        w.allreduce(x, x)  # in place
        assert np.array_equal(x, np.ones(10, np.float32))
    with pytest.raises(LocalProtocolError, match="closed"):
        w.allreduce(np.ones(3, np.float32))


def test_switch_survives_garbage_datagrams(server, run_threads):
    rng = random.Random(1234)
    spec = new_job_spec(2, window=4, elements_per_packet=512)
    valid = pack_header(Header(MessageType.REQUEST, spec.job_id, count=0))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(3000):
            kind = i % 3
            if kind == 0:
                data = rng.randbytes(rng.randrange(0, 2000))
            elif kind == 1:
                data = valid[: rng.randrange(0, HEADER_SIZE)]
            else:
                b = bytearray(valid + rng.randbytes(rng.randrange(0, 64)))
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
                data = bytes(b)
            s.sendto(data, server.address)
    # Still serving: a real job completes.
    results = {}

    def run(rank):
        with WorkerClient(server.address, spec, rank) as w:
            results[rank] = w.allreduce(np.full(10_000, rank + 1, np.int32))

    run_threads(run, 2, 60)
    assert all(np.array_equal(results[r], np.full(10_000, 3, np.int32)) for r in range(2))
    stats = server.stats()
    assert stats["internal_errors"] == 0
    assert sum(stats["drops"].values()) >= 2900


def test_switch_command_logs_exports_metrics_and_stops_on_sigterm(
        free_port, start_switchml, run_switchml):
    metrics = free_port()
    proc = start_switchml("switch", "--port", "0", "--metrics-port", str(metrics))
    line = proc.stdout.readline()
    assert "listening on udp 127.0.0.1:" in line
    port = int(line.rsplit(":", 1)[1])
    spec = new_job_spec(1, window=2, elements_per_packet=256)
    with WorkerClient(("127.0.0.1", port), spec, 0) as w:
        assert np.array_equal(w.allreduce(np.arange(7, dtype=np.int32)), np.arange(7))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"junk", ("127.0.0.1", port))
        url = f"http://127.0.0.1:{metrics}/metrics"
        from switchml.control.metrics import read_metrics
        deadline = time.monotonic() + 10  # the switch takes the junk datagram when it runs
        while "short" not in (m := read_metrics(url)).get("switchml_drops_total", {}):
            assert time.monotonic() < deadline, f"the junk datagram was never counted: {m}"
            time.sleep(0.05)
        assert m["switchml_jobs"] == 1
        assert m["switchml_elements_aggregated_total"] == {str(spec.job_id): 7}
        assert m["switchml_drops_total"]["short"] == 1
        assert m["switchml_packets_in_total"] >= 3
        res = run_switchml("stats", "--once", "--url", url, timeout=30)
        assert res.returncode == 0, res.stderr
        assert f"job {spec.job_id} elements" in res.stdout and "drops: short" in res.stdout
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert "SIGTERM received" in err and "stopped" in err
    assert f"event=job_created job={spec.job_id}" in err
    assert f"event=job_finished job={spec.job_id}" in err


def test_switch_command_refuses_exposure_without_a_secret(run_switchml):
    res = run_switchml("switch", "--host", "0.0.0.0", "--port", "0", "--metrics-port", "0",
                       timeout=30,
                       env={k: v for k, v in os.environ.items() if k != "SWITCHML_SECRET"})
    assert res.returncode == 2
    assert "--secret-file" in res.stderr


def test_a_switch_built_as_a_library_refuses_exposure_without_a_secret():
    """The same rule as the command's, for ``SwitchServer`` used directly (it once skipped
    it)."""
    from switchml.protocol.config import SwitchConfig
    from switchml.protocol.errors import TransportError
    with pytest.raises(TransportError, match=r"0\.0\.0\.0 without a secret.*insecure=True"):
        SwitchServer(host="0.0.0.0", port=0)
    for ok in (dict(config=SwitchConfig(secret=b"s" * 32)), dict(insecure=True)):
        with SwitchServer(host="0.0.0.0", port=0, **ok) as srv:
            assert srv.address[0] == "0.0.0.0"
    with SwitchServer(host="localhost", port=0):
        pass


def test_stats_without_a_switch_says_so(free_port, run_switchml):
    port = free_port()
    res = run_switchml("stats", "--once", "--url", f"http://127.0.0.1:{port}/metrics",
                       timeout=30)
    assert res.returncode == 2 and "is a switch running" in res.stderr


def test_switch_command_reports_port_in_use(run_switchml):
    with SwitchServer(port=0) as srv:
        res = run_switchml("switch", "--port", str(srv.address[1]), "--metrics-port", "0",
                           timeout=30, env={**os.environ})
    assert res.returncode == 2
    assert "can't listen on" in res.stderr


def test_switch_command_says_whether_it_batches_and_no_batching_turns_it_off(start_switchml):
    from switchml.transport.batching import gso_supported, recvmmsg_supported
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        default = ("GSO on, receive " + ("recvmmsg" if recvmmsg_supported() else "GRO")
                   if gso_supported(s) else "GSO off")
    for flags, expect in (([], default),
                          (["--no-batching"], "GSO off, receive one datagram per call")):
        proc = start_switchml("switch", "--port", "0", "--metrics-port", "0", *flags)
        assert "listening on udp" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0
        assert expect in err, err


def test_a_full_wake_up_pipe_never_blocks_a_caller_or_deadlocks_a_callback():
    """While a slow done-callback holds the I/O thread, other threads keep submitting (more
    than the wake-up pipe holds); then the callback closes the client. Nobody blocks for good,
    and every handle ends (completed or failed)."""
    import threading
    with SwitchServer(port=0) as srv:
        c = WorkerClient(srv.address, new_job_spec(1, window=2, elements_per_packet=64), 0)
        release, closed = threading.Event(), threading.Event()

        def slow_then_close(_h):
            release.wait(20)
            c.close()  # needs the submit lock that a blocked writer would hold
            closed.set()

        first = c.allreduce_async(np.ones(4, np.float32))
        first.add_done_callback(slow_then_close)
        handles = []

        def flood():
            x = np.ones(1, np.float32)
            for _ in range(70_000):  # more wake-ups than a 64 KiB pipe holds
                try:
                    handles.append(c.allreduce_async(x))
                except LocalProtocolError:
                    return  # closed
        t = threading.Thread(target=flood, daemon=True)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive(), "a submitting thread blocked on the wake-up pipe"
        release.set()
        assert closed.wait(20), "the callback could not close the client"
        first.wait(timeout=5)
        for h in handles:  # every handle ends: a result or an error, never a hang
            try:
                h.wait(timeout=20)
            except SwitchMLError:
                pass


@pytest.mark.slow
def test_a_worker_says_at_once_when_nothing_listens_at_the_switch_address(caplog):
    """ICMP port unreachable comes back from the first JOIN: the worker warns within seconds,
    naming the address, and still fails only at its join timeout."""
    import logging
    import time

    from switchml.control import new_job_spec
    from switchml.protocol.config import WorkerConfig
    from switchml.protocol.errors import OperationFailed
    from switchml.transport.udp import WorkerClient
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    caplog.set_level(logging.WARNING, logger="switchml.transport.udp")
    t0 = time.time()
    with pytest.raises(OperationFailed, match="ICMP port-unreachable"):
        WorkerClient(("127.0.0.1", port), new_job_spec(1), 0,
                     WorkerConfig(join_timeout_s=4.0))
    assert time.time() - t0 >= 3.9  # the timeout semantics are kept
    warnings = [r for r in caplog.records if "nothing listens" in r.getMessage()]
    assert warnings and f"127.0.0.1:{port}" in warnings[0].getMessage()
    assert warnings[0].created - t0 < 2.0  # long before the timeout, with room for a slow CI
