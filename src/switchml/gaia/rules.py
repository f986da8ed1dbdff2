"""Gaia's rules (Hsieh et al., NSDI'17, "Gaia: Geo-Distributed Machine Learning Approaching LAN
Speeds"), as pure objects: no sockets, threads or clocks, each driven by its own unit test.

Approximate Synchronous Parallel (ASP) has three parts:

1. **Significance filter.** Each data centre accumulates, per parameter, the update its own
   training made since the entry was last shared. An entry is *significant* when
   ``|accumulated / value| > S_t`` with ``S_t = S / sqrt(t)`` (``t``: the clock, from 1; the
   decay keeps the error bounded as learning slows: paper section 3.2). Significant entries are
   sent (index, value) and their accumulator reset; the rest keeps accumulating, so no update
   is ever lost, only delayed until it matters.
2. **Selective barrier.** Before its significant updates for clock ``c``, a data centre
   announces which parameters they touch; on the receiving side a reader of those parameters
   waits until the update is applied (with a bound), and the other parameters are read at
   once. The announce travels ahead of the bulky data (the mirror sends control messages
   before the next piece of an update), so the barrier is known long before the entries come.
3. **Mirror clock.** Each data centre tells the others when it finishes a clock; none may run
   more than ``staleness`` clocks ahead of the slowest, which bounds how stale the updates
   from elsewhere can be (ASP's stale-synchronous guarantee): a data centre that finished
   ``c`` clocks starts clock ``c + 1`` only when every data centre finished ``c - staleness``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from switchml.protocol.errors import ConfigError

__all__ = ["MirrorClock", "SelectiveBarrier", "SignificanceFilter", "decode_announce",
           "decode_sparse", "encode_announce", "encode_sparse", "parse_dc_layout",
           "layout_offsets", "significance_threshold", "tensor_of"]


def significance_threshold(clock: int, *, threshold: float = 0.01, decay: bool = True) -> float:
    """``S_t``: ``threshold / sqrt(clock)`` (``threshold`` when ``decay`` is off).

    Raises:
        ConfigError: a clock below 1 or a threshold not in [0, 1].
    """
    if clock < 1:
        raise ConfigError(f"clocks count from 1, got {clock}")
    if not 0.0 <= threshold <= 1.0:
        raise ConfigError(f"the significance threshold is a fraction in [0, 1], got {threshold}"
                          " (0: every non-zero update is significant)")
    return threshold / math.sqrt(clock) if decay else threshold


class SignificanceFilter:
    """Accumulate one data centre's own updates; release the significant entries.

    Example::

        f = SignificanceFilter(params.size)
        f.add(params_after - params_before)
        idx, vals = f.select(params_after, clock=t)   # send these; the rest stays
    """

    def __init__(self, size: int, *, threshold: float = 0.01, decay: bool = True) -> None:
        significance_threshold(1, threshold=threshold)  # validates
        self.threshold = threshold
        self.decay = decay
        self.accumulated = np.zeros(size, np.float32)
        self.entries_sent = 0
        self.selections = 0

    def add(self, update: np.ndarray) -> None:
        """Add this data centre's update (new - old parameters) to the accumulators."""
        self.accumulated += update

    def select(self, params: np.ndarray, *, clock: int) -> tuple[np.ndarray, np.ndarray]:
        """Take the significant entries: ``|accumulated| > S_t * |params|`` (a parameter at 0
        makes any non-zero update significant). Returns int32 indices and float32 values
        (the accumulated updates, to be added on the receiving side) and resets those
        accumulators to 0."""
        s_t = significance_threshold(clock, threshold=self.threshold, decay=self.decay)
        mask = np.abs(self.accumulated) > s_t * np.abs(params)
        idx = np.flatnonzero(mask).astype(np.int32)
        vals = self.accumulated[idx].copy()
        self.accumulated[idx] = 0.0
        self.entries_sent += idx.size
        self.selections += 1
        return idx, vals


    def flush(self) -> tuple[np.ndarray, np.ndarray]:
        """Take every non-zero accumulated update, significant or not (end of training)."""
        idx = np.flatnonzero(self.accumulated).astype(np.int32)
        vals = self.accumulated[idx].copy()
        self.accumulated[:] = 0.0
        self.entries_sent += idx.size
        return idx, vals


