"""Nobody without the job's credentials joins, reads or feeds a parameter server or a Gaia
leader; hostile messages from anyone are refused with a logged reason, never crash a server
or a leader, and never change state (issue: JOIN replay and authenticated links)."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchml.gaia.mirror import HELLO_TIMEOUT_S, GaiaError, Mirror
from switchml.gaia.rules import encode_announce, encode_sparse
from switchml.links import LinkSecurity, check_exposure, issue_credentials, make_credentials
from switchml.protocol.errors import ConfigError
from switchml.ps.client import PSClient
from switchml.ps.placement import place
from switchml.ps.server import ParameterServer, ServerConfig
from switchml.ps.wire import HEADER, MAGIC, MessageType, PSError, recv_message, send_message


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> LinkSecurity:
    return make_credentials(tmp_path_factory.mktemp("tls") / "job")


@pytest.fixture(scope="module")
def other_creds(tmp_path_factory) -> LinkSecurity:
    """A valid certificate of another CA: a peer of some other job."""
    return make_credentials(tmp_path_factory.mktemp("tls") / "other")


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> dict[tuple[str, int], LinkSecurity]:
    """Certificates of their own (``switchml tls issue``), each naming one peer, from one CA."""
    d = tmp_path_factory.mktemp("tls") / "own"
    shared = make_credentials(d)
    return {(role, i): issue_credentials(d, role, i)
            for role in ("worker", "server", "dc") for i in range(2)} | {("shared", 0): shared}


def _sum_two(server: ParameterServer, security: LinkSecurity | None | list) -> np.ndarray:
    """Two workers push one vector each through ``server`` and pull the sum (``security``:
    both workers', or one per worker)."""
    shards = place([("x", 6)], 1, max_shard_elements=6)
    out = {}

    def worker(w: int) -> None:
        c = PSClient([server.address], worker=w, workers=2, timeout_s=10,
                     security=security[w] if isinstance(security, list) else security)
        if w == 0:
            c.init(shards, {0: np.zeros(6, np.float32)})
        c.push(shards, 0, {0: np.full(6, w + 1.0, np.float32)})
        buf = {0: np.empty(6, np.float32)}
        c.pull(shards, 1, buf)
        out[w] = buf[0]
        c.close()

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert out[0].tolist() == out[1].tolist()
    return out[0]


def _sum_server(**kw) -> ParameterServer:
    return ParameterServer(0, ServerConfig(workers=2, optimizer="sum", timeout_s=10), **kw)


def test_workers_with_the_jobs_certificate_sum_over_tls(creds):
    with _sum_server(security=creds) as server:
        assert _sum_two(server, creds).tolist() == [3.0] * 6
        assert server.stats()["refused_connections"] == 0


def test_strangers_cannot_connect_to_a_tls_server_or_change_it(creds, other_creds):
    with _sum_server(security=creds) as server:
        # Plain TCP, speaking the protocol: the handshake fails; nothing was read as a message.
        s = socket.create_connection(server.address, timeout=5)
        with pytest.raises((ConnectionError, OSError)):  # reset, at a send or the read
            send_message(s, MessageType.HELLO, worker=0, payload=b"{}")
            send_message(s, MessageType.INIT, worker=0, shard=0,
                         payload=np.full(6, 666.0, np.float32))
            while s.recv(4096):
                pass
            raise ConnectionError("closed")  # (an orderly close is a refusal too)
        s.close()
        # A certificate of another CA, and a client without one.
        with pytest.raises(PSError, match="TLS with parameter server"):
            PSClient([server.address], worker=0, workers=2, security=other_creds,
                     timeout_s=5, connect_timeout_s=5)
        with pytest.raises(PSError):
            PSClient([server.address], worker=1, workers=2, timeout_s=3, connect_timeout_s=3)
        deadline = time.monotonic() + 5
        while server.stats()["refused_connections"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        st = server.stats()
        assert st["refused_connections"] == 3 and st["shards"] == 0 and st["dead_workers"] == {}
        # The job itself is untouched: its sum is right (the stranger's 666 never landed).
        assert _sum_two(server, creds).tolist() == [3.0] * 6


def test_a_worker_with_its_own_certificate_is_held_to_its_id(own):
    """Workers and a shard with certificates of their own sum as before; a worker that says
    HELLO under another worker's id than its certificate names is refused with the reason,
    and so is a shard whose certificate names another shard; the shared certificate, which
    names nobody, still works beside them."""
    with _sum_server(security=own["server", 0]) as server:
        assert _sum_two(server, [own["worker", 0], own["worker", 1]]).tolist() == [3.0] * 6
        with pytest.raises(PSError, match="a HELLO as worker 0, but its certificate names "
                                          "worker 1, not worker 0"):
            PSClient([server.address], worker=0, workers=2, security=own["worker", 1],
                     timeout_s=5, connect_timeout_s=5)
        with pytest.raises(PSError, match="names dc 0, not worker 1"):
            PSClient([server.address], worker=1, workers=2, security=own["dc", 0],
                     timeout_s=5, connect_timeout_s=5)
        assert server.stats()["shards"] == 1 and server.stats()["dead_workers"] == {}
        assert _sum_two(server, [own["shared", 0], own["worker", 1]]).tolist() == [3.0] * 6
    with _sum_server(security=own["server", 1]) as server:  # shard 1's, serving shard 0
        with pytest.raises(PSError, match="is not shard 0: its certificate names server 1"):
            PSClient([server.address], worker=0, workers=2, security=own["worker", 0],
                     timeout_s=5, connect_timeout_s=5)


def test_a_data_centre_with_its_own_certificate_is_held_to_its_id(free_ports, own):
    """Gaia leaders with certificates of their own: a peer whose certificate names worker 0
    says HELLO as data centre 1 and is refused (the leader goes on, and data centre 1's real
    leader links after it); a leader that holds data centre 1's certificate as data centre 0
    is refused by the other leader's link to it, naming it."""
    leaders = [("127.0.0.1", p) for p in free_ports(2)]
    m0 = Mirror(dc=0, leaders=leaders, staleness=0, timeout_s=10, security=own["dc", 0])
    m0.listen()
    impostor = own["worker", 0].client_context().wrap_socket(
        socket.create_connection(leaders[0], timeout=5))
    send_message(impostor, MessageType.HELLO, worker=1)
    deadline = time.monotonic() + 5
    while m0.stats()["protocol_errors"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    impostor.close()
    assert m0.stats()["protocol_errors"] == 1
    m1 = Mirror(dc=1, leaders=leaders, staleness=0, timeout_s=10, security=own["dc", 1])
    t = threading.Thread(target=m1.start)
    t.start()
    m0.start()
    t.join(10)
    for m in (m0, m1):
        m.expect_entries(10)
    try:
        assert _exchange_one(m1, m0, [4], [2.0]) == [([4], [2.0])]
    finally:
        m0.close()
        m1.close()

    leaders = [("127.0.0.1", p) for p in free_ports(2)]
    wrong = Mirror(dc=0, leaders=leaders, staleness=0, timeout_s=3, security=own["dc", 1])
    wrong.listen()
    with pytest.raises(GaiaError, match="is not data centre 0: its certificate names dc 1, "
                                        "not dc 0"):
        Mirror(dc=1, leaders=leaders, staleness=0, timeout_s=3,
               security=own["dc", 1]).start()
    wrong.close()


def test_nothing_listens_beyond_loopback_without_credentials(creds):
    with pytest.raises(ConfigError, match="without TLS"):
        _sum_server(host="0.0.0.0")
    with pytest.raises(ConfigError, match="without TLS"):
        Mirror(dc=0, leaders=[("0.0.0.0", 0), ("127.0.0.1", 1)], bind_host="0.0.0.0")
    check_exposure("127.0.0.1", None)  # loopback: allowed
    check_exposure("0.0.0.0", creds)
    _sum_server(host="0.0.0.0", insecure=True).stop()
    with pytest.raises(ConfigError, match="missing"):
        LinkSecurity.from_dir("/nonexistent")


# -- Hostile messages on a plain loopback server ---------------------------------------------


def _raw(server: ParameterServer) -> socket.socket:
    return socket.create_connection(server.address, timeout=5)


def _answer(s: socket.socket) -> tuple[MessageType | None, str]:
    try:
        h, payload = recv_message(s)
    except (ConnectionError, OSError, PSError):
        return None, ""
    return h.type, bytes(payload).decode(errors="replace")


def test_every_rule_breach_is_refused_with_a_reason_and_changes_nothing():
    with _sum_server() as server:
        legit = PSClient([server.address], worker=0, workers=2, timeout_s=10)
        cases = [
            ("INIT before HELLO", [(MessageType.INIT, dict(shard=0, payload=b"\0" * 24))]),
            ("second HELLO", [(MessageType.HELLO, dict(worker=1)),
                              (MessageType.HELLO, dict(worker=1))]),
            ("is already connected", [(MessageType.HELLO, dict(worker=0))]),  # legit's id
            ("out of range", [(MessageType.HELLO, dict(worker=7))]),
            ("float32 values expected", [(MessageType.HELLO, dict(worker=1)),
                                         (MessageType.INIT, dict(shard=3, payload=b"abc"))]),
            ("must be a JSON object", [(MessageType.HELLO, dict(worker=1, payload=b"[1]"))]),
            ("not valid JSON: RecursionError",  # once an uncaught RecursionError, no reply
             [(MessageType.HELLO, dict(worker=1, payload=b"[" * 4000))]),
        ]
        for reason, msgs in cases:
            s = _raw(server)
            for mtype, kw in msgs:
                send_message(s, mtype, **kw)
            answers = [_answer(s) for _ in range(len(msgs))]
            assert any(t is MessageType.ERROR and reason in text for t, text in answers), (
                reason, answers)
            s.close()
        # An absurd announce is refused from its header, before anything is read or allocated.
        s = _raw(server)
        send_message(s, MessageType.HELLO, worker=1)
        assert _answer(s)[0] is MessageType.HELLO
        s.sendall(HEADER.pack(MAGIC, int(MessageType.INIT), 0, 1, 0, 0, 1 << 33))
        t, text = _answer(s)
        assert t is MessageType.ERROR and "at most 1073741824 expected" in text
        s.close()
        st = server.stats()
        assert st["shards"] == 0 and st["protocol_errors"] >= len(cases)
        # Worker 0 stayed connected through all of it. The connections that broke a rule as
        # worker 1 cut it off (nobody waits for a worker that broke the protocol); worker 1
        # reconnecting clears that, and the job's sum is right.
        assert set(server.stats()["dead_workers"]) == {1}
        deadline = time.monotonic() + 5
        while True:  # (the refused connection's thread may still be closing it)
            try:
                other = PSClient([server.address], worker=1, workers=2, timeout_s=10)
                break
            except PSError as exc:
                assert "is already connected" in str(exc) and time.monotonic() < deadline
                time.sleep(0.02)
        assert server.stats()["dead_workers"] == {}
        shards = place([("x", 6)], 1, max_shard_elements=6)
        legit.init(shards, {0: np.zeros(6, np.float32)})
        for w, c in enumerate((legit, other)):
            c.push(shards, 0, {0: np.full(6, w + 1.0, np.float32)})
        for c in (legit, other):
            buf = {0: np.empty(6, np.float32)}
            c.pull(shards, 1, buf)
            assert buf[0].tolist() == [3.0] * 6
            c.close()


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_nothing_is_allocated_for_a_message_before_a_hello():
    """A 24-byte INIT header announcing 1 GiB, before any HELLO, once made the server zero-fill
    1 GiB per connection. Now it is refused from its header; nothing is read."""
    with _sum_server() as server:
        before = _rss()
        for _ in range(3):
            s = _raw(server)
            s.sendall(HEADER.pack(MAGIC, int(MessageType.INIT), 0, 0, 0, 0, 1 << 30))
            t, text = _answer(s)
            assert t is MessageType.ERROR and "INIT before HELLO" in text, (t, text)
            s.close()
        assert _rss() - before < 64 * 2**20
        assert server.stats()["shards"] == 0


_TYPES = st.sampled_from([int(t) for t in MessageType] + [0, 11, 200])


@st.composite
def _message(draw) -> bytes:
    mtype = draw(_TYPES)
    size = draw(st.sampled_from([0, 4, 24, 7, 4096, 5000]))
    payload = draw(st.one_of(st.binary(min_size=size, max_size=size),
                             st.just(json.dumps({"workers": draw(st.integers(0, 3))}).encode())))
    announced = draw(st.sampled_from([len(payload), len(payload), 1 << 20, 1 << 40]))
    magic = draw(st.sampled_from([MAGIC, MAGIC, MAGIC, b"XXXX"]))
    head = HEADER.pack(magic, mtype, draw(st.integers(0, 255)), draw(st.integers(0, 3)),
                       draw(st.integers(0, 3)), draw(st.integers(0, 4)), announced)
    return head + payload[:announced]


@settings(derandomize=True, max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(phase=st.sampled_from(["fresh", "after hello", "after init"]),
       msgs=st.lists(_message(), min_size=1, max_size=4))
def test_fuzzed_messages_never_crash_the_server_or_change_another_workers_state(phase, msgs):
    """Worker 0 runs a job of one shard; a hostile connection in each phase of its own
    (fresh, after a HELLO as worker 1, after an INIT) sends random messages. The server
    survives, and the job's values are exactly what worker 0 set (a hostile INIT can only
    land for a shard nobody initialised, here shard 9, never shard 0). Synchronous steps:
    after a HELLO the connection *is* worker 1 (no secret on loopback), whose well-formed
    PUSH is its part of a step, which never completes without worker 0's; asynchronously it
    would be applied, as it should be."""
    server = ParameterServer(0, ServerConfig(workers=2, mode="sync", optimizer="sum",
                                             timeout_s=0.5)).start()
    try:
        shards = place([("x", 6)], 1, max_shard_elements=6)
        c = PSClient([server.address], worker=0, workers=2, timeout_s=10)
        c.init(shards, {0: np.arange(6, dtype=np.float32)})
        s = _raw(server)
        s.settimeout(2)
        if phase != "fresh":
            send_message(s, MessageType.HELLO, worker=1)
            _answer(s)
        if phase == "after init":
            send_message(s, MessageType.INIT, shard=9, payload=np.zeros(3, np.float32))
        for m in msgs:
            try:
                s.sendall(m)
            except OSError:
                break
        s.close()
        buf = {0: np.empty(6, np.float32)}
        c.pull(shards, 0, buf)  # the server still answers, with worker 0's values
        assert buf[0].tolist() == list(range(6))
        c.close()
    finally:
        server.stop()


# -- Gaia ---------------------------------------------------------------------------------


def _mirrors(free_ports, security=None, timeout_s=10.0):
    leaders = [("127.0.0.1", p) for p in free_ports(2)]
    m1 = Mirror(dc=1, leaders=leaders, staleness=0, timeout_s=timeout_s, security=security)
    t = threading.Thread(target=m1.start)
    t.start()
    m0 = Mirror(dc=0, leaders=leaders, staleness=0, timeout_s=timeout_s,
                security=security).start()
    t.join(10)
    for m in (m0, m1):
        m.expect_entries(10)
    return m0, m1, leaders


def _exchange_one(sender: Mirror, receiver: Mirror, idx: list[int], values: list[float]
                  ) -> list[tuple[list[int], list[float]]]:
    """One clock: ``sender`` publishes ``values`` at ``idx``, ``receiver`` nothing; what
    ``receiver``'s exchange applied, as (indices, values) lists."""
    got: list[tuple[list[int], list[float]]] = []
    sender.clock.finish()
    sender.publish(1, np.array(idx, np.int32), np.array(values, np.float32))
    receiver.clock.finish()
    receiver.publish(1, np.zeros(0, np.int32), np.zeros(0, np.float32))
    receiver.exchange(lambda i, v: got.append((i.tolist(), v.tolist())), everyone=True)
    return got


def test_gaia_leaders_exchange_over_tls_and_refuse_strangers(free_ports, creds, other_creds):
    m0, m1, leaders = _mirrors(free_ports, creds)
    try:
        # A stranger with another CA's certificate, and one speaking plain TCP.
        ctx = other_creds.client_context()
        with pytest.raises((ssl.SSLError, OSError)):
            s = ctx.wrap_socket(socket.create_connection(leaders[0], timeout=5))
            send_message(s, MessageType.HELLO, worker=1)
            s.recv(1)
        s = socket.create_connection(leaders[0], timeout=5)
        send_message(s, MessageType.HELLO, worker=1)
        s.close()
        assert _exchange_one(m1, m0, [2, 5], [0.5, -1.0]) == [([2, 5], [0.5, -1.0])]
        deadline = time.monotonic() + 5
        while m0.stats()["refused_connections"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m0.stats()["refused_connections"] == 2
    finally:
        m0.close()
        m1.close()


def _forge(addr, msgs) -> None:
    s = socket.create_connection(addr, timeout=5)
    for mtype, kw in msgs:
        send_message(s, mtype, **kw)
    time.sleep(0.2)
    s.close()


def _announce(step: int, entries: int, tensors: list[int], count: int = 2) -> tuple:
    """A selective barrier for a model of ``count`` tensors (the forged tests' layout: 4 and 6
    parameters)."""
    return (MessageType.CLOCK, dict(step=step, flags=1, payload=encode_announce(
        entries, np.array(tensors), count)))


def _sparse(step: int, idx: list[int]) -> tuple:
    return (MessageType.SPARSE, dict(step=step, payload=encode_sparse(
        np.array(idx, np.int32), np.ones(len(idx), np.float32))))


@pytest.mark.parametrize("msgs, reason", [
    ([(MessageType.CLOCK, dict(step=5))], "clock 5 after clock 0"),
    ([(MessageType.SPARSE, dict(step=1, payload=b"\0" * 8))], "was not announced"),
    ([_announce(1, 1, [0]), _sparse(1, [99])], "outside the model's 10 parameters"),
    ([_announce(1, 1, [0]), (MessageType.SPARSE, dict(step=1, payload=b"\0" * 7))],
     "8 bytes an entry"),
    ([_announce(1, 10, [0, 1]), (MessageType.SPARSE, dict(step=1, payload=b"\0" * 88))],
     "at most 80 expected"),
    ([_announce(1, 2, [0]), _sparse(1, [1, 7])], "touching a tensor its announce did not"),
    ([(MessageType.CLOCK, dict(step=1, flags=1))], "has 9 bytes, got 0"),
    ([(MessageType.CLOCK, dict(step=1, flags=1, payload=encode_announce(1, np.array([5]), 8)))],
     "a tensor past the model's 2"),
    ([_announce(1, 11, [0])], "an announce of 11 entries for a model of 10"),
    ([_announce(2, 1, [0])], "announce of clock 2 after clock 0"),
    ([_announce(1, 1, [0]), _announce(1, 1, [0])], "announced already"),
    ([_announce(1, 3, [1]), (MessageType.BYE, {})], "a goodbye with 3 entries of clock 1"),
    ([(MessageType.PUSH, dict(step=1))], "unexpected PUSH"),
])
def test_a_data_centre_that_breaks_a_rule_is_named_and_the_leader_survives(free_ports, msgs,
                                                                          reason):
    """Data centre 1's link (plain loopback: it holds the job's standing) sends a forged
    message: data centre 0's exchange fails with a GaiaError naming it and the reason (no
    IndexError or ValueError escapes), and applies nothing."""
    leaders = [("127.0.0.1", p) for p in free_ports(2)]
    m0 = Mirror(dc=0, leaders=leaders, staleness=0, timeout_s=5)
    m0.listen()  # only: the forger plays data centre 1
    m0.expect_layout([4, 6])
    _forge(leaders[0], [(MessageType.HELLO, dict(worker=1))] + msgs)
    applied = []
    m0.clock.finish()
    with pytest.raises(GaiaError, match="data centre 1") as e:
        m0.exchange(lambda i, v: applied.append(i))
    assert reason in str(e.value)
    assert applied == [] and m0.stats()["protocol_errors"] == 1


def test_garbage_before_a_hello_changes_nothing(free_ports):
    """A connection that never says a valid HELLO (or claims this data centre, or one
    already linked) is dropped and logged; the exchange goes on as if it had not been."""
    m0, m1, leaders = _mirrors(free_ports)
    try:
        _forge(leaders[0], [(MessageType.SPARSE, dict(step=1, payload=b"\0" * 8))])
        _forge(leaders[0], [(MessageType.HELLO, dict(worker=0))])  # this data centre
        _forge(leaders[0], [(MessageType.HELLO, dict(worker=1)),  # linked already
                            (MessageType.CLOCK, dict(step=9))])
        s = socket.create_connection(leaders[0], timeout=5)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(20))
        s.close()
        for m in (m0, m1):
            m.clock.finish()
            m.publish(1, np.zeros(0, np.int32), np.zeros(0, np.float32))
        m0.exchange(lambda i, v: None)
        m1.exchange(lambda i, v: None)
        assert m0.stats()["clocks"] == [1, 1]
        deadline = time.monotonic() + 5
        while m0.stats()["protocol_errors"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m0.stats()["protocol_errors"] == 4
    finally:
        m0.close()
        m1.close()


def _hostile_server(answers) -> tuple[socket.socket, threading.Thread]:
    """A fake parameter server on loopback: reads each request header (and its payload), then
    sends the next raw answer of ``answers`` (or calls it with the connection); keeps the
    connection open until the test ends."""
    ls = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = ls.accept()
        with conn:
            for answer in answers:
                try:
                    recv_message(conn)
                    answer(conn) if callable(answer) else conn.sendall(answer)
                except (OSError, PSError):
                    return
            try:
                conn.recv(1)  # (until the client goes)
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return ls, t


def test_a_client_reads_no_more_than_an_answer_can_hold():
    """A server that announces 2 GiB in its HELLO once made the client allocate them (up to
    16 GiB). The client refuses from the header, before reading or allocating anything."""
    before = _rss()
    ls, _ = _hostile_server([HEADER.pack(MAGIC, int(MessageType.HELLO), 0, 0, 0, 0, 1 << 31)])
    with ls, pytest.raises(PSError, match="HELLO of 2147483648 bytes announced; at most 4096"):
        PSClient([ls.getsockname()], worker=0, workers=1, timeout_s=5)
    # A pull's answer is bounded by the shard it fills.
    hello = HEADER.pack(MAGIC, int(MessageType.HELLO), 0, 0, 0, 0, 2) + b"{}"
    params = HEADER.pack(MAGIC, int(MessageType.PARAMS), 0, 0, 0, 1, 1 << 30)
    ls, _ = _hostile_server([hello, params])
    with ls:
        c = PSClient([ls.getsockname()], worker=0, workers=1, timeout_s=5)
        shards = place([("x", 6)], 1, max_shard_elements=6)
        with pytest.raises(PSError, match="at most 4096 expected"):
            c.pull(shards, 1, {0: np.empty(6, np.float32)})
        c.close(bye=False)
    assert _rss() - before < 64 * 2**20


def test_a_server_that_dribbles_its_answer_fails_the_call_in_bounded_time():
    """A pull's answer sent a byte every 0.4 s never lets a 1 s receive time out: the client
    bounds the header by timeout_s and the payload by timeout_s plus its size at
    MIN_ANSWER_BYTES_PER_S, in all. A STATS answer that is not JSON is a PSError too."""
    hello = HEADER.pack(MAGIC, int(MessageType.HELLO), 0, 0, 0, 0, 2) + b"{}"
    stop = threading.Event()

    def dribble(conn: socket.socket) -> None:
        conn.sendall(HEADER.pack(MAGIC, int(MessageType.PARAMS), 0, 0, 0, 1, 24))
        for _ in range(24):
            if stop.wait(0.4):
                return
            conn.sendall(b"\0")
    ls, _ = _hostile_server([hello, dribble])
    with ls:
        c = PSClient([ls.getsockname()], worker=0, workers=1, timeout_s=1.0)
        shards = place([("x", 6)], 1, max_shard_elements=6)
        t0 = time.monotonic()
        with pytest.raises(PSError, match="did not answer pull of shard 0"):
            c.pull(shards, 1, {0: np.empty(6, np.float32)})
        stop.set()
        assert time.monotonic() - t0 < 1.0 + 1.0, time.monotonic() - t0  # not 24 x 0.4 s
        c.close(bye=False)
    stats = HEADER.pack(MAGIC, int(MessageType.STATS), 0, 0, 0, 0, 3) + b"\xff{["
    ls, _ = _hostile_server([hello, stats])
    with ls:
        c = PSClient([ls.getsockname()], worker=0, workers=1, timeout_s=5)
        with pytest.raises(PSError, match="answered stats with what is not JSON"):
            c.stats()
        c.close(bye=False)


@pytest.mark.parametrize("tls", [False, True])
def test_a_hundred_idle_strangers_delay_a_worker_by_at_most_a_moment(tls, creds):
    """100 connections that never send a byte (stuck before their TLS ClientHello, or before
    their HELLO) once kept a worker with the right certificate out until they closed. Now
    pending connections are limited apart from workers', the oldest goes when they are all
    taken, and each has ``hello_timeout_s`` to say HELLO."""
    security = creds if tls else None
    cfg = ServerConfig(workers=2, optimizer="sum", timeout_s=10, hello_timeout_s=2.0)
    with ParameterServer(0, cfg, security=security) as server:
        strangers = [socket.create_connection(server.address, timeout=5) for _ in range(100)]
        time.sleep(0.2)
        t0 = time.monotonic()
        clients = [PSClient([server.address], worker=w, workers=2, timeout_s=10,
                            security=security) for w in range(2)]
        # In before any stranger timed out: they delayed the workers by at most the handshakes
        # (about 0.1 s here), never kept them out until their hello_timeout_s (a bound that
        # follows the configuration, not the machine's load).
        assert time.monotonic() - t0 < cfg.hello_timeout_s
        shards = place([("x", 6)], 1, max_shard_elements=6)
        clients[0].init(shards, {0: np.zeros(6, np.float32)})
        for w, c in enumerate(clients):
            c.push(shards, 0, {0: np.full(6, w + 1.0, np.float32)})
        for c in clients:
            buf = {0: np.empty(6, np.float32)}
            c.pull(shards, 1, buf)
            assert buf[0].tolist() == [3.0] * 6
        # Every stranger is closed: evicted, or after hello_timeout_s.
        for s in strangers:
            s.settimeout(cfg.hello_timeout_s + 3.0)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
            s.close()
        st = server.stats()
        assert st["pending_evicted"] + st["hello_timeouts"] + st["refused_connections"] >= 100
        for c in clients:
            c.close()


@pytest.mark.parametrize("tls", [False, True])
def test_a_hundred_idle_strangers_never_keep_gaia_leaders_apart(free_ports, creds, tls):
    """8 idle connections once made a Gaia leader's peer fail to link at once (its links
    were all taken). Now strangers only wait their turn: the leaders link and exchange."""
    security = creds if tls else None
    leaders = [("127.0.0.1", p) for p in free_ports(2)]
    m1 = Mirror(dc=1, leaders=leaders, staleness=0, timeout_s=10, security=security).listen()
    strangers = [socket.create_connection(leaders[1], timeout=5) for _ in range(100)]
    try:
        t = threading.Thread(target=m1.start)
        t.start()
        t0 = time.monotonic()
        m0 = Mirror(dc=0, leaders=leaders, staleness=0, timeout_s=10,
                    security=security).start()
        t.join(10)
        # Linked before any stranger's HELLO_TIMEOUT_S ran out: they only waited their turn.
        assert not t.is_alive() and time.monotonic() - t0 < HELLO_TIMEOUT_S
        for m in (m0, m1):
            m.expect_entries(10)
        assert _exchange_one(m0, m1, [3], [1.5]) == [([3], [1.5])]
        assert m1.counters["pending_evicted"] > 0
        m0.close()
        m1.close()
    finally:
        for s in strangers:
            s.close()


def _dribble(address, stop: threading.Event, every_s: float) -> socket.socket:
    """A stranger that sends the start of a valid-looking HELLO header one byte at a time,
    each well within a socket timeout of ``every_s`` x 3."""
    s = socket.create_connection(address, timeout=5)

    def run() -> None:
        for b in MAGIC * 6:
            if stop.wait(every_s):
                return
            try:
                s.sendall(bytes([b]))
            except OSError:
                return
    threading.Thread(target=run, daemon=True).start()
    return s


def _closed_within(s: socket.socket, seconds: float) -> float:
    """How long until the peer closes ``s`` (at most ``seconds``, else the test fails)."""
    t0 = time.monotonic()
    s.settimeout(seconds)
    try:
        while s.recv(64):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"still open after {seconds} s")
    return time.monotonic() - t0


def test_a_stranger_dribbling_its_hello_is_closed_after_hello_timeout_s_in_all():
    """A byte every 0.3 s never lets a 1 s receive time out; the HELLO's bound is one
    deadline for the whole message, so the connection goes after about 1 s, counted."""
    cfg = ServerConfig(workers=2, optimizer="sum", timeout_s=10, hello_timeout_s=1.0)
    stop = threading.Event()
    with ParameterServer(0, cfg) as server:
        s = _dribble(server.address, stop, 0.3)
        try:
            took = _closed_within(s, 8.0)
        finally:
            stop.set()
            s.close()
        assert took < cfg.hello_timeout_s + 1.0, took
        deadline = time.monotonic() + 5
        while server.stats()["hello_timeouts"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats()["hello_timeouts"] == 1
        assert _sum_two(server, None).tolist() == [3.0] * 6  # and the server serves on


def test_a_stranger_dribbling_its_hello_to_a_gaia_leader_is_closed_in_time(free_ports,
                                                                         monkeypatch):
    import switchml.gaia.mirror as mirror
    monkeypatch.setattr(mirror, "HELLO_TIMEOUT_S", 1.0)
    leaders = [("127.0.0.1", p) for p in free_ports(2)]
    m1 = Mirror(dc=1, leaders=leaders, staleness=0, timeout_s=10).listen()
    stop = threading.Event()
    try:
        s = _dribble(leaders[1], stop, 0.3)
        try:
            took = _closed_within(s, 8.0)
        finally:
            stop.set()
            s.close()
        assert took < 1.0 + 1.0, took
        deadline = time.monotonic() + 5
        while m1.counters["hello_timeouts"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m1.counters["hello_timeouts"] == 1 and m1.counters["protocol_errors"] == 0
    finally:
        m1.close()
