"""The authenticated data plane (issue 36, item 3; ``JobSpec.auth_data``): every REQUEST and
RESULT of such a job carries the AUTH flag and, after its payload, a 16-byte MAC under the job's
data key, and the switch and the workers drop (and count, ``bad_mac``) every data datagram that
does not verify, before it touches a slot or a result.

The reference is computed here by hand from docs/protocol.md's rule: the job key ``K =
HMAC-SHA256(secret, "switchml job key v1" | job u32 | token u64)``, the data key
``HMAC-SHA256(K, "switchml data key v1" | incarnation)[:16]`` (the incarnation: the last 16
bytes of the cookie that created the job, which every JOINED carries), and the tag SipHash-2-4
with a 128-bit output of the datagram (AUTH set, tag excluded), written below from the SipHash
paper (Aumasson and Bernstein, 2012) and checked against its reference vectors; the kernels use
OpenSSL's.
"""

from __future__ import annotations

import hashlib
import hmac
import random
import struct

import numpy as np
import pytest
from test_switch import decode, deliver, join, request

from switchml.control import decode_job_spec, encode_job_spec, new_job_spec
from switchml.protocol import kernels as K
from switchml.protocol.auth import job_key, join_datagram
from switchml.protocol.config import JobSpec, SwitchConfig, WorkerConfig
from switchml.protocol.endpoint import Batch
from switchml.protocol.errors import ConfigError
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import (
    AT,
    AUTH_DATA,
    HEADER_SIZE,
    ControlInfo,
    Header,
    MessageType,
    joined_incarnation,
    pack_header,
    unpack_joined,
)
from switchml.transport.memory import FaultModel, MemoryCluster, MemoryFabric

SECRET = b"auth-data-test-secret, 32 bytes"
JOB, TOKEN = 11, 0xDA7A_0000_0000_0011
_M = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _M


def siphash24(key: bytes, msg: bytes, outlen: int = 16) -> bytes:
    """SipHash-2-4 as the paper and its reference code define it (8- or 16-byte output)."""
    k0, k1 = struct.unpack("<QQ", key)
    v = [0x736F6D6570736575 ^ k0, 0x646F72616E646F6D ^ k1, 0x6C7967656E657261 ^ k0,
         0x7465646279746573 ^ k1]
    if outlen == 16:
        v[1] ^= 0xEE

    def rounds(n: int) -> None:
        for _ in range(n):
            v[0] = (v[0] + v[1]) & _M
            v[1] = _rotl(v[1], 13) ^ v[0]
            v[0] = _rotl(v[0], 32)
            v[2] = (v[2] + v[3]) & _M
            v[3] = _rotl(v[3], 16) ^ v[2]
            v[0] = (v[0] + v[3]) & _M
            v[3] = _rotl(v[3], 21) ^ v[0]
            v[2] = (v[2] + v[1]) & _M
            v[1] = _rotl(v[1], 17) ^ v[2]
            v[2] = _rotl(v[2], 32)

    tail = len(msg) % 8
    for i in range(0, len(msg) - tail, 8):
        (m,) = struct.unpack_from("<Q", msg, i)
        v[3] ^= m
        rounds(2)
        v[0] ^= m
    b = (len(msg) & 0xFF) << 56 | int.from_bytes(msg[len(msg) - tail:], "little")
    v[3] ^= b
    rounds(2)
    v[0] ^= b
    v[2] ^= 0xEE if outlen == 16 else 0xFF
    rounds(4)
    out = struct.pack("<Q", v[0] ^ v[1] ^ v[2] ^ v[3])
    if outlen == 8:
        return out
    v[1] ^= 0xDD
    rounds(4)
    return out + struct.pack("<Q", v[0] ^ v[1] ^ v[2] ^ v[3])


def _data_key(secret: bytes, job: int, token: int, incarnation: bytes) -> bytes:
    k = hmac.digest(secret, b"switchml job key v1" + struct.pack("<IQ", job, token),
                    hashlib.sha256)
    return hmac.digest(k, b"switchml data key v1" + incarnation, hashlib.sha256)[:16]


def _seal(key: bytes, datagram: bytes) -> bytes:
    d = bytearray(datagram)
    d[AT["flags"]] |= 0x40
    return bytes(d) + siphash24(key, bytes(d))


