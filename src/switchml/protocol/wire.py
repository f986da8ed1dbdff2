"""Wire format: one 40-byte header, then a payload (see ``docs/protocol.md`` for the byte table).

Every switchml datagram, data or control, starts with the same header. All fields are
little-endian: every host this runs on is little-endian, so the int32 (or int16) payload is used
in place as a numpy view with no byte swap per element on the hot path (the P4 original is
big-endian; this format is not wire-compatible with it, see ``docs/protocol.md``).

Decoding is strict: a datagram that is short, has the wrong magic or version, an unknown type or
element type, or whose length disagrees with its element count raises :class:`WireError` with a
``reason`` that the caller uses as its drop trigger.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum, IntFlag

import numpy as np

from switchml.protocol.errors import WireError

Datagram = bytes | bytearray | memoryview
"""A datagram's bytes as endpoints take and return them: bytes, or a view of a buffer (one
name for the type, in the lowest layer; ``endpoint.Datagram`` is this)."""

__all__ = [
    "Datagram",
    "AT",
    "AUTH_DATA",
    "AUTH_TAG_SIZE",
    "SEALED_TYPES",
    "EXP_ZERO",
    "HEADER",
    "HEADER_DTYPE",
    "HEADER_FIELDS",
    "HEADER_SIZE",
    "INCARNATION_SIZE",
    "KNOWN_FLAGS",
    "MAX_TRAILER",
    "contributors",
    "REQUEST_FLAGS",
    "RESULT_FLAGS",
    "ITEMSIZE",
    "MAGIC",
    "MAX_DATAGRAM_BYTES",
    "MAX_ELEMENTS_PER_PACKET",
    "VERSION",
    "PROOF_SIZE",
    "ChunkShape",
    "ControlInfo",
    "ElementType",
    "Field",
    "Flags",
    "Header",
    "MessageType",
    "Mismatch",
    "COOKIE_SIZE",
    "NO_COOKIE",
    "pack_challenge",
    "pack_control_info",
    "pack_header",
    "pack_join",
    "pack_joined",
    "pack_leave",
    "operation_digest",
    "pack_mismatch",
    "unpack_challenge",
    "unpack_control_info",
    "unpack_header",
    "unpack_join",
    "joined_incarnation",
    "unpack_joined",
    "unpack_leave",
    "unpack_mismatch",
    "unpack_payload",
    "elements_for_mtu",
]

MAGIC = 0x4D53  # b"SM" read little-endian
VERSION = 1
HEADER_FIELDS: tuple[tuple[str, str], ...] = (
    ("magic", "H"), ("version", "B"), ("type", "B"), ("flags", "B"), ("set", "B"),
    ("rank", "H"), ("job", "I"), ("token", "Q"), ("seq", "I"), ("chunk", "I"), ("slot", "I"),
    ("count", "H"), ("elem", "B"), ("digest", "B"), ("exp_data", "h"), ("exp_next", "h"))
"""The header, field by field (name, ``struct`` code), little-endian: the one table that the
``struct`` below, the byte offsets (:data:`AT`), the tuple positions (:class:`Field`), numpy's
record view (:data:`HEADER_DTYPE`) and the compiled kernels' offsets (``kernels/frames.py``)
are all made from. docs/protocol.md section 1 shows it as a table."""
HEADER = struct.Struct("<" + "".join(code for _name, code in HEADER_FIELDS))
HEADER_SIZE = HEADER.size  # 40


def _offsets() -> dict[str, int]:
    out, at = {}, 0
    for name, code in HEADER_FIELDS:
        out[name] = at
        at += struct.calcsize("<" + code)
    return out


AT: dict[str, int] = _offsets()
"""Byte offset of each header field in a datagram (``AT["seq"] == 20``)."""
Field = IntEnum("Field", [(name.upper(), i) for i, (name, _c) in enumerate(HEADER_FIELDS)])
"""Position of each field in ``HEADER.unpack(...)``'s tuple (``Field.SEQ == 8``)."""
HEADER_DTYPE = np.dtype([(name, "<" + code) for name, code in HEADER_FIELDS])
"""The header as a numpy record (``np.frombuffer(datagrams, HEADER_DTYPE)``-style views)."""
MAX_DATAGRAM_BYTES = 65507  # largest UDP payload over IPv4
MAX_ELEMENTS_PER_PACKET = (MAX_DATAGRAM_BYTES - HEADER_SIZE) // 4  # 16366 int32
IPV4_UDP_HEADERS = 28  # IPv4 (no options) + UDP


