"""Gaia's rules, one test each, without sockets."""

from __future__ import annotations

import numpy as np
import pytest

from switchml.gaia.rules import (
    MirrorClock,
    SelectiveBarrier,
    SignificanceFilter,
    decode_announce,
    decode_sparse,
    encode_announce,
    encode_sparse,
    parse_dc_layout,
    significance_threshold,
)
from switchml.protocol.errors import ConfigError


def test_threshold_decays_as_s_over_sqrt_t():
    assert significance_threshold(1) == 0.01
    assert significance_threshold(4) == pytest.approx(0.005)
    assert significance_threshold(100, threshold=0.05) == pytest.approx(0.005)
    assert significance_threshold(100, threshold=0.05, decay=False) == 0.05
    with pytest.raises(ConfigError, match="from 1"):
        significance_threshold(0)
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        significance_threshold(1, threshold=2.0)
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        significance_threshold(1, threshold=-0.1)
    assert significance_threshold(9, threshold=0.0) == 0.0  # every non-zero update counts


def test_filter_sends_significant_entries_and_keeps_accumulating_the_rest():
    params = np.array([1.0, 1.0, 0.0, -2.0], np.float32)
    f = SignificanceFilter(4)  # S = 1%
    f.add(np.array([0.02, 0.005, 0.001, -0.01], np.float32))
    idx, vals = f.select(params, clock=1)
    # 0: 2% > 1%; 1: 0.5% stays; 2: any change of a zero is significant; 3: 0.5% stays
    assert idx.tolist() == [0, 2] and vals.tolist() == pytest.approx([0.02, 0.001])
    assert f.accumulated.tolist() == pytest.approx([0.0, 0.005, 0.0, -0.01])
    f.add(np.array([0.0, 0.006, 0.0, -0.011], np.float32))
    idx2, vals2 = f.select(params, clock=1)
    assert idx2.tolist() == [1, 3] and vals2.tolist() == pytest.approx([0.011, -0.021])
    # nothing lost: what was sent is what was added
    assert (vals.sum() + vals2.sum()) == pytest.approx(0.02 + 0.011 + 0.001 - 0.021)
    # at clock 4 the threshold is 0.5%: 0.6% of 1 is significant there, not at clock 1
    f.add(np.array([0.006, 0.0, 0.0, 0.0], np.float32))
    assert f.select(params, clock=1)[0].tolist() == []
    assert f.select(params, clock=4)[0].tolist() == [0]


def test_selective_barrier_holds_until_announced_updates_are_applied():
    b = SelectiveBarrier()
    assert b.may_proceed()
    b.announce(1, 5)
    b.announce(2, 5)
    assert not b.may_proceed() and b.pending == [(1, 5), (2, 5)]
    b.applied(1, 5)
    assert not b.may_proceed()
    b.applied(2, 5)
    assert b.may_proceed()
    with pytest.raises(ValueError, match="not announced"):
        b.applied(1, 6)


def test_selective_barrier_blocks_only_the_announced_tensors_until_all_entries_are_in():
    b = SelectiveBarrier()
    b.announce(1, 5, tensors=[0, 3], entries=120)
    b.announce(2, 6, tensors=[3, 4], entries=10)
    assert b.blocked([0, 1, 2]) == {0}            # 1 and 2: nothing announced, read at once
    assert b.blocked(up_to=5) == {0, 3}           # clock 6's update is not due at clock 5
    assert b.blocked() == {0, 3, 4}
    b.applied(1, 5, 100)                          # a piece: 20 entries still to come
    assert b.blocked([0]) == {0} and b.pending == [(1, 5), (2, 6)]
    b.applied(1, 5, 20)
    assert b.blocked([0, 3], up_to=5) == set() and b.blocked([3]) == {3}


def test_an_announce_carries_the_entry_count_and_a_tensor_bitmap():
    data = encode_announce(7, np.array([0, 9, 10]), 11)
    assert len(data) == 8 + 2
    assert data[:8] == (7).to_bytes(8, "little") and data[8:] == bytes([0b1, 0b110])
    entries, tensors = decode_announce(data, 11)
    assert entries == 7 and tensors.tolist() == [0, 9, 10]
    with pytest.raises(ValueError, match="has 10 bytes, got 9"):
        decode_announce(data[:9], 11)
    with pytest.raises(ValueError, match="past the model's 10"):
        decode_announce(data, 10)
    with pytest.raises(ValueError, match="no entries or no tensors"):
        decode_announce(encode_announce(0, np.array([1]), 11), 11)


def test_mirror_clock_bounds_how_far_a_data_centre_runs_ahead():
    c = MirrorClock(3, 0, staleness=1)
    assert c.finish() == 1 and c.may_start()      # 1 ahead of the slowest: allowed
    assert c.finish() == 2 and not c.may_start()  # 2 ahead: wait
    assert c.waiting_for() == [1, 2]
    c.observe(1, 1)
    assert not c.may_start() and c.waiting_for() == [2]
    c.observe(2, 3)
    assert c.may_start()
    c.observe(2, 1)  # clocks never go back
    assert c.clocks == [2, 1, 3]
    lockstep = MirrorClock(2, 1, staleness=0)
    lockstep.finish()
    assert not lockstep.may_start()
    lockstep.observe(0, 1)
    assert lockstep.may_start()
    with pytest.raises(ConfigError):
        MirrorClock(2, 2)


def test_sparse_updates_round_trip_at_eight_bytes_an_entry():
    idx = np.array([3, 70000, 5], np.int32)
    vals = np.array([0.5, -1.25, 3.0], np.float32)
    data = encode_sparse(idx, vals)
    assert len(data) == 24
    i, v = decode_sparse(data)
    assert i.tolist() == idx.tolist() and v.tolist() == vals.tolist()
    with pytest.raises(ValueError, match="8 bytes"):
        decode_sparse(data[:-1])


def test_data_centres_from_a_layout():
    assert parse_dc_layout("2x2") == [[0, 1], [2, 3]]
    assert parse_dc_layout("3,1") == [[0, 1, 2], [3]]
    assert parse_dc_layout("0,1,0,1", workers=4) == [[0, 2], [1, 3]]
    assert parse_dc_layout("1x3") == [[0, 1, 2]]
    with pytest.raises(ConfigError, match="expected 4"):
        parse_dc_layout("2x3", workers=4)
    with pytest.raises(ConfigError, match="bad data-centre layout"):
        parse_dc_layout("two")
    with pytest.raises(ConfigError, match="no data centres given"):
        parse_dc_layout(None)