def test_the_reference_siphash_meets_the_papers_vector_and_the_kernels_mac():
    key = bytes(range(16))
    assert siphash24(key, bytes(range(15)), 8) == (0xA129CA6149BE45E5).to_bytes(8, "little")
    # the reference code's first 128-bit vector (vectors.h: the empty message)
    assert siphash24(key, b"") == bytes.fromhex("a3817f04ba25a8e66df67214c7550293")
    rng = random.Random(5)
    for n in (0, 1, 7, 8, 9, 40, 1472, 9000):
        k, m = rng.randbytes(16), rng.randbytes(n)
        assert K.data_mac(k, m) == siphash24(k, m)
    with pytest.raises(ValueError, match="16 bytes"):
        K.data_mac(b"short", b"x")


def _switch(secret: bytes | None = SECRET, nack_gap: int = 0) -> SwitchDataplane:
    return SwitchDataplane(SwitchConfig(secret=secret, pool_slots=64, max_elements_per_packet=64,
                                        max_workers=8, nack_gap=nack_gap))


def _auth_job(sw: SwitchDataplane) -> tuple[list[tuple[str, int]], int, bytes]:
    """Ranks 0 and 1 of an authenticated job joined; their addresses, the slot base and the
    job's data key, derived by hand from the incarnation every JOINED names: the last 16 bytes
    of the cookie of the JOIN that created the job (rank 0's)."""
    addrs = [("w0", 1000), ("w1", 1001)]
    incarnations, cookies = set(), []
    for r, a in enumerate(addrs):
        out = join(sw, JOB, TOKEN, r, ControlInfo(2, 4, 8, options=AUTH_DATA), a, secret=SECRET)
        assert [o.header.type for o in out] == [MessageType.JOINED]
        granted, cookie = unpack_joined(out[0].payload)
        assert granted.options == AUTH_DATA
        incarnations.add(joined_incarnation(out[0].payload))
        cookies.append(cookie)
    (incarnation,) = incarnations  # one per job, the same to every rank
    assert incarnation == cookies[0][8:]
    return addrs, granted.slot_base, _data_key(SECRET, JOB, TOKEN, incarnation)


def test_the_switch_adds_only_requests_whose_mac_verifies_and_seals_its_results():
    sw = _switch()
    (a0, a1), slot, key = _auth_job(sw)
    x0, x1 = [1, -2, 3, 40], [10, 20, -30, 4]
    assert deliver(sw, _seal(key, request(JOB, TOKEN, 0, slot, 0, 0, 0, x0)), a0) == []
    # Rank 1's request, forged three ways from its own address: no AUTH, AUTH and a wrong
    # tag, a right tag over other values; none is added, none is answered.
    plain = request(JOB, TOKEN, 1, slot, 0, 0, 0, [666] * 4)
    bad_tag = bytearray(_seal(key, plain))
    bad_tag[-1] ^= 1
    other = bytearray(_seal(key, request(JOB, TOKEN, 1, slot, 0, 0, 0, x1)))
    other[HEADER_SIZE] ^= 1  # the payload changed after the MAC
    for forged in (plain, bytes(bad_tag), bytes(other)):
        assert deliver(sw, forged, a1) == []
    assert sw.drops["bad_mac"] == 3
    out = deliver(sw, _seal(key, request(JOB, TOKEN, 1, slot, 0, 0, 0, x1)), a1)
    assert sorted(o.addr for o in out) == [a0, a1]
    for o in out:
        assert o.header.type is MessageType.RESULT and o.header.flags & 0x40
        assert len(o.raw) == HEADER_SIZE + 4 * 4 + 16
        assert o.raw[-16:] == siphash24(key, o.raw[:-16])  # sealed as the rule says
        np.testing.assert_array_equal(o.payload, [11, 18, -27, 44])  # by hand: x0 + x1


def test_a_plain_jobs_requests_carry_no_mac_and_an_authenticated_job_needs_a_secret():
    sw = _switch()
    addrs = [("p0", 1000), ("p1", 1001)]
    for r, a in enumerate(addrs):
        join(sw, JOB + 1, TOKEN, r, ControlInfo(2, 4, 8), a, secret=SECRET)
    key = _data_key(SECRET, JOB + 1, TOKEN, bytes(16))
    sealed = _seal(key, request(JOB + 1, TOKEN, 0, 0, 0, 0, 0, [1, 2]))
    assert deliver(sw, sealed, addrs[0]) == [] and sw.drops["bad_mac"] == 1
    open_switch = _switch(secret=None)
    out = join(open_switch, JOB, TOKEN, 0, ControlInfo(2, 4, 8, options=AUTH_DATA), ("o", 1))
    assert [o.header.type for o in out] == [MessageType.REFUSED]
    assert b"needs a switch with a secret" in bytes(out[0].payload)
    with pytest.raises(ConfigError, match="auth_data with a quorum"):
        JobSpec(JOB, TOKEN, 4, quorum=3, auth_data=True)