def elements_for_mtu(mtu: int, itemsize: int = 4, *, trailer: int = 0) -> int:
    """The largest chunk (elements of ``itemsize`` bytes) whose datagram fits a path of this
    MTU without IP fragmentation: IPv4 20 + UDP 8 + switchml 40 header bytes, at most the UDP
    limit (16366 int32). 1500 -> 358, 9000 -> 2233, 65536 (loopback) -> 16366. ``trailer``:
    bytes after the payload (a quorum job's results: the contributor bitmap)."""
    if mtu < IPV4_UDP_HEADERS + HEADER_SIZE + trailer + itemsize:
        raise ValueError(f"an MTU of {mtu} bytes leaves no room for a switchml datagram "
                         f"(headers take {IPV4_UDP_HEADERS + HEADER_SIZE + trailer} bytes)")
    return min((mtu - IPV4_UDP_HEADERS - HEADER_SIZE - trailer) // itemsize,
               (MAX_DATAGRAM_BYTES - HEADER_SIZE - trailer) // itemsize)


EXP_ZERO = -32768
"""Block exponent of an all-zero block (smaller than any real exponent, so max() ignores it)."""


class MessageType(IntEnum):
    """What a datagram is. Data messages first, control messages from 16."""

    REQUEST = 1
    """Worker -> switch: one chunk (exponent of block p and/or data of block p - E)."""
    RESULT = 2
    """Switch -> worker: the aggregated chunk (multicast on completion, unicast on resend)."""
    WAITING = 3
    """Switch -> worker: answer to a retransmission into a still-open set; payload = bitmap of
    the ranks that have not contributed yet (so a worker can name silent peers)."""
    UNKNOWN_JOB = 4
    """Switch -> worker: header only, echoing the request: the switch has no such job, or the
    request is from an epoch before the job's last restart. The worker re-joins and retries."""
    MISMATCH = 5
    """Switch -> worker: the ranks disagree about a chunk (size, element type, exponent, shape
    flags or operation digest differ): the operation cannot complete. Payload: see
    ``pack_mismatch``. Sent to a rank whose chunk was refused; the first time a rank is refused,
    at once to every contributor of the round too; and later to a contributor that adds to or
    retransmits into a round with a refused rank."""
    NACK = 6
    """Switch -> worker: header only. The switch lacks the receiver's chunk ``chunk`` (on slot
    ``slot``, operation ``seq``) although later chunks of the receiver arrived: the worker
    re-sends what it has outstanding on that lane now (the chunk, or the one whose result
    releases it) instead of waiting for its timeout."""
    GONE = 7
    """Switch -> worker: header only, sealed, echoing a quorum job's re-sent request (``seq``,
    ``chunk``, ``slot``, ``set``) of a round that completed without the sender and is past its
    slot's history (``SwitchConfig.quorum_history`` rounds): its result is gone. The worker
    fails the operation at once (``RoundGone``): it is too far behind to go on; it can rejoin
    with a live rank's state."""
    JOIN = 18
    """Worker -> switch: rank joins job (creating it if unknown); ControlInfo, a cookie and a
    proof (``pack_join``); ``seq`` = first operation of the epoch. With no cookie (zeros) it
    asks for a CHALLENGE; with one, the proof is checked (``protocol/auth.py``)."""
    JOINED = 19
    """Switch -> worker: ControlInfo with the granted ``slot_base``, then the cookie the
    rank's membership began with (a LEAVE proves it)."""
    LEAVE = 20
    """Worker -> switch: a member leaves; payload: its LEAVE proof. The job and its slots go
    when every member has left."""
    LEFT = 21
    KEEPALIVE = 22
    """Worker -> switch: header only; an idle member renews the job's lease. Never creates a
    job: an unknown job is answered with UNKNOWN_JOB (the switch restarted)."""
    CHALLENGE = 23
    """Switch -> worker: answer to a JOIN without a cookie: the cookie (24 bytes) to prove the
    JOIN with, made for the JOIN's source address and good for a few seconds."""
    REFUSED = 31
    """Switch -> worker: a control request was refused; payload = UTF-8 reason."""


DATA_TYPES = frozenset({MessageType.REQUEST, MessageType.RESULT, MessageType.WAITING,
                        MessageType.UNKNOWN_JOB, MessageType.MISMATCH, MessageType.NACK,
                        MessageType.GONE})
SEALED_TYPES = frozenset({MessageType.UNKNOWN_JOB, MessageType.MISMATCH, MessageType.JOINED,
                          MessageType.LEFT, MessageType.REFUSED, MessageType.WAITING,
                          MessageType.GONE})
"""The switch's replies that may carry ``Flags.AUTH`` (docs/protocol.md, "Sealed replies"):
every one of them does, except a WAITING that names no gone rank (the compiled loop writes
those, and a worker reads them as a hint only)."""


class Flags(IntFlag):
    """Header flag bits."""

    NONE = 0
    NONFINITE = 0x01
    """The data block holds a NaN or Inf (request) / did in some worker (result: OR of all)."""
    HAS_DATA = 0x02
    """The payload is data of block ``chunk - E`` scaled with ``exp_data``."""
    HAS_EXP = 0x04
    """``exp_next`` is the exponent of block ``chunk`` (look-ahead; float operations only)."""
    RESENT = 0x08
    """Result: a unicast copy from the shadow set, answering a retransmission."""
    CONTRIBUTORS = 0x10
    """Result of a quorum job: the payload is followed by the little-endian bitmap of the
    ranks whose chunks the sum holds (``ceil(n / 8)`` bytes; ``count`` does not include it)."""
    RETRY = 0x20
    """Request of a quorum job: a retransmission. A quorum round that completed without the
    rank answers it with the stored result; a first transmission gets nothing back (the
    result's multicast reaches the rank anyway)."""
    AUTH = 0x40
    """A MAC follows: on a REQUEST or RESULT of an authenticated job (``JobSpec.auth_data``),
    its data MAC (SipHash-2-4, 128 bits, under the job's data key: ``auth.data_key``, computed
    by the compiled kernels, ``csrc/common.h``); on a switch's reply that can end, redirect or
    fail what a worker does (the types of
    :data:`SEALED_TYPES`) carries a MAC under the job key (``auth.seal_reply``): in a
    16-byte trailer after the payload, or, for the header-only UNKNOWN_JOB, in the header
    fields it does not use (``chunk``, ``slot``, ``exp_data``, ``exp_next``), so that it stays
    no larger than the request it answers."""


KNOWN_FLAGS = int(Flags.NONFINITE | Flags.HAS_DATA | Flags.HAS_EXP | Flags.RESENT)
"""The flag bits every data message may carry; one with a bit set that its type does not
define is rejected."""
REQUEST_FLAGS = KNOWN_FLAGS | int(Flags.RETRY)
"""The flag bits a REQUEST may carry."""
RESULT_FLAGS = KNOWN_FLAGS | int(Flags.CONTRIBUTORS)
"""The flag bits a RESULT may carry."""
AUTH_TAG_SIZE = 16
"""The MAC trailer of a sealed reply (``Flags.AUTH``): keyed BLAKE2b under the job key, 128
bits (``auth.seal_reply``)."""


class ElementType(IntEnum):
    """Payload element type; ``count`` is in elements of this type."""

    BYTES = 0
    INT32 = 1
    INT16 = 2
    """16-bit fixed point (the bandwidth-halving mode): twice the elements per slot."""


_AUTH = int(Flags.AUTH)
_SEALED_FLAGS = KNOWN_FLAGS | _AUTH
_ITEMSIZE = {ElementType.BYTES: 1, ElementType.INT32: 4, ElementType.INT16: 2}
ITEMSIZE = {int(k): v for k, v in _ITEMSIZE.items()}
_TYPES = {int(t): t for t in MessageType}
_ELEMS = {int(t): t for t in ElementType}


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded header. Field meanings are in ``docs/protocol.md``."""

    type: MessageType
    job: int
    rank: int = 0
    token: int = 0
    seq: int = 0
    chunk: int = 0
    slot: int = 0
    set_bit: int = 0
    count: int = 0
    elem: ElementType = ElementType.BYTES
    flags: int = 0
    exp_data: int = EXP_ZERO
    exp_next: int = EXP_ZERO
    digest: int = 0

    @property
    def payload_bytes(self) -> int:
        return self.count * _ITEMSIZE[self.elem]


def pack_header(h: Header) -> bytes:
    """Encode a header (raises ``struct.error`` on out-of-range fields: a local bug)."""
    return HEADER.pack(
        MAGIC, VERSION, h.type, h.flags, h.set_bit, h.rank, h.job, h.token, h.seq, h.chunk,
        h.slot, h.count, h.elem, h.digest, h.exp_data, h.exp_next,
    )


def unpack_header(data: Datagram) -> Header:
    """Decode and validate the header of a whole datagram.

    Raises:
        WireError: with reason ``short``, ``bad_magic``, ``bad_version``, ``bad_type``,
            ``bad_elem``, ``bad_set``, ``bad_flags`` or ``length_mismatch``.
    """
    if len(data) < HEADER_SIZE:
        raise WireError("short", f"{len(data)} bytes < header {HEADER_SIZE}")
    (magic, version, mtype, flags, set_bit, rank, job, token, seq, chunk, slot, count, elem,
     digest, exp_data, exp_next) = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError("bad_magic", f"0x{magic:04x}")
    if version != VERSION:
        raise WireError("bad_version", f"{version} (speaks {VERSION})")
    t = _TYPES.get(mtype)
    if t is None:
        raise WireError("bad_type", str(mtype))
    e = _ELEMS.get(elem)
    if e is None:
        raise WireError("bad_elem", str(elem))
    if set_bit > 1:
        raise WireError("bad_set", str(set_bit))
    if flags & ~(RESULT_FLAGS | _AUTH if t is MessageType.RESULT else
                 REQUEST_FLAGS | _AUTH if t is MessageType.REQUEST else
                 KNOWN_FLAGS | _AUTH if t is MessageType.KEEPALIVE else
                 _SEALED_FLAGS if t in SEALED_TYPES else KNOWN_FLAGS):
        raise WireError("bad_flags", f"0x{flags:02x}")
    body = HEADER_SIZE + count * _ITEMSIZE[e]
    if flags & Flags.AUTH and t is not MessageType.UNKNOWN_JOB:
        body += AUTH_TAG_SIZE
    if (len(data) != body if not flags & Flags.CONTRIBUTORS
            else not body < len(data) <= body + MAX_TRAILER):
        raise WireError(
            "length_mismatch", f"{len(data)} bytes for {count} x {e.name} after the header"
        )
    return Header(t, job, rank, token, seq, chunk, slot, set_bit, count, e, flags, exp_data,
                  exp_next, digest)


MAX_TRAILER = (1 << 16) // 8
"""The longest contributor bitmap a RESULT may carry (ranks are 16-bit)."""


def contributors(data: Datagram, header: Header) -> int | None:
    """The bitmap (bit r: rank r) of the ranks a quorum job's RESULT holds, or None for a
    result of a job without a quorum (it holds every rank)."""
    if not header.flags & Flags.CONTRIBUTORS:
        return None
    return int.from_bytes(bytes(data[HEADER_SIZE + header.payload_bytes:]), "little")


def unpack_payload(data: Datagram, header: Header) -> np.ndarray:
    """Return the payload as a read-only numpy view (int32 or uint8), without a copy."""
    dtype = {ElementType.INT32: np.dtype("<i4"), ElementType.INT16: np.dtype("<i2")}.get(
        header.elem, np.dtype(np.uint8))
    return np.frombuffer(data, dtype=dtype, count=header.count, offset=HEADER_SIZE)


@dataclass(frozen=True, slots=True)
class ControlInfo:
    """Job geometry carried by JOIN (asked) and JOINED (granted)."""

    num_workers: int
    window: int
    elements_per_packet: int
    slot_base: int = 0
    quorum: int = 0
    """k of ``JobSpec.quorum``: a round completes when k ranks are in; 0: all of them."""
    quorum_min: int = 0
    """``JobSpec.quorum_min``: the ranks a round needs at the deadline (0: no deadline)."""
    deadline_us: int = 0
    """``JobSpec.quorum_deadline_s`` in microseconds (0: none)."""
    options: int = 0
    """Bit 0 (:data:`AUTH_DATA`): the job's data plane is authenticated (``JobSpec.auth_data``:
    every REQUEST and RESULT carries a MAC). Other bits must be 0."""


AUTH_DATA = 1
"""``ControlInfo.options``: an authenticated data plane."""
_CONTROL = struct.Struct("<IIIIIIII")
COOKIE_SIZE = 24
"""A JOIN challenge's cookie: issue time (uint64, microseconds) and a 16-byte MAC."""
NO_COOKIE = bytes(COOKIE_SIZE)
"""The cookie of a JOIN that asks for a challenge."""
PROOF_SIZE = 32
"""HMAC-SHA256 proofs of JOIN and LEAVE (``protocol/auth.py``)."""
_JOIN_SIZE = _CONTROL.size + COOKIE_SIZE + PROOF_SIZE
INCARNATION_SIZE = 16
"""A JOINED's last bytes: the job's incarnation on the switch that answers (the MAC part of the
cookie that created it: new at every creation), salting an authenticated job's data key."""
_JOINED_SIZE = _CONTROL.size + COOKIE_SIZE + INCARNATION_SIZE


