"""Who may change a job's membership: the job key, JOIN challenges, and the proofs of JOIN and
LEAVE (docs/protocol.md section 2, "Who may join").

The token travels in every datagram, so it only tells one job's datagrams from another's; it
proves nothing. A message that changes who is in a job (JOIN, LEAVE) must prove two things:

* **knowledge of the job key**: ``K = HMAC-SHA256(secret, label | job | token)``, where
  ``secret`` is the switch's (``SwitchConfig.secret``; the empty string for an open switch,
  which therefore only authenticates against those who never saw the job's token);
* **freshness**: a JOIN answers a *challenge*, a cookie the switch made for that source
  address a moment ago; a LEAVE names the cookie of the membership it ends.

The cookie is stateless (the switch keeps nothing per unanswered JOIN, as DTLS's
HelloVerifyRequest and QUIC's Retry): ``issue time | MAC(switch-local key, time | address |
job | rank)`` (keyed BLAKE2b), good for ``lifetime_s``. A JOIN captured and replayed from
another address carries a cookie made for the first address (``bad_cookie``); replayed later
from the same address, an expired one (``stale_cookie``); and a proof that anyone without
``K`` can forge would need ``K``. Keys and proofs are Python's ``hmac`` with SHA-256;
cookies and sealed replies, keyed BLAKE2b (``hashlib``).

**Sealed replies.** The switch's answers that can end, redirect or fail what a worker does
(UNKNOWN_JOB, MISMATCH, JOINED, LEFT, REFUSED, and a WAITING that names gone ranks:
``wire.SEALED_TYPES``) carry a tag, keyed BLAKE2b of the datagram under ``K`` (hashlib),
128 bits (96 in UNKNOWN_JOB's header) (:func:`seal_reply`), and a worker acts on none that
does not verify (:func:`reply_forged`).
So a stranger who knows a job's token, even from the switch's own address, can no longer
restart, fail or misdirect an operation; it still cannot be told apart from the switch in a
RESULT (the data plane is not authenticated; docs/operations.md, the threat table).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

from switchml.protocol.address import Address
from switchml.protocol.wire import (
    AT,
    AUTH_TAG_SIZE,
    COOKIE_SIZE,
    HEADER_SIZE,
    NO_COOKIE,
    SEALED_TYPES,
    ControlInfo,
    Datagram,
    Flags,
    Header,
    MessageType,
    pack_join,
)

__all__ = ["MAX_TENANT", "TENANT_JOBS", "Challenges", "data_key", "job_key", "join_datagram",
           "join_proof", "key_for", "leave_proof", "reply_forged", "reply_sealed", "seal_reply",
           "tenant_job_id", "tenant_key", "tenant_of", "worker_key"]

_LABEL = b"switchml job key v1"
_COOKIE_TIME = struct.Struct("<Q")
_MAC_SIZE = COOKIE_SIZE - _COOKIE_TIME.size


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def job_key(secret: bytes | None, job: int, token: int) -> bytes:
    """HMAC-SHA256 of a job's id and token under ``secret`` (empty for an open switch): the
    key of a job outside every tenant's range, under the switch's secret; of a tenant's job,
    under its tenant's key (:func:`key_for` picks). It never travels."""
    return _mac(secret or b"", _LABEL, struct.pack("<IQ", job, token))


TENANT_JOBS = 1 << 31
"""Job ids with this bit set belong to a tenant: bits 20-30 are its number (0 .. 2047), bits
0-19 the job's. Their keys derive from the tenant's key (:func:`tenant_key`), which a tenant's
workers may hold in place of the switch's secret; other ids' keys derive from the secret."""
TENANT_SHIFT = 20
MAX_TENANT = (1 << (31 - TENANT_SHIFT)) - 1


def tenant_of(job: int) -> int | None:
    """The tenant whose range job id ``job`` is in, or None (an id outside every tenant's)."""
    return (job >> TENANT_SHIFT) & MAX_TENANT if job & TENANT_JOBS else None


def tenant_job_id(tenant: int, n: int) -> int:
    """Job ``n`` (0 .. 2^20 - 1) of ``tenant``'s range of ids."""
    if not 0 <= tenant <= MAX_TENANT or not 0 <= n < 1 << TENANT_SHIFT:
        raise ValueError(f"tenant must be in 0..{MAX_TENANT} and n in 0..2^{TENANT_SHIFT}-1, "
                         f"got {tenant}, {n}")
    return TENANT_JOBS | tenant << TENANT_SHIFT | n


