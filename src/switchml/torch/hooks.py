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
* ``quorum``: the bucket averaged over a quorum group (:func:`switchml.torch.new_quorum_group`):
  each chunk's sum holds the first ``quorum`` ranks' gradients, every rank gets the same, and
  each element is divided by the ranks its sum holds (docs/torch.md, "Quorum groups").
* ``noop``: no communication at all (each rank keeps its local gradient), for measuring the
  communication-free headroom.
* ``lockstep``: no gradient moves, but the ranks wait for each other at every bucket (a
  one-element all-reduce), as a synchronous all-reduce makes them: the step of the slowest
  rank's compute, a floor under a synchronous system's step (where ranks share cores, it is
  usually above ``noop``'s, whose ranks never wait).

Tuning guide (``SwitchMLHookState``): ``bits`` trades bandwidth for precision (16 is fine with
error feedback for SGD-like optimisers; use 32 for the first steps of very sensitive models).
``window`` and ``elements_per_packet`` are the switch job's geometry (defaults as the backend's:
chunks that fit the smallest MTU of any rank towards the switch, about 256 KiB in flight).

The hooks share the backend's machinery (``switchml.torch.backend``): the switch is found by
:func:`~switchml.torch.embedded.resolve_switch` (``SWITCHML_SWITCH``, else rank 0's
embedded switch), the job is sized by :func:`~switchml.torch.jobspec.job_spec_for_ranks` from
every rank's :func:`~switchml.transport.sockets.local_mtu` (``SWITCHML_MTU``,
``SWITCHML_WINDOW`` and ``SWITCHML_ELEMENTS_PER_PACKET`` apply), and buckets travel through
:class:`~switchml.torch.staging.StagedTensor`.
"""

# No ``from __future__ import annotations``: DDP checks the hooks' annotations as objects.
import logging
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from switchml import env
from switchml.protocol.config import WorkerConfig
from switchml.protocol.errors import ConfigError
from switchml.torch.backend import SwitchMLProcessGroup
from switchml.torch.embedded import release_embedded_switch, resolve_switch
from switchml.torch.jobspec import agree_on_job
from switchml.torch.rendezvous import GroupExchange
from switchml.torch.staging import StagedTensor
from switchml.torch.works import bucket_done, failable_future
from switchml.transport.parallel import open_worker

log = logging.getLogger(__name__)

__all__ = ["HookName", "SwitchMLHookState", "allreduce_hook", "hook_for", "lockstep_hook",
           "noop_hook", "register_hook", "switchml_hook"]


class SwitchMLHookState:
    """State of the switchml DDP hook: the switch client, the mode, and error-feedback memory.

    Create it on every rank with the same arguments, after ``init_process_group``: rank 0 of
    ``process_group`` creates a switch job (and, with ``SWITCHML_SWITCH`` unset and no switchml
    group around, an embedded switch) and shares it with the others over that group.

    Args:
        process_group: the DDP group (default: the default group). Any backend.
        bits: 32, or 16 (half the bytes on the wire, with error feedback).
        window, elements_per_packet: the switch job's geometry (W slots, k int32 per slot);
            default: k fits the smallest MTU of any rank towards the switch, W keeps about
            256 KiB in flight (see :func:`switchml.torch.jobspec.job_spec_for_ranks`).
        op_timeout_s: a bucket fails if no progress for this long (a dead peer or switch).

    Raises:
        ConfigError: bits other than 32 or 16.
    """

    __slots__ = (
        # tuned by users
        "bits", "process_group",
        # internal
        "client", "world_size", "_owns_client", "_owns_switch", "residuals", "group",
        # stats
        "buckets", "bytes_sent",
    )

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, bits: int = 32,
                 window: int | None = None, elements_per_packet: int | None = None,
                 op_timeout_s: float = 60.0) -> None:
        if bits not in (32, 16):
            raise ConfigError(f"bits must be 32 or 16, got {bits}")
        self.bits = bits
        self.process_group = process_group
        pg = process_group or dist.distributed_c10d._get_default_group()
        self.world_size = dist.get_world_size(pg)
        # Per bucket index: which parameters the bucket holds, and their rounding residual.
        self.residuals: dict[int, tuple[tuple[tuple[int, int], ...], torch.Tensor]] = {}
        self.buckets = 0
        self.bytes_sent = 0
        self._owns_switch = self._owns_client = False
        self.group: SwitchMLProcessGroup | None = None
        if isinstance(pg, SwitchMLProcessGroup):
            self.client = pg.client  # the group's own switch job
            self.group = pg
            return
        exchange = GroupExchange(pg)
        switch, secret, self._owns_switch = resolve_switch(exchange)
        try:
            # The backend's rules: chunks fit the smallest MTU of any rank towards the switch;
            # the I/O threads are the fewest any rank asks for (all split the job alike).
            agreed = agree_on_job(exchange, switch, window=window,
                                  elements_per_packet=elements_per_packet, group_settings=False)
            self.client = open_worker(switch, agreed.spec, exchange.rank, WorkerConfig(
                op_timeout_s=op_timeout_s, join_timeout_s=op_timeout_s, secret=secret),
                threads=agreed.threads, batching=env.batching())
        except BaseException:
            self.close()  # the embedded switch, if this rank acquired it
            raise
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
            self._owns_switch = False
            release_embedded_switch()


def switchml_hook(state: SwitchMLHookState, bucket: dist.GradBucket
                  ) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket through the switch; see the module docstring."""
    # 1. The flat bucket, divided by the world size (DDP does not pre-divide).
    buffer = bucket.buffer()
    buffer.div_(state.world_size)
    # 2. A float32 contiguous CPU array to send (staged if the bucket is anything else).
    staged = StagedTensor(buffer, dtype=torch.float32)
    work = staged.flat
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
    if state.group is not None and state.group.failover is not None:
        # A switchml group that fails over to gloo: the bucket is numbered with the group's
        # all-reduces (the same switch job), and goes over gloo with them when the switch is
        # gone (summed exactly there; its residual cleared).
        fut = state.group.allreduce_bucket(work, bits=state.bits,
                                           residual=residual).get_future()

        def written(f: torch.futures.Future) -> torch.Tensor:
            f.value()  # raises the all-reduce's error
            staged.finish(state.world_size, average=False)
            return buffer

        return fut.then(written)
    # 4. Aggregate on the communication thread; the future resolves there.
    completer, future = failable_future()
    handle = state.client.allreduce_async(
        staged.array, staged.array, bits=state.bits,
        residual=residual.numpy() if residual is not None else None)

    # 5. Write a staged copy back into the bucket, then complete DDP's future.
    handle.add_done_callback(bucket_done(
        completer, buffer, lambda h: staged.finish(state.world_size, average=False),
        "switchml DDP hook"))
    return future