def pack_control_info(info: ControlInfo) -> bytes:
    return _CONTROL.pack(info.num_workers, info.window, info.elements_per_packet, info.slot_base,
                         info.quorum, info.quorum_min, info.deadline_us, info.options)


def unpack_control_info(payload: bytes | memoryview | np.ndarray) -> ControlInfo:
    """Decode a ControlInfo payload; raises WireError(``bad_control``) on a wrong size."""
    raw = bytes(payload)
    if len(raw) != _CONTROL.size:
        raise WireError("bad_control", f"control payload of {len(raw)} bytes, expected "
                        f"{_CONTROL.size}")
    return ControlInfo(*_CONTROL.unpack(raw))


def _sized(payload: bytes | memoryview | np.ndarray, size: int, what: str) -> bytes:
    raw = bytes(payload)
    if len(raw) != size:
        raise WireError("bad_control", f"{what} payload of {len(raw)} bytes, expected {size}")
    return raw


def pack_join(*, job: int, token: int, rank: int, info: ControlInfo, seq: int = 0,
              cookie: bytes = NO_COOKIE, proof: bytes = bytes(PROOF_SIZE)) -> bytes:
    """A JOIN datagram: rank ``rank`` asks for job ``job`` of geometry ``info`` (``seq``: the
    first operation of its epoch). Without a cookie it asks for a challenge; with the
    switch's cookie it carries ``auth.join_proof``. Always 124 bytes, so that the CHALLENGE
    it may draw (64) is smaller: the switch never amplifies a spoofed JOIN."""
    payload = pack_control_info(info) + cookie + proof
    if len(payload) != _JOIN_SIZE:
        raise ValueError(f"cookie must be {COOKIE_SIZE} bytes and proof {PROOF_SIZE}")
    return pack_header(Header(MessageType.JOIN, job, rank=rank, token=token, seq=seq,
                              count=len(payload), elem=ElementType.BYTES)) + payload


