"""DDP communication hooks: aggregate gradient buckets through a switchml switch.

Usage::

    from switchml.torch.hooks import SwitchMLHookState, switchml_hook
    model = DistributedDataParallel(net)                 # any backend, e.g. gloo
    state = SwitchMLHookState(bits=16)                   # on every rank, same arguments
    model.register_comm_hook(state, switchml_hook)

or by name (for configs and command lines): ``register_hook(model, "switchml16")``.

Hooks (``HookName``):

* ``switchml`` (``bits=32``): the bucket, divided by the world size, all-reduced through the
  switch in 32-bit fixed point. Error bound as in docs/protocol.md.
* ``switchml16`` (``bits=16``): 16-bit fixed point on the wire, half the bytes. Each rank keeps
  its own quantization error per bucket and adds it to the next step's bucket (error feedback), so
  rounding errors are delayed instead of lost and training converges like the 32-bit mode.
* ``allreduce``: the reference: ``dist.all_reduce`` over the state's process group (what DDP
  does without a hook), for correctness comparisons.
* ``noop``: no communication at all (each rank keeps its local gradient), for measuring the
  communication-free headroom.

Tuning guide (``SwitchMLHookState``): ``bits`` trades bandwidth for precision (16 is fine with
error feedback for SGD-like optimisers; use 32 for the first steps of very sensitive models).
``window`` and ``elements_per_packet`` are the switch job's geometry (defaults: chunks that fit
the path MTU to the switch, about 256 KiB in flight).
"""

# No ``from __future__ import annotations``: DDP checks the hooks' annotations as objects.
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from switchml import env
from switchml.control import decode_job_spec, encode_job_spec, new_job_spec
from switchml.protocol.config import WorkerConfig
from switchml.protocol.errors import ConfigError
from switchml.transport.udp import WorkerClient, elements_per_packet_for

__all__ = ["HookName", "SwitchMLHookState", "allreduce_hook", "hook_for", "noop_hook",
           "register_hook", "switchml_hook"]


