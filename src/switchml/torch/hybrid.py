"""Poseidon's hybrid communication (ATC'17) for PyTorch: per layer, the cheaper of aggregation and
sufficient-factor broadcasting, with wait-free backpropagation.

Theory of operation
-------------------
A fully connected layer ``y = x W^T + b`` (``W``: N x M, N = out_features, M = in_features) fed K
rows per worker has the weight gradient ``G^T X`` (``G``: K x N, the gradient of the loss with
respect to ``y``; ``X``: K x M, the layer's input). So instead of aggregating the N x M gradient,
the workers can exchange their *sufficient factors* ``(G_i, X_i)`` and every worker rebuilds
``sum_i G_i^T X_i / n`` itself: the averaged gradient DDP would produce, to floating-point
rounding. Per worker and step that moves

* aggregation through a switchml switch: ``M N`` elements out and ``M N`` in, each as an int32
  (the switchml process group's wire width): ``2 M N * 4`` bytes; through a ring all-reduce
  (gloo and other groups): ``2 (n-1)/n M N * 4`` out and as much in;
* sufficient-factor broadcasting with ``all_gather_into_tensor`` (on a switchml group it runs on
  gloo, a ring: each worker forwards the other workers' factors): ``(n-1) K (M + N) * 4`` out and
  as much in. (With a true multicast a worker would send only ``K (M + N) * 4``; gloo has none.)

:func:`choose` picks the smaller per layer; the bias always goes with the aggregated gradients.
K is read at run time, every step: after each forward the ranks all-gather how many rows each
layer saw (a few bytes, awaited when backprop reaches the first hook), so decisions agree on
every rank and change when the batch size does; ranks that saw fewer rows than the largest pad
their factors with zero rows (which add nothing to ``G^T X``).

Wait-free backpropagation: every parameter that is aggregated is put in a bucket (about
``bucket_cap_mb``, in reverse registration order like DDP); a bucket's all-reduce starts the
moment its last gradient is accumulated (``register_post_accumulate_grad_hook``), and a layer's
factor all-gather starts the moment the gradient of its output is known (a tensor hook), both
while the rest of the backward pass runs. At the end of the backward pass (a callback queued on
the autograd engine, as DDP does) every handle is waited, buckets are copied back divided by the
world size and sufficient-factor gradients are rebuilt, so after ``loss.backward()`` returns the
gradients are final, exactly as with DDP.

Limits (checked, with an error naming the layer or parameter): every parameter that requires a
gradient must get one in every backward pass; each ``nn.Linear`` is called at most once per
forward (exclude others by name); one backward per forward (no gradient accumulation across
forwards, no ``no_sync``); gradients are zeroed every step (a sufficient-factor weight gradient
is overwritten with the rebuilt one). A weight shared by several modules is always aggregated.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from switchml.torch.timeline import COMPUTE, Timeline

__all__ = ["AGGREGATE", "SFB", "HybridDataParallel", "LayerDecision", "Transport",
           "aggregation_bytes", "candidate_layers", "choose", "cut_buckets", "sfb_bytes",
           "transport_of"]

log = logging.getLogger(__name__)
AGGREGATE = "aggregate"
DEFAULT_BUCKET_CAP_MB = 25.0
"""HybridDataParallel's default bucket size (MiB), as DDP's."""
SFB = "sfb"
FACTOR_BYTES = 4
"""Sufficient factors travel as float32."""
# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass(frozen=True, slots=True)
class Transport:
    """How a group all-reduces: through a switch or as a ring, and the bytes per element."""

    kind: str
    """``switch`` (each worker sends its vector once and receives the sum once) or ``ring``."""
    wire_bytes: int
    """Bytes per element on the wire: 4 for switchml's int32 (2 in 16-bit mode), 4 for float32
    on a ring."""

    def __post_init__(self) -> None:
        if self.kind not in ("switch", "ring"):
            raise ValueError(f"Transport.kind must be 'switch' or 'ring', got {self.kind!r}")
        if self.wire_bytes not in (2, 4, 8):
            raise ValueError(f"Transport.wire_bytes must be 2, 4 or 8, got {self.wire_bytes}")


def transport_of(group: Any) -> Transport:
    """The transport of a process group: a switchml group aggregates through the switch in
    int32; any other group (gloo) as a ring of float32."""
    name = group.name() if hasattr(group, "name") else ""
    if name == "switchml":
        return Transport("switch", 4)
    return Transport("ring", 4)


def aggregation_bytes(numel: int, *, world: int, transport: Transport) -> int:
    """Bytes a worker sends plus receives to aggregate ``numel`` elements."""
    if world < 2:
        return 0
    if transport.kind == "switch":
        return 2 * numel * transport.wire_bytes
    return round(2 * 2 * (world - 1) / world * numel * transport.wire_bytes)


def sfb_bytes(rows: int, in_features: int, out_features: int, *, world: int) -> int:
    """Bytes a worker sends plus receives to all-gather ``rows`` sufficient-factor rows of a
    layer (gloo's ring all-gather: (n-1) blocks out and (n-1) in)."""
    block = rows * (in_features + out_features) * FACTOR_BYTES
    return 2 * (world - 1) * block


@dataclass(frozen=True, slots=True)
class LayerDecision:
    """How one ``nn.Linear``'s weight gradient travels, and why."""

    name: str
    in_features: int
    out_features: int
    rows: int
    """K: the most rows (samples x positions) any rank fed the layer this step."""
    world: int
    aggregation_bytes: int
    """Per worker and step, sent plus received, if the weight gradient is aggregated."""
    sfb_bytes: int
    """Per worker and step, sent plus received, if its sufficient factors are all-gathered."""
    path: str
    """``aggregate`` or ``sfb``: the cheaper (aggregate on a tie, and when K is 0)."""

    @property
    def chosen_bytes(self) -> int:
        return self.sfb_bytes if self.path == SFB else self.aggregation_bytes

    def __str__(self) -> str:
        return (f"{self.name or '<root>'}: {self.out_features}x{self.in_features}, K={self.rows}, "
                f"n={self.world}: aggregate {self.aggregation_bytes / 1e6:.3f} MB, "
                f"sfb {self.sfb_bytes / 1e6:.3f} MB -> {self.path}")


def choose(name: str, *, in_features: int, out_features: int, rows: int, world: int,
           transport: Transport) -> LayerDecision:
    """Decide one layer's path by the cost model (bytes per worker per step)."""
    if min(in_features, out_features, world) < 1 or rows < 0:
        raise ValueError(f"layer {name!r}: sizes must be positive, got in={in_features}, "
                         f"out={out_features}, rows={rows}, world={world}")
    agg = aggregation_bytes(in_features * out_features, world=world, transport=transport)
    sfb = sfb_bytes(rows, in_features, out_features, world=world)
    # A layer no rank fed this step has no factors: aggregating it reports the missing gradient.
    return LayerDecision(name, in_features, out_features, rows, world, agg, sfb,
                         SFB if rows > 0 and sfb < agg else AGGREGATE)


def candidate_layers(module: nn.Module, exclude: Iterable[str] = ()
                     ) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` modules whose weight gradient may travel by sufficient factors, by
    name: trainable, not shared with another module, not in ``exclude``.

    Raises:
        ValueError: ``exclude`` names no module.
    """
    exclude = set(exclude)
    names = {n for n, _ in module.named_modules()}
    unknown = exclude - names
    if unknown:
        raise ValueError(f"exclude names no module: {sorted(unknown)}")
    owners: dict[int, int] = {}
    for _, m in module.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and name not in exclude and m.weight.requires_grad
            and owners[id(m.weight)] == 1]


def cut_buckets(items: Sequence[tuple[int, Any]], cap_bytes: int) -> list[list[int]]:
    """Group consecutive ``(nbytes, kind)`` items into buckets of at most ``cap_bytes`` (an
    item larger than that is a bucket of its own), a new one also where ``kind`` (the dtype)
    changes: each bucket as its items' indices."""
    buckets: list[list[int]] = []
    size, bucket_kind = 0, None
    for i, (nbytes, kind) in enumerate(items):
        if not buckets or size + nbytes > cap_bytes or kind != bucket_kind:
            buckets.append([])
            size, bucket_kind = 0, kind
        buckets[-1].append(i)
        size += nbytes
    return buckets


class _Layer:
    """Per-``nn.Linear`` state: the captured input of the current forward and its gather."""

    __slots__ = ("name", "module", "index", "rows", "x", "forward_id", "calls", "gather",
                 "gather_out", "local_rows")

    def __init__(self, name: str, module: nn.Linear, index: int) -> None:
        self.name, self.module, self.index = name, module, index
        self.rows = 0
        self.local_rows = 0
        self.x: torch.Tensor | None = None
        self.forward_id = -1
        self.calls = 0
        self.gather: Any = None
        self.gather_out: torch.Tensor | None = None


class _Bucket:
    __slots__ = ("params", "numel", "ready", "flat", "work")

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.ready = 0
        self.flat: torch.Tensor | None = None
        self.work: Any = None


class HybridDataParallel(nn.Module):
    """Data parallelism with per-layer hybrid communication; wrap a model in one line.

    ``model = HybridDataParallel(model)`` (after ``dist.init_process_group``) and train as with
    ``DistributedDataParallel``: after ``loss.backward()`` every rank holds the gradients
    averaged over the ranks. Each ``nn.Linear``'s weight gradient goes by sufficient-factor
    broadcasting when :func:`choose` says it moves fewer bytes, the rest is all-reduced in
    buckets launched as soon as they are ready.

    Args:
        module: the model; its parameters are broadcast from rank 0 on creation (as DDP does).
        process_group: the group (default: the default group). On a switchml group
            aggregation goes through the switch and factors through its gloo side.
        bucket_cap_mb: bucket size for the aggregated gradients (MiB, as DDP's).
        sfb: False aggregates everything (DDP-like; for comparisons).
        exclude: names of ``nn.Linear`` modules never sent by sufficient factors.
        broadcast_buffers: broadcast buffers (BatchNorm statistics) from rank 0 before each
            forward, as DDP does by default.
        timeline: record each bucket's all-reduce and each layer's all-gather (``comm``,
            launch to completion) and each gradient rebuild (``compute``) for a Chrome trace;
            the training loop records its own forward, backward and optimizer spans.

    Attributes:
        decisions: the :class:`LayerDecision` of every ``nn.Linear``, as of the latest backward
            pass (logged at INFO whenever they change).

    Raises:
        ValueError: bad arguments (unknown ``exclude`` names, non-positive bucket size).
        RuntimeError: in ``backward``: a parameter got no gradient, a layer was called twice in
            one forward, or a backward ran without a forward.
    """

    def __init__(self, module: nn.Module, process_group: Any = None, *,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, sfb: bool = True,
                 exclude: Iterable[str] = (), broadcast_buffers: bool = True,
                 timeline: Timeline | None = None) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("HybridDataParallel needs torch.distributed initialised "
                               "(dist.init_process_group) first")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.module = module
        self.process_group = process_group
        group = process_group if process_group is not None else \
            dist.distributed_c10d._get_default_group()
        self.world = dist.get_world_size(process_group)
        self.transport = transport_of(group)
        self.sfb_enabled = sfb
        self.broadcast_buffers = broadcast_buffers
        self.timeline = timeline
        self._bucket_cap = int(bucket_cap_mb * 2**20)
        self.decisions: list[LayerDecision] = []
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._param_names = {id(p): n for n, p in module.named_parameters()}
        self._layers = self._find_layers(module, set(exclude))
        self._sync_module_states()
        self._hooks: list[Any] = []
        for layer in self._layers:
            self._hooks.append(layer.module.register_forward_hook(
                lambda m, args, out, layer=layer: self._on_forward(layer, args, out)))
        for p in self._params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        # per-step state
        self._forward_id = 0
        self._rows_work: Any = None
        self._rows_out: torch.Tensor | None = None
        self._plan_key: tuple[int, ...] | None = None
        self._sfb_weights: set[int] = set()
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._next_bucket = 0
        self._in_backward = False
        self._gathers: list[_Layer] = []

    # -- set-up ------------------------------------------------------------------------------

    @staticmethod
    def _find_layers(module: nn.Module, exclude: set[str]) -> list[_Layer]:
        return [_Layer(name, m, i) for i, (name, m) in
                enumerate(candidate_layers(module, exclude))]

    @torch.no_grad()
    def _sync_module_states(self) -> None:
        src = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            dist.broadcast(t.data, src=src, group=self.process_group)

    def remove_hooks(self) -> None:
        """Detach from the module (it trains locally afterwards)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- forward -----------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.world > 1:
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, src=dist.get_global_rank(self.process_group, 0)
                                   if self.process_group else 0, group=self.process_group)
        if self._in_backward:  # the last backward raised before its end-of-pass callback
            self._reset_step()
        self._forward_id += 1
        for layer in self._layers:
            layer.calls, layer.rows, layer.x = 0, 0, None
        out = self.module(*args, **kwargs)
        if self.sfb_enabled and self._layers and torch.is_grad_enabled() and self.world > 1:
            # 1. tell the other ranks how many rows each layer saw (decided at backward)
            local = torch.tensor([layer.rows for layer in self._layers], dtype=torch.int64)
            self._rows_out = torch.empty(self.world * len(self._layers), dtype=torch.int64)
            self._rows_work = _all_gather(self._rows_out, local, group=self.process_group,
                                          async_op=True)
            if self.timeline is not None:
                self.timeline.record_work("rows all_gather", self._rows_work,
                                          bytes=local.numel() * 8)
        return out

    def _on_forward(self, layer: _Layer, args: tuple[Any, ...], out: Any) -> None:
        if not (self.sfb_enabled and torch.is_grad_enabled() and isinstance(out, torch.Tensor)
                and out.requires_grad):
            return
        layer.calls += 1
        x = args[0].detach()
        layer.x = x.reshape(-1, layer.module.in_features)
        layer.rows = layer.x.shape[0]
        layer.forward_id = self._forward_id
        fid = self._forward_id
        out.register_hook(lambda g, layer=layer, fid=fid: self._on_grad_output(layer, g, fid))

    # -- backward ----------------------------------------------------------------------------

    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._plan()

    def _plan(self) -> None:
        """Decide every layer's path for this step and (re)build the buckets if they changed."""
        rows = [0] * len(self._layers)
        if self._rows_work is not None:
            self._rows_work.wait()
            assert self._rows_out is not None
            rows = self._rows_out.view(self.world, -1).max(dim=0).values.tolist()
            self._rows_work = None
        key = tuple(rows)
        if key == self._plan_key:
            return
        self._plan_key = key
        self.decisions = [
            choose(layer.name, in_features=layer.module.in_features,
                   out_features=layer.module.out_features, rows=r, world=self.world,
                   transport=self.transport)
            for layer, r in zip(self._layers, rows)]
        if not self.sfb_enabled or self.world < 2:
            self.decisions = [LayerDecision(d.name, d.in_features, d.out_features, d.rows,
                                            d.world, d.aggregation_bytes, d.sfb_bytes, AGGREGATE)
                              for d in self.decisions]
        for d in self.decisions:
            log.info("hybrid: %s", d)
        self._sfb_weights = {id(layer.module.weight) for layer, d in
                             zip(self._layers, self.decisions) if d.path == SFB}
        self._build_buckets()

    def _build_buckets(self) -> None:
        params = [p for p in reversed(self._params) if id(p) not in self._sfb_weights]
        self._buckets = [_Bucket([params[i] for i in group]) for group in cut_buckets(
            [(p.numel() * p.element_size(), p.dtype) for p in params], self._bucket_cap)]
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b.params}

    def _on_grad_output(self, layer: _Layer, grad: torch.Tensor, fid: int) -> None:
        self._begin_backward()
        if fid != self._forward_id:
            raise RuntimeError(f"HybridDataParallel: backward through an older forward of "
                               f"layer {layer.name!r}; run one backward per forward")
        if layer.calls != 1:
            raise RuntimeError(f"HybridDataParallel: layer {layer.name!r} was called "
                               f"{layer.calls} times in one forward; pass exclude="
                               f"[{layer.name!r}] to aggregate it instead")
        if self.decisions[layer.index].path != SFB:
            layer.x = None
            return
        # 2. this layer's factors [G | X], padded to the largest K of any rank, all-gathered now
        assert layer.x is not None
        k = self.decisions[layer.index].rows
        g = grad.detach().reshape(-1, layer.module.out_features)
        n_out = layer.module.out_features
        local = torch.zeros(k, n_out + layer.module.in_features, dtype=g.dtype)
        local[:g.shape[0], :n_out] = g
        local[:g.shape[0], n_out:] = layer.x
        layer.x = None
        layer.gather_out = torch.empty(self.world * k, local.shape[1], dtype=g.dtype)
        layer.gather = _all_gather(layer.gather_out, local,
                                                   group=self.process_group, async_op=True)
        if self.timeline is not None:
            self.timeline.record_work(f"sfb all_gather {layer.name}", layer.gather,
                                      bytes=local.numel() * local.element_size())
        self._gathers.append(layer)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        self._begin_backward()
        i = self._bucket_of.get(id(p))
        if i is None:  # a weight sent by sufficient factors
            return
        self._buckets[i].ready += 1
        # 3. launch every complete bucket, in order (all ranks issue them identically)
        while (self._next_bucket < len(self._buckets)
               and self._buckets[self._next_bucket].ready == len(
                   self._buckets[self._next_bucket].params)):
            self._launch(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, b: _Bucket) -> None:
        for p in b.params:
            if p.grad is None:
                raise RuntimeError(f"HybridDataParallel: parameter "
                                   f"{self._param_names.get(id(p), '?')!r} got no gradient in "
                                   f"this backward pass; every parameter that requires a "
                                   f"gradient must get one")
        b.flat = torch.cat([p.grad.detach().reshape(-1) for p in b.params])  # type: ignore[union-attr]
        b.work = dist.all_reduce(b.flat, group=self.process_group, async_op=True)
        if self.timeline is not None:
            self.timeline.record_work(f"allreduce bucket {self._buckets.index(b)}", b.work,
                                      bytes=b.flat.numel() * 4, params=len(b.params))

    def _finish_backward(self) -> None:
        """End of backward (queued on the autograd engine): launch what is left, wait for
        everything, write the averaged gradients."""
        try:
            # 4. buckets not launched yet (a parameter without gradient raises here)
            while self._next_bucket < len(self._buckets):
                self._launch(self._buckets[self._next_bucket])
                self._next_bucket += 1
            # 5. rebuild each sufficient-factor gradient as its gather completes
            for layer in self._gathers:
                layer.gather.wait()
                start = Timeline.now()
                out = layer.gather_out
                assert out is not None
                n_out = layer.module.out_features
                grad = out[:, :n_out].t().mm(out[:, n_out:]).div_(self.world)
                w = layer.module.weight
                if w.grad is None:
                    w.grad = grad
                else:
                    w.grad.copy_(grad)
                layer.gather = layer.gather_out = None
                if self.timeline is not None:
                    self.timeline.record(f"sfb rebuild {layer.name}", COMPUTE, start,
                                         Timeline.now())
            # 6. aggregated buckets: wait, average, copy back
            for b in self._buckets:
                b.work.wait()
                assert b.flat is not None
                b.flat.div_(self.world)
                offset = 0
                for p in b.params:
                    n = p.numel()
                    p.grad.copy_(b.flat[offset:offset + n].view_as(p))  # type: ignore[union-attr]
                    offset += n
                b.flat = b.work = None
        finally:
            self._reset_step()

    def _reset_step(self) -> None:
        for b in self._buckets:
            b.ready, b.flat, b.work = 0, None, None
        for layer in self._gathers:
            layer.gather = layer.gather_out = None
        self._next_bucket = 0
        self._gathers = []
        self._in_backward = False
