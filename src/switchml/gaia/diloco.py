"""DiLoCo across data centres: local steps, then an outer step on the averaged
pseudo-gradients (Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models", 2023), with the outer all-reduce through a switchml switch.

Each data centre trains on its own for ``inner_steps`` steps (its workers synchronous with one
another, e.g. DDP inside the data centre, with any inner optimiser). Then the data centres'
leaders all-reduce the *pseudo-gradient*, how far the data centre moved from the last
global weights (``anchor - params``); the mean is the gradient of an outer optimiser
(``torch.optim.SGD``, with Nesterov momentum where ``outer_momentum > 0``) on the anchor; the
new anchor becomes every worker's parameters (broadcast inside the data centre). One
all-reduce of the model every ``inner_steps`` steps, 16-bit on the wire by default, where
synchronous training all-reduces 32-bit gradients every step.

The defaults, ``outer_lr=1`` and no momentum, make the outer step the mean of the data
centres' models (local SGD, model averaging). The paper's Nesterov step (lr 0.7, momentum 0.9)
is a choice away, but measured on the geo testbed (docs/geo.md, section 3; torchft's DiLoCo
alike) it diverged on the factorisation and ended 45% above synchronous training's loss on the
CNN, where the mean ended 5% below it.

Guarantees: the data centres hold bit-identical parameters after every outer step (they
apply the same mean to the same anchor); with ``outer_lr=1`` and no momentum an outer step is
the mean of the data centres' models, and with ``inner_steps=1`` and plain SGD inside as well,
synchronous SGD on the mean gradient. The outer all-reduce is a call you give (``outer``: sum a
float32 vector over the data centres); :func:`switch_outer` makes one that goes through a
switch. On the same data, model and outer step, the held-out loss matches torchft's
``DiLoCo`` at every evaluation (tests/bench/test_geo.py).

Embedding tables (``embedding_rows=True``; off by default): a row of an ``nn.Embedding`` that
only some data centres moved is averaged over those data centres, not over all of them. A row
counts as moved where its pseudo-gradient is not zero (an inner optimiser with weight decay
moves every row, and the mean is then the plain one). The counts travel in the same
all-reduce, packed (:class:`RowCounts`). Measured on the factorisation it ends *above* the
plain mean: with a loss averaged over the batch, as DDP's is, synchronous SGD divides a row's
gradient by every sample, those that never touched the row included, and the plain mean keeps
that scale where the row mean doubles a rare row's step. It is for losses normalised per row.

Why not torchft's ``DiLoCo`` itself: it runs under a torchft ``Manager`` (a lighthouse and
quorums, for fault tolerance) and treats each replica group as one data-parallel rank, so every
worker of a data centre sends the pseudo-gradient across (torchft issue 171); here a data
centre runs DDP over several workers and only its leader talks across, through the switch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["DiLoCo", "RowCounts", "switch_outer"]


class DiLoCo:
    """DiLoCo's outer loop around a training loop.

    Example (one process per data centre, or its leader with ``group``)::

        outer = switch_outer(("10.0.0.1", 48864), dcs=2, dc=my_dc, job_id=7, token=t)
        diloco = DiLoCo(model, outer=outer, dcs=2, inner_steps=50)
        for batch in data:
            loss(model(batch)).backward(); opt.step(); opt.zero_grad()
            diloco.after_step()          # every 50th step: the outer step

    ``group``: the data centre's process group (its rank 0 is the leader, which alone calls
    ``outer``; the others get the new parameters by broadcast); None: one process per data
    centre.
    """

    def __init__(self, model: Any, *, outer: Callable[[np.ndarray], np.ndarray] | None,
                 dcs: int, inner_steps: int = 50, outer_lr: float = 1.0,
                 outer_momentum: float = 0.0, group: Any = None,
                 embedding_rows: bool = False) -> None:
        import torch
        import torch.distributed as dist
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        if dcs < 1:
            raise ValueError(f"dcs must be >= 1, got {dcs}")
        if not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_lr must be > 0 and outer_momentum in [0, 1), got "
                             f"{outer_lr} and {outer_momentum}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.tables = self._tables(model) if embedding_rows else []
        """(offset in the flat vector, rows, row length) of each embedding table averaged by
        row."""
        self.counts = RowCounts(dcs) if self.tables else None
        self.group = group
        self.leader = group is None or dist.get_rank(group) == 0
        if self.leader and outer is None:
            raise ValueError("a data centre's leader needs the outer all-reduce (outer=...)")
        self.outer, self.dcs, self.inner_steps = outer, dcs, inner_steps
        self.anchor = [p.detach().clone() for p in self.params]
        for a in self.anchor:
            a.requires_grad_(True)
        self.outer_opt = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum,
                                         nesterov=outer_momentum > 0)
        self.steps = 0
        self.outer_steps = 0
        self.bytes_reduced = 0
        """Bytes of float32 pseudo-gradient (and row counts) handed to the outer all-reduce
        (before the wire's quantisation)."""

    def _tables(self, model: Any) -> list[tuple[int, int, int]]:
        from torch import nn
        at, where = 0, {}
        for p in self.params:
            where[id(p)] = at
            at += p.numel()
        return [(where[id(m.weight)], m.weight.shape[0], m.weight[0].numel())
                for m in model.modules() if isinstance(m, nn.Embedding)
                and id(m.weight) in where]

    def after_step(self) -> bool:
        """Call after every inner optimiser step; runs the outer step every ``inner_steps``
        steps (returns whether it did)."""
        self.steps += 1
        if self.steps % self.inner_steps:
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """The outer step now: all-reduce the pseudo-gradient, step the anchor, load it."""
        import torch
        from torch.nn.utils import parameters_to_vector
        with torch.no_grad():
            if self.leader:
                delta = (parameters_to_vector(self.anchor)
                         - parameters_to_vector(self.params)).to(torch.float32)
                moved = [(delta[at:at + rows * size].view(rows, size) != 0).any(1)
                         for at, rows, size in self.tables]
                parts = [delta]
                if moved:  # the counts in blocks of their own (a packed count in a block
                    # would set its exponent, and cost the pseudo-gradient there precision)
                    parts += [torch.zeros(-delta.numel() % self._block()),
                              torch.from_numpy(self._counts().pack(torch.cat(moved).numpy()))]
                flat = np.ascontiguousarray(torch.cat(parts).numpy())
                self.bytes_reduced += flat.nbytes
                assert self.outer is not None
                mean = torch.from_numpy(self._mean(np.asarray(self.outer(flat), np.float32),
                                                   delta.numel()))
                for a, g in zip(self.anchor, self._split(mean)):
                    a.grad = g.to(a.dtype).clone()
                self.outer_opt.step()
                new = parameters_to_vector(self.anchor)
            else:
                new = torch.empty(sum(p.numel() for p in self.params))
            if self.group is not None:
                import torch.distributed as dist
                dist.broadcast(new, src=dist.get_global_rank(self.group, 0), group=self.group)
            for p, v in zip(self.params, self._split(new)):
                p.copy_(v)
        self.outer_steps += 1

    def _counts(self) -> RowCounts:
        assert self.counts is not None
        return self.counts

    def _block(self) -> int:
        """The elements under one block exponent of the outer all-reduce (1: unknown)."""
        return getattr(self.outer, "block", 1)

    def _mean(self, total: np.ndarray, n: int) -> np.ndarray:
        """The mean pseudo-gradient from the all-reduced sum of ``n`` entries (and the packed
        row counts after them): every entry over ``dcs``, an embedding row over the data
        centres that moved it, or over ``dcs`` where none did."""
        mean = total[:n] / self.dcs
        if not self.tables:
            return mean
        counts = self._counts().unpack(total[n + -n % self._block():],
                                    sum(rows for _, rows, _ in self.tables))
        at_count = 0
        for at, rows, size in self.tables:
            c = counts[at_count:at_count + rows]
            at_count += rows
            by = np.where(c >= 1, c, self.dcs).astype(np.float32)
            mean[at:at + rows * size] = (total[at:at + rows * size].reshape(rows, size)
                                         / by[:, None]).reshape(-1)
        return mean

    def _split(self, flat: Any) -> list[Any]:
        """``flat`` cut into views shaped as the parameters."""
        out, at = [], 0
        for p in self.params:
            out.append(flat[at:at + p.numel()].view_as(p))
            at += p.numel()
        return out


class RowCounts:
    """How many data centres moved each row, summed by the outer all-reduce, packed ``per``
    to an element: an element is ``sum_i moved_i (dcs + 1)**i``, so the sum over data centres
    holds each row's count as a digit in base ``dcs + 1`` (no digit can carry). Packed values
    stay below ``2**P``, the scale of a 16-bit wire at ``dcs`` ranks
    (``quantize.scale_bits``): in a block of their own they are whole numbers
    there, and in every exact sum, so the counts come back exact. 2 data centres: 8 rows an
    element; 4: 5; 8: 3; up to 127: 1."""

    def __init__(self, dcs: int) -> None:
        from switchml.protocol.quantize import scale_bits
        self.base = dcs + 1
        bits = scale_bits(dcs, 16)
        self.per = 0
        while self.base ** (self.per + 1) <= 2 ** bits:
            self.per += 1
        if self.per < 1:
            raise ValueError(f"row counts of {dcs} data centres do not fit a 16-bit wire's "
                             "whole numbers (at most 127); pass embedding_rows=False")
        self.weights = self.base ** np.arange(self.per, dtype=np.int64)

    def pack(self, moved: np.ndarray) -> np.ndarray:
        """Booleans (one per row) as float32 elements of ``per`` digits."""
        flags = np.zeros(-(-moved.size // self.per) * self.per, np.int64)
        flags[:moved.size] = moved
        return (flags.reshape(-1, self.per) @ self.weights).astype(np.float32)

    def unpack(self, total: np.ndarray, rows: int) -> np.ndarray:
        """The first ``rows`` counts from summed packed elements (``rint`` undoes a float
        sum's last bit)."""
        v = np.rint(total[:-(-rows // self.per)]).astype(np.int64)
        return ((v[:, None] // self.weights) % self.base).reshape(-1)[:rows]


def switch_outer(switch: Any, *, dcs: int, dc: int, job_id: int, token: int, bits: int = 16,
                 elements_per_packet: int | None = None, window: int | None = None,
                 config: Any = None) -> Callable[[np.ndarray], np.ndarray]:
    """An outer all-reduce for :class:`DiLoCo` through the switch at ``switch``: data centre
    ``dc`` of ``dcs`` is rank ``dc`` of job ``job_id`` (``token`` shared by the leaders),
    ``bits`` on the wire (16: the pseudo-gradient in 16-bit fixed point with a block
    exponent, with error feedback: what one outer step's rounding lost goes into the next).
    The returned callable has a ``close()``."""
    import dataclasses

    from switchml.control import new_job_spec
    from switchml.protocol.operation import WIRE_BITS
    from switchml.transport.udp import WorkerClient
    spec = dataclasses.replace(new_job_spec(dcs, switch=switch, window=window,
                                            elements_per_packet=elements_per_packet),
                               job_id=job_id, token=token)
    client = WorkerClient(switch, spec, dc, config)
    residual: dict[int, np.ndarray] = {}

    def outer(x: np.ndarray) -> np.ndarray:
        if bits != 16:
            return client.allreduce(x, bits=bits)
        res = residual.setdefault(x.size, np.zeros(x.size, np.float32))
        return client.allreduce(x + res, bits=16, residual=res)  # (res: this step's error)

    # The elements under one block exponent: a slot's, as the operation cuts them
    # (``Operation.k``: twice a packet's int32 count at 16 bits)
    outer.block = (spec.elements_per_packet * 4  # type: ignore[attr-defined]
                   // WIRE_BITS[bits][1])
    outer.close = client.close  # type: ignore[attr-defined]
    outer.client = client  # type: ignore[attr-defined]
    return outer
