"""Sealed replies (issue 36, item 2): every switch reply that can end, redirect or fail what a
worker does carries a MAC under the job key, and a worker acts on no such reply that does not
verify, even one from the switch's own address (a forger who spoofs it).

The reference for the MAC is computed here by hand from docs/protocol.md's rule, with
``hmac`` and ``hashlib`` directly: ``K = HMAC-SHA256(secret, "switchml job key v1" | job |
token)``; the tag is keyed BLAKE2b of the datagram (AUTH set) under ``K``, personalised
"switchml reply": 16 bytes after the payload, or, in a header-only UNKNOWN_JOB, 12 bytes in its
``chunk``/``slot`` and ``exp_data``/``exp_next`` fields (zeroed while the tag is computed).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np
import pytest
from test_switch import decode, deliver, join, leave, request

from switchml.protocol.config import SwitchConfig, WorkerConfig
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import (
    AT,
    HEADER_SIZE,
    ChunkShape,
    ControlInfo,
    ElementType,
    Flags,
    Header,
    MessageType,
    pack_header,
    pack_joined,
    pack_mismatch,
    unpack_joined,
)
from switchml.transport.memory import MemoryCluster

SECRET = b"sealed-replies-test-secret"
TOKEN = 0x5EA1ED_0000_0000_07


def _key(secret: bytes | None, job: int, token: int) -> bytes:
    return hmac.digest(secret or b"", b"switchml job key v1" + struct.pack("<IQ", job, token),
                       hashlib.sha256)


def _hand_seal(key: bytes, datagram: bytes) -> bytes:
    """The seal as docs/protocol.md states it (the reference for the switch's)."""
    d = bytearray(datagram)
    d[AT["flags"]] |= 0x40
    if d[AT["type"]] != MessageType.UNKNOWN_JOB:
        return bytes(d) + hashlib.blake2b(bytes(d), key=key, digest_size=16,
                                          person=b"switchml reply").digest()
    d[24:32] = bytes(8)
    d[36:40] = bytes(4)
    tag = hashlib.blake2b(bytes(d), key=key, digest_size=12, person=b"switchml reply").digest()
    d[24:32], d[36:40] = tag[:8], tag[8:12]
    return bytes(d)


def _assert_sealed(raw: bytes, key: bytes) -> None:
    """``raw`` is sealed under ``key``: recomputing the seal by hand from its unsealed form
    gives it back byte for byte."""
    assert raw[AT["flags"]] & 0x40
    if raw[AT["type"]] == MessageType.UNKNOWN_JOB:
        assert len(raw) == HEADER_SIZE
        plain = bytearray(raw)
    else:
        plain = bytearray(raw[:-16])
    plain[AT["flags"]] &= ~0x40 & 0xFF
    assert _hand_seal(key, bytes(plain)) == raw


def test_every_reply_that_ends_or_redirects_is_sealed_under_the_job_key():
    sw = SwitchDataplane(SwitchConfig(secret=SECRET, pool_slots=64, max_elements_per_packet=64,
                                      max_workers=8, nack_gap=0, member_timeout_s=5.0))
    key = _key(SECRET, 3, TOKEN)
    info = ControlInfo(2, 4, 8)
    addrs = [("w0", 1000), ("w1", 1001)]
    joined = [join(sw, 3, TOKEN, r, info, addrs[r], secret=SECRET) for r in range(2)]
    for (o,) in joined:
        assert o.header.type is MessageType.JOINED
        _assert_sealed(o.raw, key)
    base = unpack_joined(joined[0][0].payload)[0].slot_base

    # REFUSED (a JOIN of another geometry), echoing the JOIN's epoch.
    (o,) = join(sw, 3, TOKEN, 1, ControlInfo(2, 8, 8), ("w9", 9), seq=7, secret=SECRET)
    assert o.header.type is MessageType.REFUSED and o.header.seq == 7
    _assert_sealed(o.raw, key)

    # UNKNOWN_JOB: under the key of the job and token it names; no larger than the request.
    for job, token in ((99, TOKEN), (3, TOKEN + 1)):  # unknown id; live id, another token
        req = request(job, token, 0, base, 0, 5, 0, [1])
        (o,) = deliver(sw, req, addrs[0])
        assert o.header.type is MessageType.UNKNOWN_JOB and len(o.raw) <= len(req)
        assert (o.header.seq, o.header.rank) == (5, 0)
        _assert_sealed(o.raw, _key(SECRET, job, token))

    # MISMATCH to both sides of a round that disagrees.
    assert deliver(sw, request(3, TOKEN, 0, base, 0, 1, 0, [1, 2]), addrs[0]) == []
    out = deliver(sw, request(3, TOKEN, 1, base, 0, 1, 0, [1, 2, 3]), addrs[1])
    assert {o.addr for o in out} == set(addrs)
    for o in out:
        assert o.header.type is MessageType.MISMATCH
        _assert_sealed(o.raw, key)

    # WAITING: a hint, unsealed, while the missing rank is alive; sealed once it names a
    # rank gone (silent for member_timeout_s).
    assert deliver(sw, request(3, TOKEN, 0, base + 1, 0, 1, 1, [1]), addrs[0]) == []
    sw.receive_datagram(request(3, TOKEN, 0, base + 1, 0, 1, 1, [1]), addrs[0], now=1.0)
    (o,) = _drain(sw, 1.0)
    assert o.header.type is MessageType.WAITING and not o.header.flags & Flags.AUTH
    assert o.payload.tolist() == [0b10, 0]
    sw.receive_datagram(request(3, TOKEN, 0, base + 1, 0, 1, 1, [1]), addrs[0], now=60.0)
    (o,) = _drain(sw, 60.0)
    assert o.header.type is MessageType.WAITING and o.payload.tolist() == [0b10, 0b10]
    _assert_sealed(o.raw, key)

    # LEFT.
    (o,) = leave(sw, 3, TOKEN, 0, addrs[0], unpack_joined(joined[0][0].payload)[1],
                 secret=SECRET)
    assert o.header.type is MessageType.LEFT
    _assert_sealed(o.raw, key)


def _drain(sw: SwitchDataplane, now: float):
    return [decode(d, a) for d, a in sw.datagrams_to_send(now=now)]


def _forgeries(job: int, token: int, seqs, key: bytes) -> list[tuple[str, bytes]]:
    """Each reply a worker would act on, for every ``seq``: unsealed, sealed under a wrong
    key, and sealed under the right key but altered after (``seq`` + 1)."""
    wrong = _key(b"not the switch's secret", job, token)
    out = []
    gone = (0b10).to_bytes(1, "little")
    shape = ChunkShape(8, int(ElementType.INT32), int(Flags.HAS_DATA), -32768, 0)
    for seq in seqs:
        plain = [
            pack_header(Header(MessageType.UNKNOWN_JOB, job, rank=0, token=token, seq=seq)),
            pack_header(Header(MessageType.WAITING, job, rank=0, token=token, seq=seq,
                               count=2, elem=ElementType.BYTES)) + gone + gone,
            pack_header(Header(MessageType.MISMATCH, job, rank=0, token=token, seq=seq,
                               count=15, elem=ElementType.BYTES))
            + pack_mismatch(shape, ChunkShape(8, int(ElementType.INT32), int(Flags.HAS_DATA),
                                              -32768, 1), 0b10, 2),
            pack_header(Header(MessageType.REFUSED, job, rank=0, token=token, seq=seq,
                               count=6, elem=ElementType.BYTES)) + b"forged",
            pack_joined(job=job, token=token, rank=0, shard=0, seq=seq,
                        info=ControlInfo(2, 4, 64, slot_base=40), cookie=bytes(24)),
            pack_header(Header(MessageType.LEFT, job, rank=0, token=token, seq=seq)),
        ]
        for d in plain:
            out.append(("unsealed", d))
            out.append(("wrong key", _hand_seal(wrong, d)))
            tampered = bytearray(_hand_seal(key, d))
            tampered[AT["seq"]] ^= 1
            out.append(("tampered", bytes(tampered)))
    return out


def test_forged_replies_from_the_switchs_own_address_change_nothing():
    """A forger who knows the token and spoofs the switch's address: rank 0, in the middle of
    an all-reduce, is sent every reply that would restart, fail or redirect it, unsealed,
    sealed under another key, and altered after sealing. The operation completes with the
    exact sum; each forgery is dropped and counted. A reply sealed by hand under the right
    key is acted on (the check is not simply "drop them all")."""
    sw = SwitchDataplane(SwitchConfig(secret=SECRET))
    c = MemoryCluster(num_workers=2, switch=sw, elements_per_packet=64, window=4,
                      worker_config=WorkerConfig(secret=SECRET))
    c.join()
    spec, w0 = c.spec, c.workers[0]
    key = _key(SECRET, spec.job_id, spec.token)
    xs = [np.arange(1000, dtype=np.int32) * (r + 1) for r in range(2)]
    outs = [np.empty_like(x) for x in xs]
    h0 = c.start([xs[0]], [outs[0]], ranks=[0])[0]
    forged = _forgeries(spec.job_id, spec.token, range(0, 4), key)
    for _why, d in forged:
        w0.receive_datagram(d, MemoryCluster.SWITCH, c.fabric.now)
        assert w0.datagrams_to_send(c.fabric.now) == []  # nothing answered, nothing sent
    c.wait([h0] + c.start([xs[1]], [outs[1]], ranks=[1]))
    for o in outs:
        np.testing.assert_array_equal(o, xs[0] + xs[1])
    # (An unsealed WAITING is a hint, not dropped as such: its gone ranks are ignored.)
    hints = [d for why, d in forged if why == "unsealed" and d[AT["type"]] == MessageType.WAITING]
    assert w0.drops["unauthenticated_reply"] == len(forged) - len(hints)
    assert w0.drops["unauthenticated_gone"] >= 1
    assert w0.counters["operations_restarted"] == 0 and w0.error is None

    # The same UNKNOWN_JOB sealed by hand under the right key: rank 0 restarts the operation
    # (the switch's own UNKNOWN_JOBs are sealed by the switch: test above).
    h0 = c.start([xs[0]], [outs[0]], ranks=[0])[0]
    for seq in range(0, 8):
        w0.receive_datagram(_hand_seal(key, pack_header(Header(
            MessageType.UNKNOWN_JOB, spec.job_id, rank=0, token=spec.token, seq=seq))),
            MemoryCluster.SWITCH, c.fabric.now)
    c.fabric.flush(c.addresses[0])
    c.wait([h0] + c.start([xs[1]], [outs[1]], ranks=[1]))
    assert w0.counters["operations_restarted"] == 1
    for o in outs:
        np.testing.assert_array_equal(o, xs[0] + xs[1])


def test_a_waiting_that_is_not_sealed_names_no_gone_rank():
    """An unsealed WAITING (the compiled loop's) is a hint: its "gone" bitmap is ignored
    (counted), so a forged one cannot fail an operation; the missing ranks are still used."""
    c = MemoryCluster(num_workers=2, elements_per_packet=64, window=4)
    c.join()
    spec, w0 = c.spec, c.workers[0]
    x = np.ones(256, np.int32)
    outs = [np.empty_like(x), np.empty_like(x)]
    h0 = c.start([x], [outs[0]], ranks=[0])[0]
    gone = (0b10).to_bytes(1, "little")
    for seq in range(0, 4):
        w0.receive_datagram(pack_header(Header(
            MessageType.WAITING, spec.job_id, rank=0, token=spec.token, seq=seq, count=2,
            elem=ElementType.BYTES)) + gone + gone, MemoryCluster.SWITCH, c.fabric.now)
    c.wait([h0] + c.start([x], [outs[1]], ranks=[1]))
    assert w0.drops["unauthenticated_gone"] >= 1 and w0.error is None
    np.testing.assert_array_equal(outs[0], 2 * x)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_dead_rank_still_fails_the_others_fast_through_a_sealed_waiting(secret):
    """The switch's own WAITING naming a gone rank verifies, so a job without a quorum still
    fails at once when a rank dies (not at op_timeout_s): open switch and secret alike."""
    sw = SwitchDataplane(SwitchConfig(secret=secret, member_timeout_s=2.0))
    c = MemoryCluster(num_workers=2, switch=sw, elements_per_packet=64, window=4,
                      worker_config=WorkerConfig(secret=secret, op_timeout_s=60.0))
    c.join()
    c.fabric.detach(c.addresses[1])  # rank 1 is gone: nothing to or from it
    x = np.ones(512, np.int32)
    (h0,) = c.start([x], ranks=[0])
    t0 = c.fabric.now
    c.fabric.run(h0.done)
    with pytest.raises(Exception, match="gone"):
        h0.result()
    assert c.fabric.now - t0 < 30.0  # well before op_timeout_s
    assert c.workers[0].drops["unauthenticated_reply"] == 0