def unpack_join(payload: bytes | memoryview | np.ndarray) -> tuple[ControlInfo, bytes, bytes]:
    """Decode a JOIN payload: (ControlInfo, cookie, proof); WireError(``bad_control``)."""
    raw = _sized(payload, _JOIN_SIZE, "JOIN")
    c = _CONTROL.size
    return ControlInfo(*_CONTROL.unpack(raw[:c])), raw[c:c + COOKIE_SIZE], raw[c + COOKIE_SIZE:]


def pack_joined(*, job: int, token: int, rank: int, shard: int, info: ControlInfo,
                cookie: bytes, seq: int = 0, incarnation: bytes = bytes(INCARNATION_SIZE)
                ) -> bytes:
    """A JOINED datagram: the granted geometry, the rank's membership cookie and the job's
    incarnation (header ``chunk``: the index of the shard that answers; ``seq``: the JOIN's,
    its epoch)."""
    if len(incarnation) != INCARNATION_SIZE:
        raise ValueError(f"incarnation must be {INCARNATION_SIZE} bytes")
    payload = pack_control_info(info) + cookie + incarnation
    return pack_header(Header(MessageType.JOINED, job, rank=rank, token=token, seq=seq,
                              chunk=shard, count=len(payload), elem=ElementType.BYTES)) + payload


