"""Gaia for a PyTorch model: synchronous inside a data centre, significant updates across.

Each data centre runs ordinary synchronous data-parallel training on its own process group (DDP
over gloo or switchml): after every step its replicas are identical. (Not the parameter
servers: their pulls would overwrite the updates applied here; see docs/geo.md.)
:meth:`GaiaSync.after_step` (call it after ``optimizer.step()``) then does, per clock ``t``:

1. leader only: add this step's own update (parameters now minus parameters after the previous
   call) to the significance filter, take the entries above ``S_t`` and publish them, with the
   clock, to the other data centres (:class:`Mirror`, in the background: the selective barrier
   naming the tensors first, then the clock, then the entries);
2. leader only: wait for the mirror clock, applying every update received so far; the tensors
   that announced updates will still change are *blocked*;
3. broadcast what was applied, and the blocked tensors, to the other replicas of the data
   centre (over its process group), which apply it too, so the replicas stay identical.

The selective barrier's readers are the modules: before a module whose parameters are blocked
runs its forward pass, the leader waits for their updates (at most ``barrier_timeout_s``, then
it reads them stale and the update is applied when it comes) and broadcasts what it applied;
modules whose parameters nothing will change run at once. Every replica knows the blocked set,
so all take part in the same broadcasts in the same order.

Updates from elsewhere are applied to the parameters directly (the paper's model), not counted
as local updates, and never sent back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from switchml.gaia.mirror import Mirror
from switchml.gaia.rules import SignificanceFilter, layout_offsets, tensor_of

__all__ = ["GaiaSync"]


class GaiaSync:
    """Gaia's cross-data-centre step for one replica (``mirror`` on the leader only)."""

    def __init__(self, model: Any, *, mirror: Mirror | None, group: Any = None,
                 threshold: float = 0.01, decay: bool = True,
                 barrier_timeout_s: float = 10.0) -> None:
        import torch
        self._torch = torch
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mirror = mirror
        self.group = group
        """The data centre's process group (None: the default group, or a one-worker data
        centre when torch.distributed is not initialised)."""
        self.barrier_timeout_s = barrier_timeout_s
        """The longest a module's forward waits for an announced update of its parameters."""
        self.clock = 0
        self._prev = self._flat()
        sizes = [p.numel() for p in self.params]
        self._offsets = layout_offsets(sizes)
        self.filter = (SignificanceFilter(self._prev.size, threshold=threshold, decay=decay)
                       if mirror is not None else None)
        if mirror is not None:
            mirror.expect_layout(sizes)
        self.entries_published = 0
        self.entries_applied = 0
        self.reads_blocked = 0
        """Module forwards that waited for an announced update (on every replica)."""
        self._blocked: set[int] = set()
        self._got: list[tuple[np.ndarray, np.ndarray]] = []  # applied, not yet broadcast
        self._read: set[int] = set()  # tensors this step's forward passes read
        self._deferred: list[tuple[np.ndarray, np.ndarray]] = []  # for tensors read already
        index = {id(p): t for t, p in enumerate(self.params)}
        self._hooks = []
        for module in model.modules():
            mine = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if mine:
                self._hooks.append(module.register_forward_pre_hook(self._reader(mine)))

    def _flat(self) -> np.ndarray:
        from torch.nn.utils import parameters_to_vector
        with self._torch.no_grad():
            return parameters_to_vector(self.params).numpy().copy()

    def _add(self, idx: np.ndarray, vals: np.ndarray) -> None:
        """Add another data centre's entries to the parameters (in place) and to the
        reference the next own update is measured from (so they are not sent back)."""
        if not idx.size:
            return
        np.add.at(self._prev, idx, vals)
        owner = tensor_of(self._offsets, idx)
        torch = self._torch
        with torch.no_grad():
            for t in np.unique(owner):
                sel = owner == t
                flat = self.params[t].view(-1)
                flat.index_add_(0, torch.from_numpy((idx[sel] - self._offsets[t]).astype(
                    np.int64)), torch.from_numpy(np.ascontiguousarray(vals[sel])).to(
                    flat.dtype))
        self.entries_applied += idx.size

    def _take(self, idx: np.ndarray, vals: np.ndarray) -> None:
        """The leader's ``apply``: add, and keep for the replicas' broadcast. Entries of a
        tensor this step's forward already read wait for the clock's end (``_deferred``):
        changing it in place now would corrupt the gradient autograd computes from it."""
        if self._read:
            owner = tensor_of(self._offsets, idx)
            late = np.isin(owner, list(self._read))
            if late.any():
                self._deferred.append((idx[late], vals[late]))
                idx, vals = idx[~late], vals[~late]
        self._add(idx, vals)
        self._got.append((idx, vals))

    def _take_deferred(self) -> None:
        self._read.clear()
        deferred, self._deferred = self._deferred, []
        for idx, vals in deferred:
            self._take(idx, vals)

    def _dc_size(self) -> int:
        import torch.distributed as dist
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _reader(self, tensors: list[int]) -> Any:
        def before_forward(_module: Any, _inputs: Any) -> None:
            wanted = self._blocked.intersection(tensors)
            if wanted:
                self.reads_blocked += 1
                if self.mirror is not None:
                    self.mirror.wait_tensors(wanted, self._take,
                                             timeout_s=self.barrier_timeout_s)
                self._blocked -= wanted
                self._sync()
            self._read.update(tensors)
        return before_forward

    def _sync(self, blocked: bool = False) -> None:
        """Broadcast what the leader applied since the last sync (and, with ``blocked``, the
        blocked tensors) to the data centre's other replicas, which apply it."""
        if self._dc_size() <= 1:
            self._got.clear()
            return
        import torch.distributed as dist
        torch = self._torch
        leader = self.mirror is not None
        got = self._got
        idx = np.concatenate([i for i, _ in got]) if got else np.zeros(0, np.int32)
        vals = np.concatenate([v for _, v in got]) if got else np.zeros(0, np.float32)
        got.clear()
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        head = torch.tensor([idx.size, len(self._blocked) if blocked else 0], dtype=torch.int64)
        dist.broadcast(head, src, group=self.group)
        n, nb = (int(v) for v in head.tolist())
        if n:
            ti = torch.from_numpy(idx) if leader else torch.empty(n, dtype=torch.int32)
            tv = torch.from_numpy(vals) if leader else torch.empty(n, dtype=torch.float32)
            dist.broadcast(ti, src, group=self.group)
            dist.broadcast(tv, src, group=self.group)
            if not leader:
                self._add(ti.numpy(), tv.numpy())
        if nb:
            tb = (torch.tensor(sorted(self._blocked), dtype=torch.int64) if leader
                  else torch.empty(nb, dtype=torch.int64))
            dist.broadcast(tb, src, group=self.group)
            self._blocked = set(tb.tolist())
        elif blocked:
            self._blocked = set()

    def settle(self) -> None:
        """Apply every update announced so far (waiting at most ``barrier_timeout_s`` for it)
        instead of module by module at the next forward pass: before evaluating, saving or
        comparing the parameters. Every replica of the data centre calls it."""
        self._take_deferred()
        if self._blocked and self.mirror is not None:
            self.mirror.wait_tensors(self._blocked, self._take,
                                     timeout_s=self.barrier_timeout_s)
        self._blocked = set()
        self._sync()

    def after_step(self) -> None:
        """Share this step's significant updates and take the other data centres'.

        Raises:
            GaiaError: another data centre died or timed out (named).
        """
        self._clock_tick(final=False)

    def finish(self) -> None:
        """End of training: share every accumulated update, significant or not, wait for
        every data centre's last clock and apply theirs, so that all replicas end with every
        update made anywhere. Call once, after the last :meth:`after_step`; the modules'
        barrier hooks are removed."""
        self._clock_tick(final=True)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _clock_tick(self, *, final: bool) -> None:
        self.clock += 1
        self._take_deferred()
        cur = self._flat()
        if self.mirror is not None and self.filter is not None:
            self.filter.add(cur - self._prev)
            self._prev = cur
            idx, vals = (self.filter.flush() if final
                         else self.filter.select(cur, clock=self.clock))
            self.entries_published += idx.size
            self.mirror.clock.finish()
            self.mirror.publish(self.clock, idx, vals)
            self.mirror.exchange(self._take, everyone=final)
            self._blocked = self.mirror.barrier.blocked(up_to=self.clock)
        else:
            self._prev = cur
        self._sync(blocked=True)
