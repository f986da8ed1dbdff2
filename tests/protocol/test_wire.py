"""Wire format: golden bytes, round trips and strict decoding (``switchml.protocol.wire``)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from switchml.protocol import wire
from switchml.protocol.errors import RemoteProtocolError, SwitchMLError, WireError
from switchml.protocol.wire import (
    EXP_ZERO,
    HEADER_SIZE,
    ControlInfo,
    ElementType,
    Flags,
    Header,
    MessageType,
    pack_control_info,
    pack_header,
    unpack_control_info,
    unpack_header,
    unpack_payload,
)

LAYOUT = "<HBBBBHIQIIIHBBhh"

# A header where every field has a distinct, multi-byte value, so that a swapped or shifted
# field shows up in the bytes.
SAMPLE = Header(
    type=MessageType.REQUEST,
    job=0xA1B2C3D4,
    rank=0x0102,
    token=0x1122334455667788,
    seq=0xDEADBEEF,
    chunk=0x01020304,
    slot=0x0A0B0C0D,
    set_bit=1,
    count=3,
    elem=ElementType.INT32,
    flags=int(Flags.HAS_DATA | Flags.NONFINITE),
    exp_data=-1234,
    exp_next=4321,
    digest=0xA7,
)


def _raw(*, magic=0x4D53, version=1, mtype=int(MessageType.REQUEST), flags=0, set_bit=0,
         rank=0, job=1, token=2, seq=3, chunk=4, slot=5, count=0, elem=int(ElementType.INT32),
         reserved=0, exp_data=EXP_ZERO, exp_next=EXP_ZERO) -> bytes:
    """Hand-built header bytes with any field (also an invalid one)."""
    return struct.pack(LAYOUT, magic, version, mtype, flags, set_bit, rank, job, token, seq,
                       chunk, slot, count, elem, reserved, exp_data, exp_next)


def _reason(data: bytes) -> str:
    with pytest.raises(WireError) as info:
        unpack_header(data)
    return info.value.reason


# -- Layout -----------------------------------------------------------------------------------


def test_header_size_is_40_bytes():
    assert HEADER_SIZE == 40
    assert struct.calcsize(LAYOUT) == 40
    assert wire.HEADER.format == LAYOUT


def test_constants():
    assert wire.MAGIC == 0x4D53
    assert wire.VERSION == 1
    assert EXP_ZERO == -32768
    assert wire.MAX_DATAGRAM_BYTES == 65507
    assert wire.MAX_ELEMENTS_PER_PACKET == (65507 - 40) // 4 == 16366


def test_header_golden_bytes():
    expected = struct.pack(
        LAYOUT, 0x4D53, 1, 1, 0x03, 1, 0x0102, 0xA1B2C3D4, 0x1122334455667788, 0xDEADBEEF,
        0x01020304, 0x0A0B0C0D, 3, 1, 0xA7, -1234, 4321,
    )
    got = pack_header(SAMPLE)
    assert got == expected
    # Spot checks independent of struct: magic reads "SM", fields at their byte offsets.
    assert got[0:2] == b"SM"
    assert got[2] == 1  # version
    assert got[3] == 1  # type REQUEST
    assert got[4] == 0x03  # flags
    assert got[5] == 1  # set
    assert got[6:8] == bytes([0x02, 0x01])  # rank, little-endian
    assert got[8:12] == bytes([0xD4, 0xC3, 0xB2, 0xA1])  # job
    assert got[12:20] == bytes.fromhex("8877665544332211")  # token
    assert got[20:24] == bytes.fromhex("efbeadde")  # seq
    assert got[24:28] == bytes.fromhex("04030201")  # chunk
    assert got[28:32] == bytes.fromhex("0d0c0b0a")  # slot
    assert got[32:34] == bytes([3, 0])  # count
    assert got[34] == 1  # elem INT32
    assert got[35] == 0xA7  # operation digest
    assert got[36:38] == (-1234).to_bytes(2, "little", signed=True)
    assert got[38:40] == (4321).to_bytes(2, "little", signed=True)


def test_header_golden_bytes_defaults():
    got = pack_header(Header(MessageType.LEAVE, job=9))
    assert got == struct.pack(LAYOUT, 0x4D53, 1, 20, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0,
                              -32768, -32768)


def test_pack_header_out_of_range_field_raises_struct_error():
    with pytest.raises(struct.error):
        pack_header(Header(MessageType.REQUEST, job=2**32))
    with pytest.raises(struct.error):
        pack_header(Header(MessageType.REQUEST, job=1, rank=2**16))


# -- Round trips ------------------------------------------------------------------------------


def test_message_types_are_the_documented_numbers():
    assert {t.name: int(t) for t in MessageType} == {
        "REQUEST": 1, "RESULT": 2, "WAITING": 3, "UNKNOWN_JOB": 4, "MISMATCH": 5, "NACK": 6,
        "GONE": 7, "JOIN": 18,
        "JOINED": 19, "LEAVE": 20, "LEFT": 21, "KEEPALIVE": 22, "CHALLENGE": 23, "REFUSED": 31,
    }
    assert {int(f) for f in (Flags.NONFINITE, Flags.HAS_DATA, Flags.HAS_EXP, Flags.RESENT)} == {
        1, 2, 4, 8}


@pytest.mark.parametrize("mtype", list(MessageType), ids=lambda t: t.name)
def test_round_trip_every_message_type(mtype):
    if mtype in wire.DATA_TYPES:
        values = np.array([7, -8, 2**31 - 1, -(2**31)], dtype="<i4")
        payload = values.tobytes()
        elem = ElementType.INT32
        count = values.size
    else:
        payload = pack_control_info(ControlInfo(3, 16, 256, 12))
        elem = ElementType.BYTES
        count = len(payload)
    h = Header(mtype, job=4000000000, rank=65535, token=2**64 - 1, seq=2**32 - 1, chunk=77,
               slot=1234, set_bit=1, count=count, elem=elem, flags=int(Flags.HAS_EXP),
               exp_data=-32768, exp_next=32767)
    data = pack_header(h) + payload
    got = unpack_header(data)
    assert got == h
    assert got.type is mtype
    assert got.elem is elem
    assert got.payload_bytes == len(payload)
    body = unpack_payload(data, got)
    assert body.tobytes() == payload
    if elem is ElementType.INT32:
        assert body.dtype == np.dtype("<i4")
        assert body.tolist() == [7, -8, 2**31 - 1, -(2**31)]
    else:
        assert body.dtype == np.uint8


def test_round_trip_accepts_bytearray_and_memoryview():
    payload = np.arange(3, dtype="<i4").tobytes()
    data = pack_header(SAMPLE) + payload
    for view in (bytearray(data), memoryview(data)):
        assert unpack_header(view) == SAMPLE
        assert unpack_payload(view, SAMPLE).tolist() == [0, 1, 2]


def test_unpack_payload_is_a_read_only_view():
    data = pack_header(SAMPLE) + np.array([1, 2, 3], dtype="<i4").tobytes()
    body = unpack_payload(data, unpack_header(data))
    assert not body.flags.writeable
    with pytest.raises(ValueError):
        body[0] = 5


def test_all_known_flags_accepted():
    for flags in range(16):
        h = Header(MessageType.RESULT, job=1, flags=flags)
        assert unpack_header(pack_header(h)).flags == flags


def test_zero_count_payload():
    h = Header(MessageType.REQUEST, job=1, count=0, elem=ElementType.INT32)
    data = pack_header(h)
    assert len(data) == HEADER_SIZE
    assert unpack_header(data) == h
    assert unpack_payload(data, h).size == 0


# -- Decode errors ----------------------------------------------------------------------------


def test_valid_raw_header_decodes():
    # The baseline for the error cases below: with no field broken, _raw decodes.
    h = unpack_header(_raw())
    assert (h.type, h.job, h.token, h.seq, h.chunk, h.slot) == (MessageType.REQUEST, 1, 2, 3, 4,
                                                                 5)


@pytest.mark.parametrize("size", [0, 1, 20, 39])
def test_short(size):
    assert _reason(_raw()[:size]) == "short"


def test_bad_magic():
    assert _reason(_raw(magic=0x534D)) == "bad_magic"  # "MS": byte-swapped
    assert _reason(_raw(magic=0)) == "bad_magic"


@pytest.mark.parametrize("version", [0, 2, 255])
def test_bad_version(version):
    assert _reason(_raw(version=version)) == "bad_version"


@pytest.mark.parametrize("mtype", [0, 8, 15, 16, 17, 24, 30, 32, 255])
def test_bad_type(mtype):
    assert _reason(_raw(mtype=mtype)) == "bad_type"


@pytest.mark.parametrize("elem", [3, 4, 255])
def test_bad_elem(elem):
    assert _reason(_raw(elem=elem)) == "bad_elem"


@pytest.mark.parametrize("set_bit", [2, 255])
def test_bad_set(set_bit):
    assert _reason(_raw(set_bit=set_bit)) == "bad_set"


@pytest.mark.parametrize("flags", [0x10, 0x80, 0xFF])
def test_bad_flags(flags):
    assert _reason(_raw(flags=flags)) == "bad_flags"  # (a REQUEST's)


@pytest.mark.parametrize("mtype", [MessageType.REQUEST, MessageType.RESULT])
def test_an_authenticated_jobs_data_carries_its_mac_after_the_payload(mtype):
    """AUTH on a REQUEST or RESULT: 16 bytes of MAC follow the payload, outside ``count``."""
    assert _reason(_raw(mtype=int(mtype), flags=0x40)) == "length_mismatch"
    assert unpack_header(_raw(mtype=int(mtype), flags=0x40) + bytes(16)).flags == 0x40
    assert _reason(_raw(mtype=int(MessageType.NACK), flags=0x40) + bytes(16)) == "bad_flags"


@pytest.mark.parametrize(("mtype", "flags", "ok"), [
    (MessageType.REQUEST, 0x20, True), (MessageType.RESULT, 0x20, False),
    (MessageType.WAITING, 0x20, False), (MessageType.RESULT, 0x10, True),
    (MessageType.REQUEST, 0x10, False), (MessageType.NACK, 0x10, False)])
def test_retry_is_a_requests_flag_and_contributors_a_results(mtype, flags, ok):
    data = _raw(mtype=int(mtype), flags=flags) + (b"\x05" if flags == 0x10 else b"")
    if ok:
        assert unpack_header(data).flags == flags
    else:
        assert _reason(data) == "bad_flags"


def test_length_mismatch_truncated_payload():
    payload = np.arange(4, dtype="<i4").tobytes()
    data = _raw(count=4) + payload
    assert unpack_header(data).count == 4
    assert _reason(data[:-1]) == "length_mismatch"
    assert _reason(data[:-4]) == "length_mismatch"
    assert _reason(_raw(count=4)) == "length_mismatch"


def test_length_mismatch_trailing_garbage():
    payload = np.arange(4, dtype="<i4").tobytes()
    assert _reason(_raw(count=4) + payload + b"\x00") == "length_mismatch"
    assert _reason(_raw(count=0) + b"x") == "length_mismatch"


def test_length_counts_elements_of_the_element_type():
    # 8 bytes are 8 BYTES elements but 2 INT32 elements.
    assert unpack_header(_raw(count=8, elem=0) + bytes(8)).count == 8
    assert _reason(_raw(count=8, elem=1) + bytes(8)) == "length_mismatch"
    assert unpack_header(_raw(count=2, elem=1) + bytes(8)).count == 2


def test_wire_error_hierarchy_and_message():
    err = WireError("bad_magic", "0x1234")
    assert isinstance(err, RemoteProtocolError)
    assert isinstance(err, SwitchMLError)
    assert err.reason == "bad_magic"
    assert str(err) == "bad_magic: 0x1234"
    assert str(WireError("short")) == "short"


# -- Control info -----------------------------------------------------------------------------


def test_control_info_golden_and_round_trip():
    info = ControlInfo(num_workers=40, window=16, elements_per_packet=16366, slot_base=4000,
                       quorum=37, quorum_min=20, deadline_us=250000, options=1)
    raw = pack_control_info(info)
    assert raw == struct.pack("<IIIIIIII", 40, 16, 16366, 4000, 37, 20, 250000, 1)
    assert unpack_control_info(raw) == info
    assert unpack_control_info(memoryview(raw)) == info
    assert unpack_control_info(np.frombuffer(raw, dtype=np.uint8)) == info
    assert ControlInfo(1, 2, 3).slot_base == 0 and ControlInfo(1, 2, 3).quorum == 0


def test_control_info_inside_a_datagram():
    info = ControlInfo(2, 8, 64, 0)
    h = Header(MessageType.JOIN, job=5, rank=1, token=99, count=32, elem=ElementType.BYTES)
    data = pack_header(h) + pack_control_info(info)
    got = unpack_header(data)
    assert unpack_control_info(unpack_payload(data, got)) == info


def test_join_joined_challenge_and_leave_golden_bytes():
    """The control payloads byte by byte, as docs/protocol.md's table gives them."""
    info = ControlInfo(4, 16, 358)
    cookie, proof = bytes(range(24)), bytes(range(100, 132))
    join = wire.pack_join(job=5, token=0x1122, rank=3, seq=7, info=info, cookie=cookie,
                          proof=proof)
    assert len(join) == 128
    assert join[40:] == struct.pack("<IIIIIIII", 4, 16, 358, 0, 0, 0, 0, 0) + cookie + proof
    h = unpack_header(join)
    assert (h.type, h.job, h.rank, h.token, h.seq, h.count) == (MessageType.JOIN, 5, 3, 0x1122,
                                                                  7, 88)
    assert wire.unpack_join(unpack_payload(join, h)) == (info, cookie, proof)
    hello = wire.pack_join(job=5, token=0x1122, rank=3, info=info)
    assert hello[40 + 32:] == bytes(56)  # no cookie, no proof: asks for a challenge
    challenge = wire.pack_challenge(job=5, token=0x1122, rank=3, shard=2, cookie=cookie)
    assert len(challenge) == 64 < len(hello)  # never amplifies a spoofed JOIN
    assert challenge[24:28] == (2).to_bytes(4, "little") and challenge[40:] == cookie
    joined = wire.pack_joined(job=5, token=0x1122, rank=3, shard=0,
                              info=ControlInfo(4, 16, 358, 64, 3, options=1), cookie=cookie,
                              incarnation=bytes(range(200, 216)))
    assert joined[40:] == (struct.pack("<IIIIIIII", 4, 16, 358, 64, 3, 0, 0, 1) + cookie
                           + bytes(range(200, 216)))
    assert wire.joined_incarnation(joined[40:]) == bytes(range(200, 216))
    leave = wire.pack_leave(job=5, token=0x1122, rank=3, proof=proof)
    assert leave[40:] == proof and unpack_header(leave).count == 32
    for raw, unpack in ((join[40:-1], wire.unpack_join), (joined[40:] + b"x", wire.unpack_joined),
                        (cookie[1:], wire.unpack_challenge), (b"", wire.unpack_leave)):
        with pytest.raises(WireError) as e:
            unpack(raw)
        assert e.value.reason == "bad_control"


