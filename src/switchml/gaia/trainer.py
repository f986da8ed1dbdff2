"""Gaia for a PyTorch model: synchronous inside a data centre, significant updates across.

Each data centre runs ordinary synchronous data-parallel training on its own process group (DDP
over gloo or switchml): after every step its replicas are identical. (Not the parameter
servers: their pulls would overwrite the updates applied here; see docs/geo.md.)
:meth:`GaiaSync.after_step` (call it after ``optimizer.step()``) then does, per clock ``t``:

1. leader only: add this step's own update (parameters now minus parameters after the previous
   call) to the significance filter, take the entries above ``S_t`` and publish them, with the
   clock, to the other data centres (:class:`Mirror`, in the background);
2. leader only: wait for the selective barrier and the mirror clock, applying every update
   received from the other data centres;
3. broadcast what was applied to the other replicas of the data centre (over its process
   group), which apply it too, so the replicas stay identical.

Updates from elsewhere are applied to the parameters directly (the paper's model), not counted
as local updates, and never sent back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from switchml.gaia.mirror import Mirror
from switchml.gaia.rules import SignificanceFilter

__all__ = ["GaiaSync"]


class GaiaSync:
    """Gaia's cross-data-centre step for one replica (``mirror`` on the leader only)."""

    def __init__(self, model: Any, *, mirror: Mirror | None, group: Any = None,
                 threshold: float = 0.01, decay: bool = True) -> None:
        import torch
        self._torch = torch
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mirror = mirror
        self.group = group
        """The data centre's process group (None: the default group, or a one-worker data
        centre when torch.distributed is not initialised)."""
        self.clock = 0
        self._prev = self._flat()
        self.filter = (SignificanceFilter(self._prev.size, threshold=threshold, decay=decay)
                       if mirror is not None else None)
        if mirror is not None:
            mirror.expect_entries(self._prev.size)
        self.entries_published = 0
        self.entries_applied = 0

    def _flat(self) -> np.ndarray:
        from torch.nn.utils import parameters_to_vector
        with self._torch.no_grad():
            return parameters_to_vector(self.params).numpy().copy()

    def _write(self, flat: np.ndarray) -> None:
        # In place: torch's vector_to_parameters would make the parameters views of ``flat``
        # (which then becomes the filter's reference, and the optimizer would move both).
        src = self._torch.from_numpy(flat)
        offset = 0
        with self._torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.view(-1).copy_(src[offset:offset + n])
                offset += n

    def _dc_size(self) -> int:
        import torch.distributed as dist
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def after_step(self) -> None:
        """Share this step's significant updates and take the other data centres'.

        Raises:
            GaiaError: another data centre died or timed out (named).
        """
        self._clock_tick(final=False)

    def finish(self) -> None:
        """End of training: share every accumulated update, significant or not, wait for
        every data centre's last clock and apply theirs, so that all replicas end with every
        update made anywhere. Call once, after the last :meth:`after_step`."""
        self._clock_tick(final=True)

    def _clock_tick(self, *, final: bool) -> None:
        import torch.distributed as dist
        self.clock += 1
        cur = self._flat()
        got_idx: list[np.ndarray] = []
        got_vals: list[np.ndarray] = []
        if self.mirror is not None and self.filter is not None:
            self.filter.add(cur - self._prev)
            idx, vals = (self.filter.flush() if final
                         else self.filter.select(cur, clock=self.clock))
            self.entries_published += idx.size
            self.mirror.clock.finish()
            self.mirror.publish(self.clock, idx, vals)

            def apply(i: np.ndarray, v: np.ndarray) -> None:
                np.add.at(cur, i, v)
                got_idx.append(i)
                got_vals.append(v)

            self.mirror.exchange(apply, everyone=final)
        merged_idx = np.concatenate(got_idx) if got_idx else np.zeros(0, np.int32)
        merged_vals = np.concatenate(got_vals) if got_vals else np.zeros(0, np.float32)
        if self._dc_size() > 1:
            torch = self._torch
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            count = torch.tensor([merged_idx.size], dtype=torch.int64)
            dist.broadcast(count, src, group=self.group)
            n = int(count.item())
            if n:
                ti = torch.from_numpy(merged_idx) if self.mirror is not None else torch.empty(
                    n, dtype=torch.int32)
                tv = torch.from_numpy(merged_vals) if self.mirror is not None else torch.empty(
                    n, dtype=torch.float32)
                dist.broadcast(ti, src, group=self.group)
                dist.broadcast(tv, src, group=self.group)
                if self.mirror is None:
                    np.add.at(cur, ti.numpy(), tv.numpy())
                merged_idx = ti.numpy()
        self.entries_applied += merged_idx.size
        if merged_idx.size:
            self._write(cur)
        self._prev = cur
