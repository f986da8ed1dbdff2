"""The per-slot rank bitmaps of a job's state (``seen``, ``conflict``: ``[set, slot, word]`` of
uint64, bit ``r`` of word ``r // 64`` for rank ``r``), as the switch's reference kernels read
and write them (``csrc/switch.c`` has the same three)."""

from __future__ import annotations

import numpy as np

__all__ = ["any_bit", "clear_bit", "has_bit"]


def clear_bit(bm, v, s, rank):
    bm[v, s, rank >> 6] &= ~(np.uint64(1) << np.uint64(rank & 63))


def has_bit(bm, v, s, rank):
    return (bm[v, s, rank >> 6] >> np.uint64(rank & 63)) & np.uint64(1) != 0


def any_bit(bm, v, s):
    for w in range(bm.shape[2]):
        if bm[v, s, w] != 0:
            return True
    return False