@pytest.mark.parametrize("size", [0, 16, 20, 28, 31, 33])
def test_bad_control(size):
    with pytest.raises(WireError) as info:
        unpack_control_info(bytes(size))
    assert info.value.reason == "bad_control"


def test_operation_digest_separates_what_ranks_may_disagree_about():
    d = wire.operation_digest
    assert 0 <= d(1000, True, 32) <= 255
    assert d(1000, True, 32) == d(1000, True, 32)  # deterministic: every rank computes it
    others = {d(1001, True, 32), d(1000, False, 32), d(1000, True, 16), d(999, True, 32)}
    assert d(1000, True, 32) not in others
    # 8 bits: over many sizes the digests spread over (nearly) every value.
    assert len({d(n, True, 32) for n in range(1, 5000)}) > 250


def test_mismatch_payload_round_trip_and_short_payload_rejected():
    a = wire.ChunkShape(16366, int(ElementType.INT32), int(Flags.HAS_DATA), -7, 0x12)
    b = wire.ChunkShape(3, int(ElementType.INT16), int(Flags.HAS_EXP), EXP_ZERO, 0xFE)
    raw = wire.pack_mismatch(a, b, (1 << 40) | 1, 41)
    assert len(raw) == 7 + 7 + 6
    m = wire.unpack_mismatch(raw)
    assert (m.theirs, m.mine, m.ranks) == (a, b, (1 << 40) | 1)
    assert "16366 int32" in a.describe() and "2^-7" in a.describe()
    assert "3 int16" in b.describe() and "look-ahead" in b.describe()
    with pytest.raises(WireError) as e:
        wire.unpack_mismatch(raw[:14])
    assert e.value.reason == "bad_mismatch"


def test_the_documented_byte_table_is_the_header_table():
    """docs/protocol.md section 1 lists every field with its offset and size; they must be
    wire.HEADER_FIELDS', from which the struct, the kernels' offsets and the record dtype
    are all made."""
    import pathlib
    import re

    doc = pathlib.Path(__file__).parents[2] / "docs" / "protocol.md"
    rows = re.findall(r"^\| *(\d+) \| *(\d+) \| `(\w+)` \|", doc.read_text(), re.M)
    documented = [(name, int(off), int(size)) for off, size, name in rows]
    table = [(name, wire.AT[name], struct.calcsize("<" + code))
             for name, code in wire.HEADER_FIELDS]
    assert documented == table
    assert wire.HEADER_DTYPE.itemsize == wire.HEADER_SIZE == 40
    assert [wire.HEADER_DTYPE.fields[n][1] for n, _c in wire.HEADER_FIELDS] == [
        off for _n, off, _s in table]
    from switchml.protocol.kernels import frames
    assert [getattr(frames, "H_" + n.upper()) for n, _c in wire.HEADER_FIELDS] == [
        off for _n, off, _s in table]
