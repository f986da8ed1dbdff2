"""The torch.distributed backend "switchml": all-reduce through the switch, the rest via gloo.

``import switchml.torch`` registers it; then ``dist.init_process_group("switchml")`` under
``torchrun`` needs nothing else:

* Switch: ``SWITCHML_SWITCH=host:port`` names a running switch (jobs across machines). Unset, the
  group's rank 0 starts a software switch on 127.0.0.1 in a process of its own, with a random
  secret (stopped 2 s after its last group is destroyed, or when rank 0 exits) and shares its
  address and secret through the store.
* Job: rank 0 draws a job id and token (:func:`switchml.control.new_job_spec`) and shares them
  through the group's store; every rank JOINs the switch.
* Every other collective (broadcast, all_gather, reduce_scatter, barrier, send/recv ...) and
  every reduce op but SUM and AVG runs on an internal gloo group over the same store and is
  counted in :meth:`SwitchMLProcessGroup.stats`, so a user sees what did not go through the switch.

All-reduce details: SUM and AVG of float32, float64 (32-bit fixed point with block exponents,
error bound in docs/protocol.md), float16 and bfloat16 (widened exactly to float32, rounded back
once; on the wire as 16-bit fixed point, half the bytes, as gloo moves them, where the 16-bit
sum's bound is within half an ulp of the type at a block's scale, else 32-bit:
:func:`wire_bits`; ``SWITCHML_HALF_BITS`` on rank 0 says 16 or 32 outright), int32 (exact),
int64 (exact modulo 2**64 for up to 511 ranks: each value travels as three int32 limbs of
22/22/20 bits, so int64 costs three times the bytes). AVG divides after the sum (integers:
truncating division). Tensors are reduced in place, in any shape; non-contiguous and CUDA tensors
go through a contiguous host copy. Calls return at once; a communication thread aggregates, and
operations run in issue order: every rank must issue the same collectives in the same order (as
with any backend).

Failure: a rank or switch that stops answering makes pending operations raise ``RuntimeError``
after ``timeout`` (the process group's) without progress, naming the silent ranks or the switch.
Futures fail through :func:`failable_future`, which C++ consumers (DDP's reducer) see as errors.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import secrets
import threading
import weakref
from collections import Counter
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from switchml import env
from switchml.control import decode_job_spec, encode_job_spec, new_job_id
from switchml.protocol.address import Address, format_address
from switchml.protocol.config import JobSpec, WorkerConfig
from switchml.protocol.errors import ConfigError, SwitchMLError
from switchml.torch import flight
from switchml.torch.embedded import (
    EMBEDDED,
    embedded_switch_pid,
    release_embedded_switch,
    resolve_switch,
    resolve_switch_over_group,
    stop_embedded_switch,
)
from switchml.torch.failover import Failover, PendingOp, SwitchBack
from switchml.torch.flight import FlightRecorder
from switchml.torch.jobspec import agree_on_job, job_spec_for_ranks
from switchml.torch.rendezvous import StoreExchange
from switchml.torch.staging import HALF, StagedTensor, StagingPool, wire_bits
from switchml.torch.works import (
    SwitchMLWork,
    all_of,
    complete_elsewhere,
    error_of,
    failable_future,
    gather_opts,
    scatter_opts,
)
from switchml.transport.parallel import ParallelClient, open_worker
from switchml.transport.sockets import local_mtu
from switchml.transport.udp import AllreduceHandle, WorkerClient

__all__ = ["StagedTensor", "StagingPool", "SwitchMLProcessGroup", "SwitchMLWork",
           "complete_elsewhere", "embedded_switch_pid", "failable_future", "job_spec_for_ranks",
           "local_mtu", "new_quorum_group", "register", "release_embedded_switch",
           "resolve_switch", "resolve_switch_over_group", "stats", "stop_embedded_switch",
           "wire_bits"]

log = logging.getLogger(__name__)
BACKEND_NAME = "switchml"
_RedOp = dist.ReduceOp.RedOpType
_SWITCH_OPS = {_RedOp.SUM, _RedOp.AVG}
_SUPPORTED = {torch.float32, torch.float64, torch.int32, torch.int64} | HALF


class SwitchMLProcessGroup(dist.ProcessGroup):
    """A process group whose all-reduce goes through a switchml switch."""

    def __init__(self, *, rank: int, size: int, client: WorkerClient | ParallelClient,
                 gloo: dist.ProcessGroup, switch: tuple[Address, ...],
                 half_bits: int | None = None, quorum: int | None = None) -> None:
        super().__init__(rank, size)
        self.quorum = quorum
        """The group's quorum (``JobSpec.quorum``): each all-reduce's rounds complete with this
        many ranks, and AVG divides by the ranks each element's sum holds; None: every rank."""
        if half_bits not in (None, 16, 32):
            raise ValueError(f"half_bits must be None (auto), 16 or 32, got {half_bits}")
        self.client = client
        self.half_bits = half_bits
        """Bits on the wire of float16 and bfloat16 tensors: 16, 32, or None (``wire_bits``
        decides); the group's, from rank 0's ``SWITCHML_HALF_BITS``."""
        self.switch = switch
        """The switch's address, or a sharded switch's shards (``as_addresses``)."""
        self._gloo = gloo
        self._stats_lock = threading.Lock()
        self.switch_ops: Counter[str] = Counter()
        self.delegated: Counter[str] = Counter()
        self.owns_switch = False
        self._staging = StagingPool()
        self.flight = FlightRecorder(rank, size)
        self.flight.progress = client.progress
        self.failover: Failover | None = None
        """Set where the group goes on over gloo when its switch stops answering
        (``SWITCHML_FAILOVER=gloo``; ``torch/failover.py``)."""
        weakref.finalize(self, client.close)

    # -- identity ----------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # -- the switch path ---------------------------------------------------------------------

    def wire_bits(self, dtype: torch.dtype) -> int:
        """Bits per element on the wire for a tensor of ``dtype`` in this group
        (:func:`wire_bits`)."""
        return wire_bits(dtype, self.size(), self.half_bits)

    def _switchable(self, op: Any, tensors: list[torch.Tensor]) -> bool:
        """Whether the switch sums these: SUM or AVG of a supported type. Not int64 in a
        quorum group: its three limbs would travel in rounds of different ranks (gloo sums
        it, with every rank)."""
        return op in _SWITCH_OPS and all(
            t.dtype in _SUPPORTED and (self.quorum is None or t.dtype is not torch.int64)
            for t in tensors)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = opts.reduceOp.op if opts is not None else _RedOp.SUM
        if not self._switchable(op, tensors):
            return self._delegate("allreduce", lambda: self._gloo.allreduce(tensors, opts),
                                  f"allreduce:{op.name}")
        return self._allreduce_switch(tensors, average=op == _RedOp.AVG)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = opts.reduceOp.op if opts is not None else _RedOp.SUM
        if not self._switchable(op, tensors):
            return self._delegate("allreduce_coalesced",
                                  lambda: self._gloo.allreduce_coalesced(tensors, opts),
                                  f"allreduce_coalesced:{op.name}")
        return self._allreduce_switch(tensors, average=op == _RedOp.AVG)

    def allreduce_bucket(self, bucket: torch.Tensor, *, bits: int,
                         residual: torch.Tensor | None = None) -> dist.Work:
        """A DDP hook's bucket (``hooks.switchml_hook``): one SUM of a flat float32 CPU tensor
        through this group's switch job at ``bits`` (32 or 16), with ``residual`` the 16-bit
        hook's error feedback (float32, as many elements, written in place). Numbered with the
        group's all-reduces, so that it fails over with them: over gloo it is summed exactly,
        and ``residual`` cleared.

        Raises:
            ValueError: not a flat float32 CPU tensor, bits other than 32 or 16, or a residual
                of another shape or type.
        """
        if bucket.dtype is not torch.float32 or bucket.device.type != "cpu" or bucket.dim() != 1:
            raise ValueError(f"allreduce_bucket takes a flat float32 CPU tensor, got "
                             f"{bucket.dtype} of shape {tuple(bucket.shape)} on {bucket.device}")
        if bits not in (32, 16):
            raise ValueError(f"bits must be 32 or 16, got {bits}")
        if residual is not None and (residual.dtype is not torch.float32
                                     or residual.shape != bucket.shape
                                     or not residual.is_contiguous()):
            raise ValueError(f"the residual must be a contiguous float32 tensor of shape "
                             f"{tuple(bucket.shape)}, got {residual.dtype} of shape "
                             f"{tuple(residual.shape)}")
        return self._allreduce_switch([bucket], average=False, bits=bits, residual=residual)

    def _allreduce_switch(self, tensors: list[torch.Tensor], *, average: bool,
                          bits: int | None = None,
                          residual: torch.Tensor | None = None) -> dist.Work:
        """Queue one switch operation per tensor; the Work completes when all are done. Each
        tensor is written once every one has its sum (a failed operation leaves them as they
        were, when the failover keeps its inputs). ``bits``, ``residual``: a hook's bucket
        (``allreduce_bucket``)."""
        completer, future = failable_future()
        size = self.size()
        with self._stats_lock:
            self.switch_ops["allreduce" if bits is None else f"bucket{bits}"] += 1
        rec = self.flight.start("all_reduce" + (" avg" if average else "")
                                + (f" bucket{bits}" if bits is not None else ""), "switch",
                                tensors)
        if not tensors:
            self.flight.finish(rec)
            completer.set_result(tensors)
            return SwitchMLWork(future)
        fo = self.failover

        def done(error: BaseException | None) -> None:
            self.flight.finish(rec, error)
            if error is not None:
                log.error("switchml rank %d of %d: %s failed: %s; recent: %s",
                          self.rank(), size, rec.describe(), error, self.flight.summary())
                complete_elsewhere(completer, RuntimeError(f"switchml all_reduce failed: {error}"))
            else:
                complete_elsewhere(completer, tensors)

        seq, to_switch = fo.issue() if fo is not None else (-1, True)
        pending = PendingOp(seq, list(tensors), average, done, bits, residual)
        if not to_switch:  # switched over: gloo, in order
            assert fo is not None
            fo.take(pending)
        else:
            self._submit(pending)
        return SwitchMLWork(future)

    def _submit(self, pending: PendingOp) -> None:
        """Send ``pending`` through the switch (one operation per tensor); ``pending.done``
        once all are done, with the first error unless the failover takes the operation
        over. Raises RuntimeError where the client refuses it (not after a switch-over)."""
        fo = self.failover
        # With failover, a failed operation must leave its inputs whole. The worker puts an
        # in-place input back itself when its operation fails; but an operation of several
        # tensors, or cut in parts over several threads, may have some complete (written)
        # while another fails: those go through a staging copy.
        copy = fo is not None and (len(pending.tensors) > 1
                                   or isinstance(self.client, ParallelClient))
        try:
            plans = [StagedTensor(t, pool=self._staging, copy=copy) for t in pending.tensors]
        except BaseException as exc:
            if fo is not None and fo.failed(pending, exc):
                return  # (a switchml error while failed over: the failover runs it)
            raise
        handles: list[AllreduceHandle | None] = [None] * len(plans)
        state: dict[str, Any] = {"left": len(plans), "error": None}
        lock = threading.Lock()

        def settle(error: BaseException | None) -> None:
            self._settle(pending, plans, handles, error)

        def on_done(handle: AllreduceHandle, i: int) -> None:
            handles[i] = handle
            error = handle.exception()
            with lock:
                state["error"] = state["error"] or error
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                settle(state["error"])

        i = 0
        try:
            for i, plan in enumerate(plans):
                handle = self.client.allreduce_async(
                    plan.array, plan.array,
                    bits=pending.bits or self.wire_bits(plan.tensor.dtype),
                    residual=None if pending.residual is None else pending.residual.numpy())
                handle.add_done_callback(lambda h, i=i: on_done(h, i))
        except Exception as exc:  # (SwitchMLError: refused; anything else: a bug, raised)
            if i == 0 and (fo is None or not fo.active or not isinstance(exc, SwitchMLError)):
                for plan in plans:
                    plan.release()
                if fo is not None and fo.failed(pending, exc):
                    return  # another rank had switched over: the failover completes it
                if not isinstance(exc, SwitchMLError):
                    raise
                raise RuntimeError(f"switchml all_reduce refused: {exc}") from exc
            # The client closed under us (a switch-over), or failed after taking some parts:
            # the parts it did not take count as failed.
            with lock:
                state["error"] = state["error"] or exc
                state["left"] -= len(plans) - i
                last = state["left"] == 0
            if last:
                settle(state["error"])

    def _settle(self, pending: PendingOp, plans: list[StagedTensor],
                handles: list[AllreduceHandle | None], error: BaseException | None) -> None:
        """Every part of ``pending`` is done (``error``: the first failure): write the
        tensors and complete it, or fail it (the failover taking it over where it can)."""
        fo = self.failover
        kept: list[torch.Tensor] = []
        if error is None:
            try:
                for plan, handle in zip(plans, handles, strict=True):
                    assert handle is not None  # (every part succeeded)
                    counts = handle.contributors  # per block, in a quorum group
                    if counts is not None:
                        self._note_contributors(counts)
                    final = plan.finish(self.size(), pending.average, counts, handle.block,
                                        keep=fo is not None)
                    if final is not None:
                        kept.append(final)
            except Exception as exc:  # surfaced through the future
                error = exc
        if error is None:
            if fo is not None:
                fo.completed(pending.seq, kept)
            pending.done(None)
            return
        for plan in plans:
            plan.release()
        if fo is not None and fo.failed(pending, error):
            return  # the failover completes it, over gloo
        pending.done(error)

    def _install_client(self, client: WorkerClient | ParallelClient) -> None:
        """All-reduces go through ``client`` from now on (the failover went back to the
        switch, on a fresh job)."""
        self.client = client
        self.flight.progress = client.progress
        weakref.finalize(self, client.close)

    def _note_contributors(self, counts: np.ndarray) -> None:
        """Count a quorum group's all-reduces whose sum lacks some rank somewhere."""
        if counts.size and int(counts.min()) < self.size():
            with self._stats_lock:
                self.switch_ops["allreduce_partial"] += 1

    # -- everything else: gloo, counted ------------------------------------------------------

    def _delegate(self, name: str, call: Any, key: str | None = None) -> dist.Work:
        with self._stats_lock:
            self.delegated[key or name] += 1
        rec = self.flight.start(key or name, "gloo")
        work = call()
        try:
            work.get_future().add_done_callback(
                lambda f: self.flight.finish(rec, error_of(f)))
        except RuntimeError:  # a work without a future: recorded as started only
            pass
        return work

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._delegate("broadcast", lambda: self._gloo.broadcast(tensors, opts))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        return self._delegate("allgather", lambda: self._gloo.allgather(outputs, inputs, opts))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          opts: Any = None) -> dist.Work:
        """``dist.all_gather_into_tensor`` / ``all_gather_single`` (torch >= 2.13 call this)."""
        return self._delegate("allgather_into_tensor",
                              lambda: self._gloo._allgather_base(output, input, opts))

    _allgather_base = all_gather_single  # the name older torch versions call

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None
                                        ) -> dist.Work:
        """FSDP2's parameter all-gather. gloo has no coalesced form: one all-gather per
        tensor, in order, as one work."""
        return self._delegate("allgather_into_tensor_coalesced", lambda: all_of(
            [self._gloo._allgather_base(o, i, gather_opts(opts)) for o, i in
             zip(outputs, inputs, strict=True)], outputs))

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        return self._delegate("reduce_scatter",
                              lambda: self._gloo.reduce_scatter(outputs, inputs, opts))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                              opts: Any = None) -> dist.Work:
        """``dist.reduce_scatter_tensor`` / ``reduce_scatter_single`` (torch >= 2.13)."""
        return self._delegate("reduce_scatter_tensor",
                              lambda: self._gloo._reduce_scatter_base(output, input, opts))

    _reduce_scatter_base = reduce_scatter_single  # the name older torch versions call

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None
                                        ) -> dist.Work:
        """As :meth:`allgather_into_tensor_coalesced`: one reduce-scatter per tensor."""
        return self._delegate("reduce_scatter_tensor_coalesced", lambda: all_of(
            [self._gloo._reduce_scatter_base(o, i, scatter_opts(opts)) for o, i in
             zip(outputs, inputs, strict=True)], outputs))

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._delegate("reduce", lambda: self._gloo.reduce(tensors, opts))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any) -> dist.Work:
        return self._delegate("gather", lambda: self._gloo.gather(outputs, inputs, opts))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any) -> dist.Work:
        return self._delegate("scatter", lambda: self._gloo.scatter(outputs, inputs, opts))

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        return self._delegate("alltoall", lambda: self._gloo.alltoall(outputs, inputs, opts))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> dist.Work:
        return self._delegate("alltoall_base", lambda: self._gloo.alltoall_base(
            output, input, output_split_sizes, input_split_sizes, opts))

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._delegate("barrier", lambda: self._gloo.barrier(opts))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self._delegate("send", lambda: self._gloo.send(tensors, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self._delegate("recv", lambda: self._gloo.recv(tensors, src, tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        return self._delegate("recv_anysource", lambda: self._gloo.recv_anysource(tensors, tag))

    # -- introspection and life cycle --------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What went through the switch, what was delegated to gloo, and the worker counters."""
        with self._stats_lock:
            out = {"switch_ops": dict(self.switch_ops), "delegated": dict(self.delegated),
                   "worker": self.client.counters,
                   "switch": ",".join(format_address(a) for a in self.switch)}
        if self.failover is not None:
            out["failover"] = self.failover.stats()
        return out

    def shutdown(self) -> None:
        """Called by ``dist.destroy_process_group``: leave the job and release the embedded
        switch (stopped after a grace period once no group of this process uses it)."""
        if self.failover is not None:
            self.failover.close()
        self.client.close()
        if self.owns_switch:
            self.owns_switch = False
            EMBEDDED.release()


def _switchml_group(group: dist.ProcessGroup | None) -> SwitchMLProcessGroup:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, SwitchMLProcessGroup):
        raise TypeError(f"not a switchml process group: {type(pg).__name__}")
    return pg


def stats(group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Counters of a switchml group (the default group if None)."""
    return _switchml_group(group).stats()


def flight_records(group: dist.ProcessGroup | None = None) -> list[dict[str, Any]]:
    """The group's last collectives, oldest first (``torch/flight.py``): seq, op, path
    (switch or gloo), numel, dtype, started, ended, error, state (pending, done, failed)."""
    return _switchml_group(group).flight.records()


def dump_flight_records(file: Any = None) -> None:
    """Every switchml group's records in this process, as JSON lines (standard error)."""
    flight.dump_all(file)


# -- creation ----------------------------------------------------------------------------------

_SIGNAL_INSTALLED = False
_incarnation = 0  # how many times this process created a default group: keys stay fresh

def _create(store: dist.Store, rank: int, size: int,
            timeout: datetime.timedelta) -> SwitchMLProcessGroup:
    """The creator torch calls for every "switchml" group (default group and new_group)."""
    global _incarnation
    if not dist.is_initialized():
        _incarnation += 1  # a (re)created world: never read keys of an earlier one
    tenant_key = env.tenant_key()  # (a tenant's ranks hold its key, not the switch's secret)
    if tenant_key is not None and env.switch_addresses() is None:
        raise ConfigError("SWITCHML_TENANT_KEY is a key of a shared switch: set SWITCHML_SWITCH "
                          "(the embedded switch has a secret of its own)")
    tenant = env.tenant() if tenant_key is not None else None
    exchange = StoreExchange(store, f"switchml/{_incarnation}", rank, size)
    switch, secret, acquired = resolve_switch(exchange)  # (checks first: nothing to release)
    gloo: Any = None
    try:
        agreed = agree_on_job(exchange, switch, tenant=tenant, one_thread=tenant_key is not None,
                              quorum=_group_quorum(size))
        spec, half_bits, threads = agreed.spec, agreed.half_bits, agreed.threads
        gloo = ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        seconds = max(timeout.total_seconds(), 2.0)
        config = WorkerConfig(op_timeout_s=seconds, max_rto_s=min(1.0, seconds / 2),
                              join_timeout_s=seconds,
                              secret=None if tenant_key is not None else secret,
                              tenant_key=tenant_key)
        client = open_worker(switch, spec, rank, config, threads=threads,
                             batching=env.batching())
    except BaseException:
        # Nothing set up for a group that failed to form may outlive it.
        if gloo is not None:
            try:
                gloo.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the original error matters
                pass
        if acquired:
            EMBEDDED.release()
        raise
    pg = SwitchMLProcessGroup(rank=rank, size=size, client=client, gloo=gloo, switch=switch,
                              half_bits=half_bits, quorum=spec.quorum)
    pg.owns_switch = acquired
    if agreed.failover == "gloo":
        pg.failover = _failover(pg, store, rank, size, timeout, spec, config, threads, tenant,
                                probe_s=agreed.failover_probe_s)
    flight.watch(pg, env.stall_log_s() or 30.0)
    if (name := env.flight_signal()) is not None and not _SIGNAL_INSTALLED:
        flight.install_signal(name)
        globals()["_SIGNAL_INSTALLED"] = True
    # Device-level lookups (``group._get_backend(device)``, used by some torch helpers) find
    # gloo's backend; the collectives themselves come through the methods above and are counted.
    cpu = torch.device("cpu")
    pg._register_backend(cpu, dist.ProcessGroup.BackendType.GLOO, gloo)
    return pg


def _failover(pg: SwitchMLProcessGroup, store: dist.Store, rank: int, size: int,
              timeout: datetime.timedelta, spec: JobSpec, config: WorkerConfig, threads: int,
              tenant: int | None, *, probe_s: float) -> Failover:
    """``SWITCHML_FAILOVER=gloo`` (rank 0's setting): the group's switch-over to gloo, and its
    way back to a fresh job of the same shape at the same switch (``torch/failover.py``)."""
    keep = env.failover_keep_bytes()
    if keep is None:  # on one thread without a quorum, no rank is two all-reduces ahead
        keep = 0 if spec.quorum is None and threads == 1 else 256 * 2**20
    probe_config = dataclasses.replace(config, join_timeout_s=min(config.op_timeout_s, 2.0))

    def open_job(text: str | None) -> tuple[WorkerClient | ParallelClient, str]:
        """Join a fresh job like the group's (rank 0: a new one; others: rank 0's)."""
        job = decode_job_spec(text) if text else dataclasses.replace(
            spec, job_id=new_job_id(tenant), token=secrets.randbits(64))
        return (open_worker(pg.switch, job, rank, probe_config, threads=threads,
                            batching=env.batching()), encode_job_spec(job))

    back = SwitchBack(probe=lambda: open_job(None), join=lambda text: open_job(text)[0],
                      install=pg._install_client, submit=pg._submit, close=lambda c: c.close())
    return Failover(store, rank, size, timeout, keep_bytes=keep,
                    close_switch=lambda: pg.client.close(), recycle=pg._staging.give,
                    prefix=f"switchml/{_incarnation}/failover", back=back, probe_s=probe_s)


_next_quorum = threading.local()


def _group_quorum(size: int) -> dict[str, Any]:
    """The quorum of the group being created (on rank 0, whose choice rules), as
    ``job_spec_for_ranks`` takes it: the one :func:`new_quorum_group` asked for, else
    ``SWITCHML_QUORUM`` for the default group."""
    asked = getattr(_next_quorum, "asked", None)
    if asked is None:
        asked = {"quorum": env.quorum() if not dist.is_initialized() else None}
    k = asked["quorum"]
    if k is not None and not 1 <= k <= size:
        raise ValueError(f"a quorum must be in 1..{size} (the group's ranks), got {k}")
    return asked


def new_quorum_group(quorum: int, ranks: list[int] | None = None,
                     timeout: datetime.timedelta | None = None, *,
                     quorum_min: int | None = None,
                     deadline_s: float | None = None) -> dist.ProcessGroup:
    """A "switchml" group whose all-reduces complete with ``quorum`` of its ranks (backup
    workers, in the switch): every rank gets the same sum, of the first ``quorum`` ranks'
    tensors at each chunk, and AVG divides each element by the ranks its sum holds. A rank
    that falls behind gets the others' results without waiting. Collective, as
    ``dist.new_group``: every rank calls it with the same arguments. Use it for DDP with
    :func:`switchml.torch.hooks.quorum_hook`; plain all-reduces on other groups stay exact.
    ``deadline_s`` and ``quorum_min``: a round also completes ``deadline_s`` after its first
    contribution with at least ``quorum_min`` ranks (``quorum`` may then be every rank: all
    of them while they answer, the others' sum when one does not).

    Raises:
        ValueError: ``quorum`` outside 1..the group's size, or a deadline without a minimum.
    """
    _next_quorum.asked = {"quorum": quorum, "quorum_min": quorum_min,
                          "quorum_deadline_s": deadline_s}
    try:
        return dist.new_group(ranks, timeout=timeout, backend=BACKEND_NAME)
    finally:
        _next_quorum.asked = None


def register() -> None:
    """Register the "switchml" backend with torch.distributed (idempotent), for CPU and CUDA
    tensors (CUDA's are staged through pinned host memory).

    It asks nothing of CUDA: ``torch.cuda.is_available()`` initializes the driver, after which
    no forked child can use CUDA ("Cannot re-initialize CUDA in forked subprocess"), and this
    runs at ``import switchml.torch``. Naming "cuda" on a machine without it is torch's own
    default for a backend registered without devices."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