@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_an_authenticated_job_sums_exactly_under_loss(loss):
    """Over the in-memory fabric, with loss and NACKs on: every re-send, shadow-copy answer
    (RESENT results) and NACK answer (RESENT requests) of an authenticated job verifies
    (nothing dropped as bad_mac), and every rank gets the sum computed apart."""
    cfg = WorkerConfig(secret=SECRET, op_timeout_s=30.0)
    data: list[bytes] = []  # every REQUEST and RESULT on the wire, before loss

    incarnations: set[bytes] = set()

    def tap(payload: bytes, src, dst) -> bool:
        if payload[AT["type"]] in (MessageType.REQUEST, MessageType.RESULT):
            data.append(bytes(payload))
        elif payload[AT["type"]] == MessageType.JOINED:
            count = int.from_bytes(payload[AT["count"]:AT["count"] + 2], "little")
            incarnations.add(joined_incarnation(payload[HEADER_SIZE:HEADER_SIZE + count]))
        return False

    c = MemoryCluster(num_workers=3, window=4, elements_per_packet=64, job_id=JOB, token=TOKEN,
                      fabric=MemoryFabric(FaultModel(loss_rate=loss), 3, drop_filter=tap),
                      switch=_switch(nack_gap=4), worker_config=cfg, auth_data=True)
    rng = np.random.default_rng(1)
    xs = [rng.integers(-1000, 1000, 3000).astype(np.int32) for _ in range(3)]
    outs = c.allreduce(xs)
    for out in outs:
        np.testing.assert_array_equal(out, xs[0] + xs[1] + xs[2])
    (incarnation,) = incarnations  # every JOINED named the one job's
    key = _data_key(SECRET, JOB, TOKEN, incarnation)
    assert len(data) > 3 * 3000 // 64  # every chunk's requests and results, at least
    for d in data:  # each sealed under the job's data key, as the rule says
        assert d[AT["flags"]] & 0x40 and d[-16:] == siphash24(key, d[:-16])
    if loss:  # the re-sends that are rebuilt and sealed again took place, and verified
        resent = [d for d in data if d[AT["flags"]] & 0x08]
        assert any(d[AT["type"]] == MessageType.REQUEST for d in resent)
        assert any(d[AT["type"]] == MessageType.RESULT for d in resent)
    assert c.switch.drops["bad_mac"] == 0
    assert all(w.drops["bad_mac"] == 0 for w in c.workers)
    if loss:
        assert sum(w.counters["retransmissions"] for w in c.workers) > 0


def test_the_switch_kernel_drops_a_forged_request_inside_a_batch():
    """A genuine request and a forgery from the same member in one receive batch: the
    kernel, not only Python's admission of a first request, checks every MAC."""
    sw = _switch()
    (a0, a1), slot, key = _auth_job(sw)
    good0 = _seal(key, request(JOB, TOKEN, 0, slot, 0, 0, 0, [1, 2]))
    good1 = _seal(key, request(JOB, TOKEN, 1, slot, 0, 0, 0, [3, 4]))
    forged = bytearray(_seal(key, request(JOB, TOKEN, 1, slot + 1, 0, 0, 1, [666, 666])))
    forged[-1] ^= 0x80
    deliver(sw, good0, a0)
    blob = good1 + bytes(forged)
    starts = np.array([0, len(good1)], np.int64)
    lens = np.array([len(good1), len(forged)], np.int64)
    sw.receive_many(Batch(np.frombuffer(bytearray(blob), np.uint8), starts, lens,
                          np.zeros(2, np.int64), 2, lambda k: a1), 0.0)
    out = [o for o in (decode(d, a) for d, a in sw.datagrams_to_send(now=0.0))]
    assert sorted(o.addr for o in out) == [a0, a1]  # the genuine round, and nothing else
    for o in out:
        np.testing.assert_array_equal(o.payload, [4, 6])
    assert sw.drops["bad_mac"] == 1