class SelectiveBarrier:
    """Which parameters announced updates will change, until those updates are applied.

    A data centre announces, per clock, the *tensors* (parameters, by index in the model's
    parameter list) its significant update of that clock touches and how many entries it
    holds, before the entries themselves (:func:`encode_announce`). A reader of a tensor waits
    while an update announced for it is not applied (:meth:`blocked`); readers of other tensors
    proceed. Entries are applied in pieces (:meth:`applied`); an update is done when all its
    announced entries are.

    Example::

        b = SelectiveBarrier()
        b.announce(1, 7, tensors={0, 3}, entries=120)
        b.blocked({3, 4}, up_to=7)      # {3}
        b.applied(1, 7, 120)
        b.blocked({3, 4}, up_to=7)      # set()
    """

    def __init__(self) -> None:
        self._pending: dict[tuple[int, int], tuple[frozenset[int], int]] = {}

    def announce(self, dc: int, clock: int, tensors: Iterable[int] = (), entries: int = 0
                 ) -> None:
        """Data centre ``dc`` said an update of ``entries`` entries for ``clock``, touching
        ``tensors``, is on its way."""
        self._pending[dc, clock] = (frozenset(tensors), entries)

    def applied(self, dc: int, clock: int, entries: int | None = None) -> None:
        """``entries`` more entries of that update are now in the local model (None: all of
        them). An update never announced is an error (the sender must announce first)."""
        try:
            tensors, left = self._pending[dc, clock]
        except KeyError:
            raise ValueError(f"update of data centre {dc} clock {clock} was not announced"
                             ) from None
        left = 0 if entries is None else left - entries
        if left <= 0:
            del self._pending[dc, clock]
        else:
            self._pending[dc, clock] = (tensors, left)

    @property
    def pending(self) -> list[tuple[int, int]]:
        """The (data centre, clock) of every update announced and not wholly applied."""
        return sorted(self._pending)

    def blocked(self, tensors: Iterable[int] | None = None, *, up_to: int | None = None
                ) -> set[int]:
        """The tensors among ``tensors`` (None: all) that an update of a clock up to
        ``up_to`` (None: any) will still change: their readers wait."""
        want = None if tensors is None else set(tensors)
        out: set[int] = set()
        for (_dc, clock), (touched, _left) in self._pending.items():
            if up_to is None or clock <= up_to:
                out |= touched if want is None else touched & want
        return out

    def may_proceed(self, up_to: int | None = None) -> bool:
        """Whether every announced update (of clocks up to ``up_to``, when given: later ones
        are not due yet) is applied."""
        if up_to is None:
            return not self._pending
        return not any(clock <= up_to for _dc, clock in self._pending)


class MirrorClock:
    """The clocks of every data centre, as this one knows them."""

    def __init__(self, dcs: int, me: int, *, staleness: int = 2) -> None:
        if dcs < 1 or not 0 <= me < dcs:
            raise ConfigError(f"data centre {me} out of range 0..{dcs - 1}")
        if staleness < 0:
            raise ConfigError(f"staleness must be >= 0 clocks, got {staleness}")
        self.me = me
        self.staleness = staleness
        self.clocks = [0] * dcs
        """Clocks finished, per data centre."""

    def observe(self, dc: int, clock: int) -> None:
        """Data centre ``dc`` finished ``clock`` (clocks only move forward)."""
        self.clocks[dc] = max(self.clocks[dc], clock)

    def finish(self) -> int:
        """This data centre finished its current clock; returns the new clock (announce it
        to the others)."""
        self.clocks[self.me] += 1
        return self.clocks[self.me]

    def may_start(self) -> bool:
        """Whether this data centre may start its next clock: having finished ``c`` clocks,
        it may start clock ``c + 1`` once every data centre finished ``c - staleness``
        (``staleness`` 0: lockstep, like BSP across data centres)."""
        return self.clocks[self.me] - min(self.clocks) <= self.staleness

    def waiting_for(self) -> list[int]:
        """The data centres this one waits for (too far behind)."""
        limit = self.clocks[self.me] - self.staleness
        return [j for j, c in enumerate(self.clocks) if c < limit]


