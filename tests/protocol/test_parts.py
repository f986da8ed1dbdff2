"""A job split into parts (protocol/parts.py): the parts' jobs and the split of an operation."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchml.protocol.config import JobSpec
from switchml.protocol.errors import ConfigError
from switchml.protocol.parts import block_elements, part_specs, part_window, split

SPEC = JobSpec(job_id=7, token=0x0123456789ABCDEF, num_workers=4, window=4,
               elements_per_packet=10)


def test_one_thread_is_the_job_itself():
    assert part_specs(SPEC, 1) == [SPEC]
    assert split(95, SPEC, 1) == [(0, 95)]


def test_parts_are_distinct_jobs_sharing_the_window_and_everything_else():
    parts = part_specs(SPEC, 3)
    assert (parts[0].job_id, parts[0].token) == (SPEC.job_id, SPEC.token)
    assert len({p.job_id for p in parts}) == 3 and len({p.token for p in parts}) == 3
    for p in parts:
        assert p.window == 4  # below the 16-slot floor: each part keeps the job's window
        assert (p.num_workers, p.elements_per_packet, p.scale_count) == (4, 10, 4)


def test_part_ids_follow_the_documented_keyed_blake2b():
    # Computed here from the rule in the docstring, not by the module's code.
    digest = hashlib.blake2b(b"switchml part" + (7).to_bytes(4, "little")
                             + (2).to_bytes(2, "little"),
                             key=(0x0123456789ABCDEF).to_bytes(8, "little"),
                             digest_size=12).digest()
    part = part_specs(SPEC, 3)[2]
    assert part.job_id == int.from_bytes(digest[:4], "little") & 0x7FFFFFFF  # no tenant's
    assert part.token == int.from_bytes(digest[4:], "little")


def test_another_token_names_other_parts():
    other = JobSpec(job_id=7, token=1, num_workers=4, window=4, elements_per_packet=10)
    assert part_specs(other, 2)[1].job_id != part_specs(SPEC, 2)[1].job_id


@pytest.mark.parametrize(("window", "threads", "expected"), [
    (128, 1, 128), (128, 2, 64), (128, 4, 32), (128, 8, 16), (128, 16, 16),  # W / T, then 16
    (40, 2, 20), (40, 3, 16), (29, 2, 16), (16, 8, 16),  # floor(W / T) below 16: 16
    (4, 3, 4), (1, 8, 1),  # a window below 16: every part keeps all of it
    (16, 32, 8), (16, 64, 4), (1, 64, 1),  # past 16 threads: 256 slots in all at the most
    (1024, 64, 16),  # (a window that large shares out above the floor)
])
def test_a_part_keeps_its_share_of_the_window_but_at_least_16_slots(window, threads, expected):
    spec = JobSpec(job_id=1, token=2, num_workers=2, window=window, elements_per_packet=10)
    assert part_window(spec, threads) == expected


@pytest.mark.parametrize(("size", "threads", "bits", "expected"), [
    # SPEC: blocks of 10 elements at 32 bits, part window 4 (the job's whole window)
    (100, 2, 32, [(0, 50), (50, 100)]),      # 10 blocks: 2 part windows and more: both parts
    (130, 3, 32, [(0, 50), (50, 100), (100, 130)]),  # 13 blocks: 5 each, the last one short
    (35, 2, 32, [(0, 35)]),                  # 4 blocks < 2 part windows: part 0 alone
    (0, 2, 32, [(0, 0)]),                    # empty: part 0, empty
    (100, 2, 16, [(0, 100)]),                # 16 bits: blocks of 20, 5 blocks: part 0 alone
    (200, 2, 16, [(0, 100), (100, 200)]),    # 10 blocks of 20: 5 + 5
    (100, 4, 32, [(0, 50), (50, 100)]),      # 10 blocks / 4 per part: 2 parts of 4
    (160, 4, 32, [(0, 40), (40, 80), (80, 120), (120, 160)]),
])
def test_split_by_hand(size, threads, bits, expected):
    assert split(size, SPEC, threads, bits) == expected


@settings(derandomize=True, max_examples=200, deadline=None)
@given(size=st.integers(0, 5000), threads=st.integers(1, 8), bits=st.sampled_from([16, 32]),
       window=st.integers(1, 40))
def test_split_covers_the_operation_on_block_boundaries(size, threads, bits, window):
    spec = JobSpec(job_id=1, token=2, num_workers=2, window=window, elements_per_packet=10)
    pieces = split(size, spec, threads, bits)
    k = block_elements(spec, bits)
    assert 1 <= len(pieces) <= threads
    assert pieces[0][0] == 0 and pieces[-1][1] == size
    for (a, b), (c, _d) in zip(pieces, pieces[1:]):
        assert b == c and a < b  # contiguous, none empty but a lone first
    assert all(a % k == 0 for a, _ in pieces)  # every block, and its exponent, is unchanged
    # each part in use has at least a part window of blocks (small operations stay whole)
    if len(pieces) > 1:
        assert all(-(-(b - a) // k) >= 1 for a, b in pieces)
        assert -(-size // k) >= len(pieces) * part_window(spec, threads)


@pytest.mark.parametrize("threads", [0, 65, 2.0, "2"])
def test_bad_thread_counts_are_refused(threads):
    with pytest.raises(ConfigError, match="threads must be an integer in 1..64"):
        part_specs(SPEC, threads)


def test_bad_bits_and_size_are_refused():
    with pytest.raises(ConfigError, match="bits must be 16 or 32"):
        split(10, SPEC, 2, bits=8)
    with pytest.raises(ConfigError, match="size must be >= 0"):
        split(-1, SPEC, 2)