def tenant_key(secret: bytes | None, tenant: int) -> bytes:
    """A tenant's key: HMAC-SHA256 of its number under the switch's ``secret``. Its holder
    derives the key of every job in the tenant's range (:func:`tenant_job_id`), and of no
    other job, and the switch counts the tenant's jobs' slots against its quota
    (``SwitchConfig.tenant_slots``)."""
    if not 0 <= tenant <= MAX_TENANT:
        raise ValueError(f"tenant must be in 0..{MAX_TENANT}, got {tenant}")
    return _mac(secret or b"", b"switchml tenant key v1", struct.pack("<H", tenant))


def key_for(secret: bytes | None, job: int, token: int) -> bytes:
    """The key of job ``job`` under token ``token``, as the switch whose secret is ``secret``
    derives it: a tenant's job under its tenant's key, any other under the secret."""
    tenant = tenant_of(job)
    return job_key(secret if tenant is None else tenant_key(secret, tenant), job, token)


def worker_key(job: int, token: int, *, secret: bytes | None = None,
               job_key_: bytes | None = None, tenant_key_: bytes | None = None) -> bytes:
    """The job key a rank proves its JOIN and LEAVE with, from what it was given: the job's
    own key, its tenant's key, or the switch's secret (``WorkerConfig``'s ``job_key``,
    ``tenant_key``, ``secret``; none: an open switch)."""
    if job_key_ is not None:
        return job_key_
    if tenant_key_ is not None:
        return job_key(tenant_key_, job, token)
    return key_for(secret, job, token)


def data_key(key: bytes, incarnation: bytes) -> bytes:
    """An authenticated job's data key (``JobSpec.auth_data``) on one switch (shard): the 16
    bytes its REQUESTs, RESULTs and KEEPALIVEs are MACed under (SipHash-2-4, in the compiled
    kernels), HMAC-SHA256 of a label and the job's ``incarnation`` there (``wire.
    joined_incarnation``: new at every creation of the job) under the job key, truncated.
    Every member and the switch derive it; nobody sends it. The incarnation makes a datagram
    captured from an earlier run of the same job id and token verify under no later key."""
    return _mac(key, b"switchml data key v1", incarnation)[:16]


def join_proof(key: bytes, *, job: int, token: int, rank: int, seq: int, info: ControlInfo,
               cookie: bytes) -> bytes:
    """A JOIN's proof: the job key over everything the JOIN asks for and the switch's cookie."""
    return _mac(key, b"JOIN", struct.pack("<IQHIIIIIIII", job, token, rank, seq,
                                          info.num_workers, info.window,
                                          info.elements_per_packet, info.quorum,
                                          info.quorum_min, info.deadline_us, info.options),
                cookie)


def join_datagram(key: bytes, *, job: int, token: int, rank: int, seq: int, info: ControlInfo,
                  cookie: bytes = NO_COOKIE) -> bytes:
    """The JOIN a member sends: without ``cookie``, a request for a challenge; with the
    switch's cookie, proven under ``key`` (workers and a tree's racks both send this)."""
    fields = dict(job=job, token=token, rank=rank, seq=seq, info=info)
    if cookie == NO_COOKIE:
        return pack_join(**fields)
    return pack_join(**fields, cookie=cookie, proof=join_proof(key, cookie=cookie, **fields))


def leave_proof(key: bytes, *, job: int, token: int, rank: int, cookie: bytes) -> bytes:
    """A LEAVE's proof: the job key over the rank and the cookie its membership began with
    (JOINED echoes it), so a LEAVE replayed into a later membership proves nothing."""
    return _mac(key, b"LEAVE", struct.pack("<IQH", job, token, rank), cookie)


_FLAGS_AT, _TYPE_AT = AT["flags"], AT["type"]
_TAG_A, _TAG_B = AT["chunk"], AT["exp_data"]  # 24..31 (chunk, slot), 36..39 (exp fields)
"""Where an UNKNOWN_JOB (header only, never larger than the request it answers) carries its
96-bit tag: the echo fields it has no use for, bytes 24-31 (``chunk`` and ``slot``) and
36-39 (``exp_data`` and ``exp_next``), zero while the tag is computed."""
_UNKNOWN_JOB = int(MessageType.UNKNOWN_JOB)
_AUTH = int(Flags.AUTH)


_REPLY_PERSON = b"switchml reply"


def _tag(key: bytes, data: Datagram, size: int) -> bytes:
    """A reply's tag: keyed BLAKE2b of the datagram under the job key, ``size`` bytes,
    personalised "switchml reply" (3x cheaper than HMAC-SHA256 here: 0.5 against 1.5 µs)."""
    return hashlib.blake2b(data, key=key, digest_size=size, person=_REPLY_PERSON).digest()


def _unknown_job_plain(header: bytearray) -> bytes:
    """An UNKNOWN_JOB's header as its tag is computed over: AUTH set, the tag's bytes zero."""
    return bytes(header[:_TAG_A]) + bytes(8) + bytes(header[_TAG_A + 8:_TAG_B]) + bytes(4)