def pack_challenge(*, job: int, token: int, rank: int, shard: int, cookie: bytes) -> bytes:
    """A CHALLENGE datagram (header ``chunk``: the shard index), 64 bytes. (Packed field by
    field, not through :class:`Header`: a switch answers every stranger's JOIN with one.)"""
    return HEADER.pack(MAGIC, VERSION, _CHALLENGE, 0, 0, rank, job, token, 0, shard, 0,
                       COOKIE_SIZE, _BYTES, 0, EXP_ZERO, EXP_ZERO) + cookie


_CHALLENGE, _BYTES = int(MessageType.CHALLENGE), int(ElementType.BYTES)
JOIN_BYTES = HEADER_SIZE + _JOIN_SIZE
"""A JOIN datagram's length (always: ``pack_join``)."""
COOKIE_AT = HEADER_SIZE + _CONTROL.size
"""Where a JOIN's cookie starts."""


def unpack_challenge(payload: bytes | memoryview | np.ndarray) -> bytes:
    """Decode a CHALLENGE payload: the cookie; WireError(``bad_control``) on a wrong size."""
    return _sized(payload, COOKIE_SIZE, "CHALLENGE")


def unpack_joined(payload: bytes | memoryview | np.ndarray) -> tuple[ControlInfo, bytes]:
    """Decode a JOINED payload: (granted ControlInfo, membership cookie); its incarnation:
    :func:`joined_incarnation`."""
    raw = _sized(payload, _JOINED_SIZE, "JOINED")
    return (ControlInfo(*_CONTROL.unpack(raw[:_CONTROL.size])),
            raw[_CONTROL.size:_CONTROL.size + COOKIE_SIZE])


