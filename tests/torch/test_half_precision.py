"""Half-precision tensors on the backend: how many bits they take on the wire
(``staging.wire_bits``, worked by hand below), and their staging through reused buffers.

The 16-bit sum of n ranks is off by at most ``n * 0.5 * 2**(emax - P)`` with
``P = 15 - bit_length(n)`` (docs/protocol.md section 4): relative to a block's scale
``2**emax``, ``n * 2**(bit_length(n) - 16)``. A half-precision type rounds a value there by
half its epsilon: float16 ``2**-11``, bfloat16 ``2**-8``. Worked out:

    n:          2      3          4      5           8      15          16
    bound:   2**-13  3*2**-14  2**-11  5*2**-13   2**-9  15*2**-12   2**-7

so float16 fits up to 4 ranks and bfloat16 up to 15.
"""

from __future__ import annotations

import pytest
import torch

from switchml import env
from switchml.torch.staging import StagedTensor, StagingPool, wire_bits


@pytest.mark.parametrize(("dtype", "last16"), [(torch.float16, 4), (torch.bfloat16, 15)])
def test_half_types_take_16_bits_while_the_bound_is_within_their_rounding(dtype, last16):
    assert [wire_bits(dtype, n) for n in (2, last16, last16 + 1, 64)] == [16, 16, 32, 32]


def test_other_types_take_32_bits_and_the_setting_overrides_auto():
    for dtype in (torch.float32, torch.float64, torch.int32):
        assert wire_bits(dtype, 2) == 32 and wire_bits(dtype, 2, 16) == 32
    assert wire_bits(torch.bfloat16, 64, 16) == 16
    assert wire_bits(torch.float16, 2, 32) == 32


def test_the_setting_is_read_and_checked(monkeypatch):
    monkeypatch.delenv("SWITCHML_HALF_BITS", raising=False)
    assert env.half_bits() is None
    for text, want in (("auto", None), ("16", 16), ("32", 32)):
        monkeypatch.setenv("SWITCHML_HALF_BITS", text)
        assert env.half_bits() == want
    monkeypatch.setenv("SWITCHML_HALF_BITS", "8")
    with pytest.raises(ValueError, match="SWITCHML_HALF_BITS must be auto, 16 or 32, got '8'"):
        env.half_bits()


def test_half_tensors_are_summed_in_place_through_a_view_not_a_copy():
    """bfloat16 and float16 go to the kernels as they are: ``array`` is the tensor's own memory
    (bfloat16 as ml_dtypes' type), and what the switch hands back is the result."""
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        x = torch.tensor([1.0, -3.0, 0.1, 2.0**-9], dtype=dtype)
        before = x.tolist()
        staged = StagedTensor(x, pool=StagingPool())
        assert staged.staging is None and staged.array.dtype.name == name
        assert staged.array.ctypes.data == x.data_ptr()
        assert [float(v) for v in staged.array] == before
        staged.array *= 2  # what the switch hands back (two ranks' equal inputs: exact)
        staged.finish(2, average=False)
        assert x.tolist() == [2 * v for v in before]


def test_a_staged_copy_writes_back_and_its_buffer_is_reused():
    """A tensor that cannot be viewed (here: not contiguous) goes through a copy in its own
    type; the next operation of that size takes the same buffer back from the pool (a fresh
    one costs page faults every time)."""
    pool = StagingPool(keep=2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.tensor([[1.0, 9.0], [-3.0, 9.0], [0.1, 9.0], [2.0**-9, 9.0]], dtype=dtype)
        column = x[:, 0]
        staged = StagedTensor(column, pool=pool)
        assert staged.staging is not None and staged.flat.dtype is dtype
        want = (column.double() * 3).to(dtype).tolist()
        staged.array *= 3
        buffer = staged.flat.data_ptr()
        staged.finish(3, average=False)
        assert column.tolist() == want and x[:, 1].tolist() == [9.0] * 4
        again = StagedTensor(torch.zeros(8, dtype=dtype)[::2], pool=pool)
        assert again.flat.data_ptr() == buffer
        again.release()
        again.release()  # idempotent: given back once
        assert StagedTensor(torch.zeros(8, dtype=dtype)[::2], pool=pool).flat.data_ptr() == buffer


def test_the_pool_keeps_a_bounded_number_of_buffers():
    pool = StagingPool(keep=2)
    bufs = [pool.take(8, torch.float32) for _ in range(3)]
    for b in bufs:
        pool.give(b)
    taken = [pool.take(8, torch.float32) for _ in range(3)]
    ptrs = {t.data_ptr() for t in taken}
    assert {bufs[1].data_ptr(), bufs[2].data_ptr()} <= ptrs  # the two newest came back
    assert bufs[0].data_ptr() not in ptrs  # the oldest was let go
    assert pool.take(5, torch.float32).numel() == 5  # another size: a new buffer


def test_a_pool_that_keeps_nothing_keeps_nothing_and_a_negative_size_is_refused():
    pool = StagingPool(keep=0)
    first = pool.take(8, torch.float32)
    pool.give(first)
    assert pool.take(8, torch.float32).data_ptr() != first.data_ptr()
    with pytest.raises(ValueError, match="keep must be >= 0, got -1"):
        StagingPool(keep=-1)


def test_a_strided_half_tensor_is_staged_and_written_back_through_its_view_only():
    base = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    view = base[:, 1::2]  # non-contiguous
    staged = StagedTensor(view, pool=StagingPool())
    assert staged.flat.tolist() == view.float().reshape(-1).tolist()
    staged.array *= 2
    staged.finish(2, average=True)  # (x * 2) / 2: exact
    assert base.tolist() == torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).tolist()
    staged = StagedTensor(view, pool=StagingPool())
    staged.array += 100
    staged.finish(1, average=False)
    want = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    want[:, 1::2] += 100
    assert base.tolist() == want.to(torch.bfloat16).tolist()