class SwitchMLHookState:
    """State of the switchml DDP hook: the switch client, the mode, and error-feedback memory.

    Create it on every rank with the same arguments, after ``init_process_group``: rank 0 of
    ``process_group`` creates a switch job (and, with ``SWITCHML_SWITCH`` unset and no switchml
    group around, an embedded switch) and shares it with the others over that group.

    Args:
        process_group: the DDP group (default: the default group). Any backend.
        bits: 32, or 16 (half the bytes on the wire, with error feedback).
        window, elements_per_packet: the switch job's geometry (W slots, k int32 per slot);
            default: k fits rank 0's path MTU to the switch, W keeps about 256 KiB in flight.
        op_timeout_s: a bucket fails if no progress for this long (a dead peer or switch).

    Raises:
        ConfigError: bits other than 32 or 16.
    """

    __slots__ = (
        # tuned by users
        "bits", "process_group",
        # internal
        "client", "world_size", "_owns_client", "_owns_switch", "residuals",
        # stats
        "buckets", "bytes_sent",
    )

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, bits: int = 32,
                 window: int | None = None, elements_per_packet: int | None = None,
                 op_timeout_s: float = 60.0) -> None:
        if bits not in (32, 16):
            raise ConfigError(f"bits must be 32 or 16, got {bits}")
        from switchml.torch.backend import SwitchMLProcessGroup, _resolve_address_over_group
        self.bits = bits
        self.process_group = process_group
        pg = process_group or dist.distributed_c10d._get_default_group()
        self.world_size = dist.get_world_size(pg)
        # Per bucket index: which parameters the bucket holds, and their rounding residual.
        self.residuals: dict[int, tuple[tuple[tuple[int, int], ...], torch.Tensor]] = {}
        self.buckets = 0
        self.bytes_sent = 0
        self._owns_switch = False
        if isinstance(pg, SwitchMLProcessGroup):
            self.client = pg.client  # the group's own switch job
            self._owns_client = False
            return
        rank = dist.get_rank(pg)
        switch, secret, self._owns_switch = _resolve_address_over_group(pg, rank)
        # Rank 0's path MTU to the switch sizes the chunks unless told (every rank of a hook's
        # group usually shares a network; the backend itself takes the smallest over ranks).
        box: list[Any] = [encode_job_spec(new_job_spec(
            self.world_size, window=window,
            elements_per_packet=elements_per_packet or elements_per_packet_for(switch)))
            if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
        self.client = WorkerClient(switch, decode_job_spec(box[0]), rank, WorkerConfig(
            op_timeout_s=op_timeout_s, join_timeout_s=op_timeout_s, secret=secret),
            batching=env.batching())
        self._owns_client = True

    def __getstate__(self) -> dict[str, Any]:
        """Checkpointing keeps the settings, not the process group or sockets."""
        return {"bits": self.bits}

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise RuntimeError("recreate SwitchMLHookState after loading a checkpoint "
                           f"(saved settings: {state})")

    def close(self) -> None:
        """Leave the hook's switch job (and release an embedded switch this rank started)."""
        if self._owns_client:
            self.client.close()
            self._owns_client = False
        if self._owns_switch:
            from switchml.torch.backend import _EMBEDDED
            self._owns_switch = False
            _EMBEDDED.release()


def switchml_hook(state: SwitchMLHookState, bucket: dist.GradBucket
                  ) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket through the switch; see the module docstring."""
    # 1. The flat bucket, divided by the world size (DDP does not pre-divide).
    buffer = bucket.buffer()
    buffer.div_(state.world_size)
    # 2. A float32 contiguous CPU array to send (staged if the bucket is anything else).
    staged = buffer.dtype is not torch.float32 or buffer.device.type != "cpu" \
        or not buffer.is_contiguous()
    work = buffer.detach().to(device="cpu", dtype=torch.float32).contiguous() if staged \
        else buffer.detach()
    array = work.numpy()
    # 3. Error feedback: add what rounding took from this bucket last time.
    residual = None
    if state.bits == 16:
        # Keyed by the bucket's parameters, not only its index: DDP rebuilds its buckets after
        # the first iteration, and a residual must never be added to another layer's gradient.
        layout = tuple((p.data_ptr(), p.numel()) for p in bucket.parameters())
        entry = state.residuals.get(bucket.index())
        if entry is None or entry[0] != layout or entry[1].numel() != work.numel():
            entry = (layout, torch.zeros_like(work))
            state.residuals[bucket.index()] = entry
        residual = entry[1]
        work.add_(residual)
    state.buckets += 1
    state.bytes_sent += work.numel() * state.bits // 8
    # 4. Aggregate on the communication thread; the future resolves there.
    from switchml.torch.backend import complete_elsewhere, failable_future
    completer, future = failable_future()
    handle = state.client.allreduce_async(
        array, array, bits=state.bits,
        residual=residual.numpy() if residual is not None else None)

    def done(h: Any) -> None:
        error = h.exception()
        if error is None and staged:
            try:
                buffer.copy_(work)
            except Exception as exc:  # never leave DDP waiting on a future nobody completes
                error = exc
        if error is not None:
            complete_elsewhere(completer, RuntimeError(f"switchml DDP hook failed: {error}"))
            return
        complete_elsewhere(completer, buffer)

    handle.add_done_callback(done)
    return future


def allreduce_hook(state: SwitchMLHookState | dist.ProcessGroup | None,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The reference: divide, then ``dist.all_reduce`` over the group (DDP's default)."""
    group = state.process_group if isinstance(state, SwitchMLHookState) else state
    world = dist.get_world_size(group)
    buffer = bucket.buffer().div_(world)
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def noop_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """No communication: return the local bucket (measures the communication-free headroom)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class HookName(Enum):
    SWITCHML = "switchml"
    SWITCHML16 = "switchml16"
    ALLREDUCE = "allreduce"
    NOOP = "noop"


def hook_for(name: str | HookName, process_group: dist.ProcessGroup | None = None
             ) -> tuple[Any, Any]:
    """The ``(state, hook)`` pair for a hook's name, for ``ddp.register_comm_hook(state,
    hook)``. Raises ValueError listing the known names."""
    try:
        which = HookName(name)
    except ValueError:
        known = ", ".join(h.value for h in HookName)
        raise ValueError(f"unknown hook {name!r}; known: {known}") from None
    if which is HookName.NOOP:
        return None, noop_hook
    if which is HookName.ALLREDUCE:
        return process_group, allreduce_hook
    return SwitchMLHookState(process_group, bits=16 if which is HookName.SWITCHML16 else 32), \
        switchml_hook


def register_hook(model: torch.nn.parallel.DistributedDataParallel, name: str | HookName,
                  process_group: dist.ProcessGroup | None = None) -> Any:
    """Register a hook by name; returns its state. Raises ValueError listing the known names."""
    state, hook = hook_for(name, process_group)
    model.register_comm_hook(state, hook)
    return state
