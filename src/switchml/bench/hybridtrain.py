"""Pieces of ``switchml bench train`` for Poseidon's hybrid mode (per layer, aggregation on the
switch or sufficient-factor broadcasting), used inside the worker processes
(:func:`switchml.bench.nsproc.train`).

* :func:`wrap`: DDP (with a tracing communication hook when a timeline is kept) or
  :class:`switchml.torch.HybridDataParallel`;
* :func:`predicted_bytes`: bytes per worker per step by the cost model, as payload and with the
  headers each packet carries on the testbed's links;
* :func:`link_bytes`: the bytes the worker's interface sent and received (``/proc/net/dev``
  reads the namespace of the reading process; ``/sys/class/net`` would not);
* :class:`StepRecorder`: forward / backward / optimizer spans, where backward *compute* ends when
  the last gradient is accumulated (waiting for communication after that is not compute).
"""

from __future__ import annotations

from typing import Any

from switchml.protocol.wire import HEADER_SIZE, elements_for_mtu
from switchml.torch.timeline import COMM, COMPUTE, Timeline, chrome_events, hidden_fraction

__all__ = ["MODES", "StepRecorder", "link_bytes", "predicted_bytes", "wrap"]

MODES = ("ddp", "hybrid")
ETHERNET_HEADER = 14
IPV4_UDP = 28
TCP_IPV4 = 52  # 20 IP + 20 TCP + 12 timestamp option


def wrap(model: Any, mode: str, timeline: Timeline | None, hook: str | None = None) -> Any:
    """DDP or HybridDataParallel around ``model`` on the default group. ``hook``: a DDP
    communication hook by name (``switchml.torch.hooks.HookName``: ``switchml16``,
    ``noop`` ...); None: DDP's own all-reduce on the group's backend. With a ``timeline``,
    every bucket's communication is recorded on it."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if mode == "hybrid":
        if hook is not None:
            raise ValueError("the hybrid mode takes no DDP communication hook")
        from switchml.torch.hybrid import HybridDataParallel
        return HybridDataParallel(model, timeline=timeline)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from switchml.torch.timeline import traced_allreduce_hook, traced_hook
    ddp = DDP(model)
    if hook is not None:
        from switchml.torch.hooks import hook_for
        state, fn = hook_for(hook)
        if timeline is not None:
            ddp.register_comm_hook((state, fn, timeline), traced_hook)
        else:
            ddp.register_comm_hook(state, fn)
    elif timeline is not None:
        ddp.register_comm_hook((None, timeline), traced_allreduce_hook)
    return ddp


def predicted_bytes(wrapped: Any, model: Any, *, world: int, mtu: int,
                    hook: str | None = None) -> dict[str, Any]:
    """Bytes per worker per step (sent + received) by the cost model: ``payload`` and ``wire``
    (with Ethernet/IP/UDP/switchml headers per switchml datagram and Ethernet/IP/TCP headers per
    full TCP segment; TCP acknowledgements are not counted). ``hook``: the DDP communication
    hook by name, if any (``noop`` moves nothing; ``switchml16`` half the bytes of 32-bit
    aggregation through the switch, in datagrams of as many bytes; ``live``: 32-bit through
    the switch, from a replica whose own group is gloo's)."""
    import torch.distributed as dist

    from switchml.torch.hybrid import SFB, aggregation_bytes, transport_of
    transport = transport_of(dist.distributed_c10d._get_default_group())
    k = elements_for_mtu(mtu)
    switch_frame = (k * 4 + HEADER_SIZE + IPV4_UDP + ETHERNET_HEADER) / (k * 4)
    mss = mtu - TCP_IPV4
    tcp_frame = (mss + TCP_IPV4 + ETHERNET_HEADER) / mss
    agg_frame = switch_frame if transport.kind == "switch" else tcp_frame
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sfb_numel, sfb = 0, 0
    decisions = list(getattr(wrapped, "decisions", []))
    for d in decisions:
        if d.path == SFB:
            sfb_numel += d.in_features * d.out_features
            sfb += d.sfb_bytes
    agg = aggregation_bytes(total - sfb_numel, world=world, transport=transport)
    if hook in ("noop", "lockstep"):
        agg = 0  # (lockstep: a 4-byte all-reduce per bucket)
    elif hook in ("switchml", "switchml16", "live"):  # (live: each rank's own group)
        agg = 2 * (total - sfb_numel) * (2 if hook == "switchml16" else 4)  # up and down
        agg_frame = switch_frame
    return {"payload": agg + sfb, "wire": round(agg * agg_frame + sfb * tcp_frame),
            "aggregated_params": total - sfb_numel, "sfb_bytes": sfb,
            "decisions": [str(d) for d in decisions]}


def link_bytes(dev: str) -> int:
    """Bytes received plus sent by ``dev`` in this process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == dev:
                fields = rest.split()
                return int(fields[0]) + int(fields[8])
    raise ValueError(f"no interface {dev!r} in /proc/net/dev")


class StepRecorder:
    """Compute spans of the training loop on a :class:`Timeline`; backward compute ends at the
    last gradient accumulation (a post-accumulate hook on every parameter)."""

    def __init__(self, model: Any, timeline: Timeline) -> None:
        self.timeline = timeline
        self.last_grad_s = 0.0
        self.backward: list[tuple[float, float]] = []

        def seen(_p: Any) -> None:
            self.last_grad_s = Timeline.now()

        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(seen)

    def forward(self, start_s: float, end_s: float) -> None:
        self.timeline.record("forward", COMPUTE, start_s, end_s)

    def backward_done(self, start_s: float, end_s: float) -> None:
        """``loss.backward()`` ran from ``start_s`` to ``end_s`` (compute, then waiting)."""
        compute_end = min(max(self.last_grad_s, start_s), end_s)
        self.timeline.record("backward", COMPUTE, start_s, compute_end)
        if end_s > compute_end:
            self.timeline.record("synchronize gradients", COMPUTE, compute_end, end_s)
        self.backward.append((start_s, compute_end))

    def optimizer(self, start_s: float, end_s: float) -> None:
        self.timeline.record("optimizer", COMPUTE, start_s, end_s)

    def summary(self, *, since_s: float, rank: int) -> dict[str, Any]:
        """The hidden fraction over spans after ``since_s``, and the Chrome events (ts from
        the monotonic clock's origin, shifted by whoever merges ranks)."""
        spans = [s for s in self.timeline.snapshot() if s.start_s >= since_s]
        comm = [(s.start_s, s.end_s) for s in spans if s.tid == COMM]
        back = [b for b in self.backward if b[0] >= since_s]
        return {"hidden_fraction": hidden_fraction(comm, back),
                "comm_s": sum(e - s for s, e in comm),
                "events": chrome_events(self.timeline.snapshot(), pid=rank, origin_s=0.0)}