def allreduce_hook(state: SwitchMLHookState | dist.ProcessGroup | None,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The reference: divide, then ``dist.all_reduce`` over the group (DDP's default)."""
    group = state.process_group if isinstance(state, SwitchMLHookState) else state
    world = dist.get_world_size(group)
    buffer = bucket.buffer().div_(world)
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def quorum_hook(state: dist.ProcessGroup | None, bucket: dist.GradBucket
                ) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket over a quorum group (``state``:
    :func:`switchml.torch.new_quorum_group`, or None for a default group made with
    ``SWITCHML_QUORUM``): ``dist.all_reduce`` with AVG, which the group divides, element by
    element, by the ranks whose gradients the switch summed (the first ``quorum`` at each
    chunk). Every rank applies the same averaged gradient. (DDP's own division by the world
    size before a SUM would shrink a sum of fewer ranks.)

    Raises:
        TypeError: the group is not a switchml group with a quorum.
    """
    pg = state if state is not None else dist.distributed_c10d._get_default_group()
    if getattr(pg, "quorum", None) is None:
        raise TypeError("quorum_hook needs a switchml group with a quorum "
                        "(switchml.torch.new_quorum_group, or SWITCHML_QUORUM)")
    fut = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.AVG, group=state,
                          async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def noop_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """No communication: return the local bucket (measures the communication-free headroom)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def lockstep_hook(state: dist.ProcessGroup | None, bucket: dist.GradBucket
                  ) -> torch.futures.Future[torch.Tensor]:
    """No gradient moves, but the ranks wait for each other at every bucket, as any
    synchronous all-reduce makes them: a one-element all-reduce over ``state`` (the group;
    None: the default group), then the local bucket. The step it measures is the compute of
    the slowest rank, a floor under a synchronous system's step. A failed all-reduce (a peer
    gone) fails the future, as the other hooks' do."""
    buffer = bucket.buffer()
    token = torch.zeros(1, dtype=torch.float32, device=buffer.device)
    fut = dist.all_reduce(token, group=state, async_op=True).get_future()

    def local(f: torch.futures.Future) -> torch.Tensor:
        f.value()  # raises the all-reduce's error
        return buffer

    return fut.then(local)


class HookName(Enum):
    SWITCHML = "switchml"
    SWITCHML16 = "switchml16"
    ALLREDUCE = "allreduce"
    NOOP = "noop"
    LOCKSTEP = "lockstep"
    QUORUM = "quorum"


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
    if which is HookName.LOCKSTEP:
        return process_group, lockstep_hook
    if which is HookName.ALLREDUCE:
        return process_group, allreduce_hook
    if which is HookName.QUORUM:
        return process_group, quorum_hook
    return SwitchMLHookState(process_group, bits=16 if which is HookName.SWITCHML16 else 32), \
        switchml_hook


def register_hook(model: torch.nn.parallel.DistributedDataParallel, name: str | HookName,
                  process_group: dist.ProcessGroup | None = None) -> Any:
    """Register a hook by name; returns its state. Raises ValueError listing the known names."""
    state, hook = hook_for(name, process_group)
    model.register_comm_hook(state, hook)
    return state
