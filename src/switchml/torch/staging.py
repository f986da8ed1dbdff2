"""How a tensor travels through the switch (``torch/backend.py`` and the DDP hooks): a flat
numpy view of it, or of a staging copy from a pool of host buffers; int64 as three int32 limbs;
the write-back, with AVG's division; and the bits a dtype takes on the wire."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from switchml.protocol.quantize import error_bound

__all__ = ["HALF", "StagedTensor", "StagingPool", "wire_bits"]

HALF = {torch.float16, torch.bfloat16}
"""The half types: widened exactly to float32 for the switch, rounded back once."""


class StagingPool:
    """Host buffers for staged tensors, kept for the next operation of the same type and size.

    A fresh allocation of tens of megabytes comes from the kernel as untouched pages, and
    faulting them in costs more than the copy that fills them (64 MiB: about 28 against 3 ms
    here); a training job all-reduces the same sizes every step. Keeps at most ``keep`` free
    buffers (the oldest go first). Thread-safe: taken in the caller's thread, given back on
    the I/O thread."""

    def __init__(self, keep: int = 4) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
        """A flat CPU tensor of ``numel`` elements of ``dtype`` (its contents undefined);
        ``pinned``: page-locked, for copies from and to a CUDA device."""
        with self._lock:
            for i, t in enumerate(self._free):
                if t.numel() == numel and t.dtype is dtype and t.is_pinned() == pinned:
                    return self._free.pop(i)
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def give(self, t: torch.Tensor) -> None:
        with self._lock:
            self._free.append(t)
            del self._free[:max(0, len(self._free) - self.keep)]


class StagedTensor:
    """How one tensor travels through the switch: the numpy array sent, and the write-back.

    ``array`` is a flat view of the tensor itself where it can be (a contiguous CPU tensor of a
    type the switch sums: float16 and bfloat16 too, which the kernels read and write
    themselves), else of a contiguous CPU copy (``staging``, from ``pool`` if given, back to it
    after ``finish``): with ``dtype``, the tensor travels as ``dtype``; int64 travels as three
    int32 limbs. Used by the backend for every all-reduce and by the DDP
    hooks (``dtype=torch.float32``) for every bucket.

    Args:
        tensor: the tensor to reduce in place.
        dtype: send as this type (a copy unless the tensor already is); None: as the backend does.
        pool: where a staging copy's buffer comes from and goes back to; None: allocated.
        copy: always send a staging copy (the tensor keeps its input until ``finish``).
    """

    __slots__ = ("tensor", "array", "flat", "staging", "kind", "pool")

    def __init__(self, tensor: torch.Tensor, *, dtype: torch.dtype | None = None,
                 pool: StagingPool | None = None, copy: bool = False) -> None:
        self.tensor = tensor
        self.pool = pool
        t = tensor.detach()
        self.staging: torch.Tensor | None = None
        if t.dtype is torch.int64 and dtype is None:
            self.kind = "limbs"
            self.array = _to_limbs(t.reshape(-1).cpu().numpy())
            self.flat = torch.from_numpy(self.array)
            return
        self.kind = "plain"
        want = dtype or t.dtype
        if copy or t.dtype is not want or t.device.type != "cpu" or not t.is_contiguous():
            if pool is not None:
                self.staging = pool.take(t.numel(), want, pinned=t.device.type == "cuda")
                self.staging.view(t.shape).copy_(t)  # (no contiguous temporary of ``t``)
            else:
                self.staging = t.to(device="cpu", dtype=want).contiguous()
        src = self.staging if self.staging is not None else t
        self.flat = src.reshape(-1)  # what ``array`` views, as a tensor
        self.array = _as_numpy(self.flat)

    def finish(self, size: int, average: bool, counts: np.ndarray | None = None,
               block: int = 0, *, keep: bool = False) -> torch.Tensor | None:
        """Write the sum back into the user's tensor, in place (runs on the I/O thread);
        with ``average``, divide it by ``size``, or in a quorum group by ``counts``: how many
        ranks each block of ``block`` elements holds (a k-of-n round always holds k: then
        one scalar division, as without a quorum). ``keep``: return the tensor's new values,
        flat on the CPU, in a buffer the caller then owns (the staging buffer where it holds
        them, else a copy); None otherwise."""
        t = self.tensor.detach()
        pool = self.pool  # (a kept copy's buffer comes from it: no fresh pages each time)
        divisor: Any = size
        if counts is not None and counts.size:
            if (counts == counts[0]).all():
                divisor, counts = int(counts[0]), None
            else:  # per element (rare: a round that completed with another count)
                divisor = torch.from_numpy(np.repeat(counts, block)[:t.numel()])
        else:
            counts = None
        if self.kind == "limbs":
            t.copy_(torch.from_numpy(_from_limbs(self.array)).reshape(t.shape))
        elif self.staging is not None:
            if average and self.staging.is_floating_point():
                # in the wider type: the result is rounded once more, not twice (sum, then
                # quotient) in a half type
                self.staging.reshape(-1).div_(divisor)
                average = False
            t.copy_(self.staging.reshape(t.shape))
            if keep and not average:  # the staging buffer holds the new values
                kept, self.staging, self.pool = self.staging.reshape(-1), None, None
                return kept
            self.release()
        if average:
            if counts is not None:
                divisor = divisor.reshape(t.shape)
            if t.is_floating_point():
                t.div_(divisor)
            else:
                t.copy_(torch.div(t, divisor, rounding_mode="trunc"))
        if not keep:
            return None
        flat = t.reshape(-1)
        kept = (pool.take(flat.numel(), flat.dtype) if pool is not None
                else torch.empty(flat.numel(), dtype=flat.dtype))
        kept.copy_(flat)
        return kept

    def release(self) -> None:
        """Give the staging buffer back to the pool (after ``finish``, or when the operation
        failed); idempotent."""
        if self.pool is not None and self.staging is not None:
            self.pool.give(self.staging)
            self.pool = None


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of its type (bfloat16: ml_dtypes', through its
    bits, since torch's ``numpy()`` refuses it)."""
    if t.dtype is torch.bfloat16:
        from switchml.protocol.dtypes import BFLOAT16  # (imports ml_dtypes: not before it is used)
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def wire_bits(dtype: torch.dtype, world: int, half_bits: int | None = None) -> int:
    """Bits per element on the wire for an all-reduce of ``dtype`` over ``world`` ranks.
    float16 and bfloat16: ``half_bits`` if given, else 16 where the 16-bit sum's error bound
    (``quantize.error_bound``) is at most half an ulp of the type at a block's scale
    ``2**emax`` (``eps / 2`` of it; the block's largest element lies in ``[2**(emax-1),
    2**emax)``): float16 up to 4 ranks, bfloat16 up to 15; 32 beyond. The bound is absolute:
    elements far below their block's largest keep fewer bits than the type has (those under
    about ``2**-(16 - bit_length(n))`` of it become 0), as in every fixed-point block, and a
    plain all-reduce has no error feedback (the 16-bit DDP hook does). Everything else: 32."""
    if dtype not in HALF:
        return 32
    if half_bits is not None:
        return half_bits
    return 16 if error_bound(0, world, bits=16) <= torch.finfo(dtype).eps / 2 else 32


def _to_limbs(x: np.ndarray) -> np.ndarray:
    """Split int64 into three int32 limbs (low 22 bits, next 22, signed top 20)."""
    out = np.empty((3, x.size), dtype=np.int32)
    out[0] = x & (2**22 - 1)
    out[1] = (x >> 22) & (2**22 - 1)
    out[2] = x >> 44  # arithmetic shift: signed, |.| < 2**19
    return out.reshape(-1)


def _from_limbs(limbs: np.ndarray) -> np.ndarray:
    parts = limbs.reshape(3, -1).astype(np.int64)
    with np.errstate(over="ignore"):
        return parts[0] + (parts[1] << 22) + (parts[2] << 44)  # wraps modulo 2**64 like int64