def layout_offsets(sizes: Sequence[int]) -> np.ndarray:
    """Where each tensor of ``sizes`` elements starts in the flat vector of all of them, and
    its end: ``[0, n0, n0 + n1, ..., total]`` (int64)."""
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def tensor_of(offsets: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The tensor of each flat parameter index (``offsets``: where each tensor starts in the
    flat vector, and its end: ``[0, n0, n0 + n1, ..., total]``)."""
    return np.searchsorted(offsets, idx, side="right") - 1


def encode_announce(entries: int, tensors: np.ndarray, count: int) -> bytes:
    """A selective barrier's payload: the update's entry count (uint64, little-endian), then a
    bitmap of the ``count`` tensors, bit ``t`` set when tensor ``t`` is touched."""
    bits = np.zeros(count, np.uint8)
    bits[tensors] = 1
    return np.uint64(entries).tobytes() + np.packbits(bits, bitorder="little").tobytes()


def decode_announce(data: bytes | memoryview, count: int) -> tuple[int, np.ndarray]:
    """``(entries, tensors)`` of a selective barrier for a model of ``count`` tensors.

    Raises:
        ValueError: the wrong length, no tensor, or a bit past the last tensor.
    """
    want = 8 + (count + 7) // 8
    if len(data) != want:
        raise ValueError(f"an announce for {count} tensors has {want} bytes, got {len(data)}")
    entries = int(np.frombuffer(data, np.uint64, count=1)[0])
    bits = np.unpackbits(np.frombuffer(data, np.uint8, offset=8), bitorder="little")
    if bits[count:].any():
        raise ValueError(f"an announce names a tensor past the model's {count}")
    tensors = np.flatnonzero(bits[:count])
    if tensors.size == 0 or entries == 0:
        raise ValueError("an announce of no entries or no tensors")
    return entries, tensors


def encode_sparse(idx: np.ndarray, vals: np.ndarray) -> bytes:
    """int32 indices then float32 values (8 bytes an entry)."""
    return np.ascontiguousarray(idx, np.int32).tobytes() + np.ascontiguousarray(
        vals, np.float32).tobytes()


def decode_sparse(data: bytes | memoryview) -> tuple[np.ndarray, np.ndarray]:
    if len(data) % 8:
        raise ValueError(f"a sparse update has 8 bytes an entry, got {len(data)} bytes")
    n = len(data) // 8
    idx = np.frombuffer(data, np.int32, count=n)
    vals = np.frombuffer(data, np.float32, count=n, offset=4 * n)
    return idx, vals


def parse_dc_layout(spec: str | None, *, workers: int | None = None) -> list[list[int]]:
    """Data centres from ``"2x2"`` (two of two workers), ``"3,1"`` (sizes) or
    ``"0,0,1,1"`` (each worker's data centre), as ``--dcs`` gives them. Returns the workers
    (global ranks) of each data centre.

    Raises:
        ConfigError: unparsable, empty data centre, or a worker count that does not match.
    """
    text = (spec or "").strip()
    if not text:
        raise ConfigError("no data centres given: pass e.g. '2x2'")
    try:
        if "x" in text:
            count, size = (int(v) for v in text.split("x"))
            sizes: Sequence[int] = [size] * count
            layout = _from_sizes(sizes)
        elif workers is not None and text.count(",") == workers - 1 and workers > 1:
            of = [int(v) for v in text.split(",")]
            layout = [[r for r, d in enumerate(of) if d == j] for j in range(max(of) + 1)]
        else:
            layout = _from_sizes([int(v) for v in text.split(",")])
    except ValueError:
        raise ConfigError(f"bad data-centre layout {text!r}: expected '2x2', '3,1' or one data "
                          "centre per worker '0,0,1,1'") from None
    if not layout or any(not dc for dc in layout):
        raise ConfigError(f"data-centre layout {text!r} has an empty data centre")
    if workers is not None and sum(len(dc) for dc in layout) != workers:
        raise ConfigError(f"data-centre layout {text!r} has "
                          f"{sum(len(dc) for dc in layout)} workers, expected {workers}")
    return layout


def _from_sizes(sizes: Sequence[int]) -> list[list[int]]:
    if any(s < 1 for s in sizes):
        raise ValueError("sizes must be >= 1")
    out, first = [], 0
    for s in sizes:
        out.append(list(range(first, first + s)))
        first += s
    return out