def seal_reply(key: bytes, datagram: Datagram) -> bytes:
    """The switch's ``datagram`` (a reply of ``wire.SEALED_TYPES``, its flags without
    ``AUTH``) sealed under the job key ``key``: ``AUTH`` set, then the tag, after the
    payload, or in the header of an UNKNOWN_JOB."""
    out = bytearray(datagram)
    out[_FLAGS_AT] |= _AUTH
    if out[_TYPE_AT] != _UNKNOWN_JOB:
        out += _tag(key, out, AUTH_TAG_SIZE)
        return bytes(out)
    plain = _unknown_job_plain(out)
    tag = _tag(key, plain, 12)
    return plain[:_TAG_A] + tag[:8] + plain[_TAG_A + 8:_TAG_B] + tag[8:]


def reply_sealed(key: bytes, data: Datagram, header: Header) -> bool:
    """True if ``data`` (decoded as ``header``: ``wire.unpack_header`` checked its length) is
    sealed under the job key ``key`` (:func:`seal_reply`)."""
    if not header.flags & Flags.AUTH:
        return False
    raw = bytearray(data)
    if header.type is not MessageType.UNKNOWN_JOB:
        return hmac.compare_digest(bytes(raw[-AUTH_TAG_SIZE:]),
                                   _tag(key, raw[:-AUTH_TAG_SIZE], AUTH_TAG_SIZE))
    return hmac.compare_digest(bytes(raw[_TAG_A:_TAG_A + 8] + raw[_TAG_B:_TAG_B + 4]),
                               _tag(key, _unknown_job_plain(raw[:HEADER_SIZE]), 12))


def reply_forged(key: bytes, data: Datagram, header: Header) -> bool:
    """True if a worker (or a rack towards its parent) must drop this reply from its switch:
    it is of a type that is always sealed (``wire.SEALED_TYPES`` but an unsealed WAITING, a
    hint), or it says it is sealed, and it does not verify under the job key ``key``."""
    if header.type in (MessageType.RESULT, MessageType.REQUEST):
        return False  # an authenticated job's data MAC: the kernels check it (data_key)
    must = (header.type in SEALED_TYPES and header.type is not MessageType.WAITING
            or header.flags & Flags.AUTH)
    return bool(must) and not reply_sealed(key, data, header)


class Challenges:
    """The switch's JOIN cookies: issued for an address, checked statelessly.

    Args:
        lifetime_s: how long a cookie stays good (a JOIN's round trip, with margin).
        key: the switch-local MAC key; random per switch (cookies do not survive a restart,
            and a worker simply asks again).
    """

    def __init__(self, lifetime_s: float, key: bytes | None = None) -> None:
        if lifetime_s <= 0:
            raise ValueError(f"lifetime_s must be > 0, got {lifetime_s}")
        self.lifetime_s = lifetime_s
        self._key = key if key is not None else secrets.token_bytes(32)

    def _tag(self, issued_us: int, addr: Address, job: int, rank: int) -> bytes:
        # Keyed BLAKE2b, not HMAC-SHA256: a stranger's JOIN costs the switch one of these
        # (0.5 against 1.5 µs here), and the cookie is only ever checked by this switch.
        return hashlib.blake2b(_COOKIE_TIME.pack(issued_us) + repr(addr).encode()
                               + struct.pack("<IH", job, rank), key=self._key,
                               digest_size=_MAC_SIZE, person=b"switchml cookie").digest()

    def issue(self, now: float, addr: Address, job: int, rank: int) -> bytes:
        """A cookie for a JOIN of (``job``, ``rank``) from ``addr`` at time ``now``."""
        issued = max(0, int(now * 1e6))
        return _COOKIE_TIME.pack(issued) + self._tag(issued, addr, job, rank)

    @staticmethod
    def issued_at(cookie: bytes) -> float:
        """When a cookie (checked with :meth:`check`) was issued, in the switch's ``now``."""
        return _COOKIE_TIME.unpack_from(cookie)[0] / 1e6

    def check(self, cookie: bytes, now: float, addr: Address, job: int, rank: int
              ) -> str | None:
        """None if ``cookie`` was issued here for this address, job and rank within
        ``lifetime_s``; else the drop reason: ``bad_cookie`` (forged, or made for another
        address, job or rank: a replay from elsewhere) or ``stale_cookie`` (expired)."""
        if len(cookie) != COOKIE_SIZE or cookie == NO_COOKIE:
            return "bad_cookie"
        (issued,) = _COOKIE_TIME.unpack_from(cookie)
        if not hmac.compare_digest(cookie[_COOKIE_TIME.size:],
                                   self._tag(issued, addr, job, rank)):
            return "bad_cookie"
        age = now - issued / 1e6
        if not -1e-3 <= age <= self.lifetime_s:
            return "stale_cookie"
        return None