def joined_incarnation(payload: bytes | memoryview | np.ndarray) -> bytes:
    """The job's incarnation a JOINED payload names (its last :data:`INCARNATION_SIZE`
    bytes)."""
    return _sized(payload, _JOINED_SIZE, "JOINED")[-INCARNATION_SIZE:]


def pack_leave(*, job: int, token: int, rank: int, proof: bytes) -> bytes:
    """A LEAVE datagram carrying ``auth.leave_proof``."""
    if len(proof) != PROOF_SIZE:
        raise ValueError(f"proof must be {PROOF_SIZE} bytes")
    return pack_header(Header(MessageType.LEAVE, job, rank=rank, token=token,
                              count=PROOF_SIZE, elem=ElementType.BYTES)) + proof


def unpack_leave(payload: bytes | memoryview | np.ndarray) -> bytes:
    """Decode a LEAVE payload: its proof; WireError(``bad_control``) on a wrong size."""
    return _sized(payload, PROOF_SIZE, "LEAVE")


def operation_digest(size: int, is_float: bool, bits: int) -> int:
    """The 8-bit digest of an operation that every REQUEST carries (header byte 35).

    Ranks that disagree about an operation (another element count, floats against integers,
    another wire width) send different digests with probability 255/256, so the switch refuses
    the first chunk that disagrees instead of summing mismatched blocks or stalling.
    """
    return zlib.crc32(struct.pack("<QBB", size, is_float, bits)) & 0xFF


@dataclass(frozen=True, slots=True)
class ChunkShape:
    """What a REQUEST says about its chunk: the fields every rank must agree on."""

    count: int
    elem: int
    flags: int  # HAS_DATA | HAS_EXP bits
    exp_data: int
    digest: int

    def describe(self) -> str:
        name = _ELEMS[self.elem].name.lower() if self.elem in _ELEMS else f"type {self.elem}"
        parts = [f"{self.count} {name}"]
        if self.flags & Flags.HAS_DATA:
            parts.append("data" + ("" if self.exp_data == EXP_ZERO
                                   else f" scaled by 2^{self.exp_data}"))
        if self.flags & Flags.HAS_EXP:
            parts.append("look-ahead exponent")
        parts.append(f"operation digest 0x{self.digest:02x}")
        return ", ".join(parts)


_SHAPE = struct.Struct("<HBBhB")


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A MISMATCH payload: ``theirs`` (the shape of ``ranks``) disagrees with ``mine``."""

    theirs: ChunkShape
    mine: ChunkShape
    ranks: int  # bitmap of the ranks that sent ``theirs``


def pack_mismatch(theirs: ChunkShape, mine: ChunkShape, ranks: int, num_workers: int) -> bytes:
    """MISMATCH payload: two 7-byte shapes (``<HBBhB``: count, elem, flags, exp_data, digest),
    then the little-endian bitmap (``ceil(n/8)`` bytes) of the ranks whose chunk had
    ``theirs``."""
    return (_SHAPE.pack(theirs.count, theirs.elem, theirs.flags, theirs.exp_data, theirs.digest)
            + _SHAPE.pack(mine.count, mine.elem, mine.flags, mine.exp_data, mine.digest)
            + ranks.to_bytes((num_workers + 7) // 8, "little"))


def unpack_mismatch(payload: bytes | memoryview | np.ndarray) -> Mismatch:
    """Decode a MISMATCH payload; raises WireError(``bad_mismatch``) when too short."""
    raw = bytes(payload)
    if len(raw) < 2 * _SHAPE.size + 1:
        raise WireError("bad_mismatch", f"MISMATCH payload of {len(raw)} bytes, expected at "
                        f"least {2 * _SHAPE.size + 1}")
    theirs = ChunkShape(*_SHAPE.unpack_from(raw, 0))
    mine = ChunkShape(*_SHAPE.unpack_from(raw, _SHAPE.size))
    return Mismatch(theirs, mine, int.from_bytes(raw[2 * _SHAPE.size:], "little"))