def test_a_request_captured_in_an_earlier_run_of_the_job_verifies_no_more():
    """The same job id and token, run again by fresh processes on a fresh switch with the
    same secret: a request captured in the first run is replayed first into the second. Its
    MAC was under the first incarnation's key: dropped, and the sum is the second run's."""
    first = _switch()
    (a0, a1), slot, key1 = _auth_job(first)
    captured = _seal(key1, request(JOB, TOKEN, 1, slot, 0, 0, 0, [100, 100]))
    second = _switch()
    (b0, b1), slot2, key2 = _auth_job(second)
    assert key2 != key1
    deliver(second, _seal(key2, request(JOB, TOKEN, 0, slot2, 0, 0, 0, [1, 1])), b0)
    assert deliver(second, captured, b1) == [] and second.drops["bad_mac"] == 1
    out = deliver(second, _seal(key2, request(JOB, TOKEN, 1, slot2, 0, 0, 0, [7, 7])), b1)
    for o in out:
        np.testing.assert_array_equal(o.payload, [8, 8])


def test_keepalives_of_an_authenticated_job_renew_liveness_only_with_their_mac():
    """How long the switch has not heard from a rank that a round waits for (what it
    reports, and what fails its peers after ``member_timeout_s``) moves with a sealed
    keep-alive, not with a forged one from the rank's own address."""
    sw = _switch()
    (a0, a1), slot, key = _auth_job(sw)
    deliver(sw, _seal(key, request(JOB, TOKEN, 0, slot, 0, 0, 0, [1, 2])), a0)  # waits for 1

    def silent(now: float) -> float:
        (state,) = sw.job_states(now)
        return state["silent_s"][1]

    plain = pack_header(Header(MessageType.KEEPALIVE, JOB, rank=1, token=TOKEN))
    sw.receive_datagram(plain, a1, now=50.0)
    assert sw.drops["bad_mac"] == 1 and silent(60.0) == pytest.approx(60.0)  # heard at 0
    sw.receive_datagram(_seal(key, plain), a1, now=60.0)
    assert sw.drops["bad_mac"] == 1 and silent(60.0) == pytest.approx(0.0)


def test_an_authenticated_jobs_choice_is_proven_and_checked():
    """``options`` is part of the JOIN's proof (a JOIN whose options were changed on the way
    proves nothing), a switch refuses what it cannot do, and an encoded spec keeps the
    choice; a typo in it is an error, not a job without a MAC."""
    sw = _switch()
    info = ControlInfo(2, 4, 8, options=AUTH_DATA)
    out = deliver(sw, join_datagram(job_key(SECRET, JOB, TOKEN), job=JOB, token=TOKEN, rank=0,
                                    seq=0, info=info), ("w0", 1000))
    cookie = bytes(out[0].payload[:24])
    proven = bytearray(join_datagram(job_key(SECRET, JOB, TOKEN), job=JOB, token=TOKEN,
                                     rank=0, seq=0, info=info, cookie=cookie))
    proven[HEADER_SIZE + 28] = 0  # options: AUTH_DATA -> none, after the proof was made
    (o,) = deliver(sw, bytes(proven), ("w0", 1000))
    assert o.header.type is MessageType.REFUSED and b"does not verify" in bytes(o.payload)
    assert sw.stats()["jobs"] == 0  # no job, with or without a MAC
    for bad, why in ((ControlInfo(2, 4, 8, quorum=2, options=AUTH_DATA), b"no quorum"),
                     (ControlInfo(2, 4, 8, options=2), b"unknown job options")):
        (o,) = join(sw, JOB + 2, TOKEN, 0, bad, ("w9", 9), secret=SECRET)
        assert o.header.type is MessageType.REFUSED and why in bytes(o.payload)
    (o,) = join(sw, JOB + 3, TOKEN, 0, ControlInfo(2, 4, 8, options=AUTH_DATA), ("x0", 1),
                secret=SECRET)
    (o,) = join(sw, JOB + 3, TOKEN, 1, ControlInfo(2, 4, 8), ("x1", 2), secret=SECRET)
    assert o.header.type is MessageType.REFUSED and b"auth_data" in bytes(o.payload)
    spec = new_job_spec(2, auth_data=True)
    assert decode_job_spec(encode_job_spec(spec)) == spec and spec.elements_per_packet == 354
    for typo in (":a1", ":auth"):
        with pytest.raises(ConfigError, match="':a'"):
            decode_job_spec(encode_job_spec(new_job_spec(2)) + typo)
