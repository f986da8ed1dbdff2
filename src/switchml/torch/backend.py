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

import atexit
import dataclasses
import datetime
import logging
import os
import secrets
import subprocess
import threading
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d
from torch._C._distributed_c10d import ProcessGroupGloo

from switchml import env, service
from switchml.control import decode_job_spec, encode_job_spec, new_job_spec
from switchml.protocol.address import Address, as_addresses, format_address, parse_address
from switchml.protocol.config import JobSpec, WorkerConfig
from switchml.protocol.dtypes import BFLOAT16
from switchml.protocol.errors import SwitchMLError
from switchml.protocol.quantize import error_bound
from switchml.protocol.wire import elements_for_mtu
from switchml.torch import flight
from switchml.torch.failover import Failover, PendingOp, SwitchBack
from switchml.torch.flight import FlightRecorder
from switchml.transport.parallel import ParallelClient, choose_threads, open_worker
from switchml.transport.sockets import local_mtu
from switchml.transport.udp import AllreduceHandle, WorkerClient

__all__ = ["StagedTensor", "StagingPool", "SwitchMLProcessGroup", "SwitchMLWork",
           "complete_elsewhere", "embedded_switch_pid", "failable_future", "job_spec_for_ranks",
           "local_mtu", "new_quorum_group", "register", "release_embedded_switch",
           "resolve_switch_over_group", "stats", "stop_embedded_switch", "wire_bits"]

log = logging.getLogger(__name__)
BACKEND_NAME = "switchml"
_STORE_SWITCH_KEY = "switchml/switch"
_STORE_JOB_KEY = "switchml/job"
_RedOp = dist.ReduceOp.RedOpType
_SWITCH_OPS = {_RedOp.SUM, _RedOp.AVG}
_HALF = {torch.float16, torch.bfloat16}
_SUPPORTED = {torch.float32, torch.float64, torch.int32, torch.int64} | _HALF
_SWITCH_GRACE_S = 2.0
_SWITCH_START_S = 30.0  # the embedded switch must say where it listens within this



class SwitchMLWork(dist.Work):
    """A pending collective: ``wait()`` raises if the operation failed (unlike a bare future)
    and honours its timeout."""

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._future = future
        self._event = threading.Event()
        future.add_done_callback(lambda _f: self._event.set())

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0.0
        if seconds > 0 and not self._event.wait(seconds):
            raise RuntimeError(f"switchml collective not done after {seconds:g} s")
        self._future.wait()  # raises the operation's error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True


def _error_of(f: torch.futures.Future[Any]) -> BaseException | None:
    try:
        f.value()
    except Exception as exc:  # noqa: BLE001 - recorded
        return exc
    return None


def _all_of(works: list[dist.Work], value: Any) -> dist.Work:
    """One work for several: done when every one is, failing if any fails, its future's
    value ``value``."""
    def result(f: torch.futures.Future[Any]) -> Any:
        for w in f.value():
            w.value()  # raises the first failure
        return value

    return SwitchMLWork(torch.futures.collect_all([w.get_future() for w in works]).then(result))


def _gather_opts(opts: Any) -> Any:
    """AllgatherOptions for one tensor of a coalesced call (the same timeout)."""
    one = _c10d.AllgatherOptions()
    if opts is not None:
        one.timeout = opts.timeout
    return one


def _scatter_opts(opts: Any) -> Any:
    """ReduceScatterOptions for one tensor of a coalesced call (same op and timeout)."""
    one = _c10d.ReduceScatterOptions()
    if opts is not None:
        one.reduceOp = opts.reduceOp
        one.timeout = opts.timeout
    return one


def failable_future() -> tuple[torch.futures.Future[Any], torch.futures.Future[Any]]:
    """Return (completer, future). Complete ``completer`` with a value or an exception
    *object*; ``future`` then holds the value or raises. (``Future.set_exception`` is not seen
    as an error by C++ consumers such as DDP's reducer, which then crash reading the value; an
    exception raised in a ``then`` callback is.)"""
    completer: torch.futures.Future[Any] = torch.futures.Future()

    def unwrap(f: torch.futures.Future[Any]) -> Any:
        value = f.value()
        if isinstance(value, BaseException):
            raise value
        return value

    return completer, completer.then(unwrap)


def complete_elsewhere(completer: torch.futures.Future[Any], value: Any) -> None:
    """Complete ``completer`` on a short-lived thread of its own, not on the caller's.

    Completions come from a worker's single I/O thread, and torch runs every chained ``then``
    callback on the thread that completes the future. A callback that waits for another
    switchml collective (PowerSGD-style hooks do) would block the only thread that can finish
    it: a deadlock no timeout breaks. A thread per completed collective costs tens of
    microseconds.
    """
    threading.Thread(target=completer.set_result, args=(value,), name="switchml-complete",
                     daemon=True).start()


class StagingPool:
    """Host buffers for staged tensors, kept for the next operation of the same type and size.

    A fresh allocation of tens of megabytes comes from the kernel as untouched pages, and
    faulting them in costs more than the copy that fills them (64 MiB: about 28 against 3 ms
    here); a training job all-reduces the same sizes every step. Keeps at most ``keep`` free
    buffers (the oldest go first). Thread-safe: taken in the caller's thread, given back on
    the I/O thread."""

    def __init__(self, keep: int = 4) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
        """A flat CPU tensor of ``numel`` elements of ``dtype`` (its contents undefined);
        ``pinned``: page-locked, for copies from and to a CUDA device."""
        with self._lock:
            for i, t in enumerate(self._free):
                if t.numel() == numel and t.dtype is dtype and t.is_pinned() == pinned:
                    return self._free.pop(i)
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def give(self, t: torch.Tensor) -> None:
        with self._lock:
            self._free.append(t)
            del self._free[:max(0, len(self._free) - self.keep)]


class StagedTensor:
    """How one tensor travels through the switch: the numpy array sent, and the write-back.

    ``array`` is a flat view of the tensor itself where it can be (a contiguous CPU tensor of a
    type the switch sums: float16 and bfloat16 too, which the kernels read and write
    themselves), else of a contiguous CPU copy (``staging``, from ``pool`` if given, back to it
    after ``finish``): with ``dtype``, the tensor travels as ``dtype``; int64 travels as three
    int32 limbs. Used by the backend for every all-reduce and by the DDP
    hooks (``dtype=torch.float32``) for every bucket.

    Args:
        tensor: the tensor to reduce in place.
        dtype: send as this type (a copy unless the tensor already is); None: as the backend does.
        pool: where a staging copy's buffer comes from and goes back to; None: allocated.
        copy: always send a staging copy (the tensor keeps its input until ``finish``).
    """

    __slots__ = ("tensor", "array", "flat", "staging", "kind", "pool")

    def __init__(self, tensor: torch.Tensor, *, dtype: torch.dtype | None = None,
                 pool: StagingPool | None = None, copy: bool = False) -> None:
        self.tensor = tensor
        self.pool = pool
        t = tensor.detach()
        self.staging: torch.Tensor | None = None
        if t.dtype is torch.int64 and dtype is None:
            self.kind = "limbs"
            self.array = _to_limbs(t.reshape(-1).cpu().numpy())
            self.flat = torch.from_numpy(self.array)
            return
        self.kind = "plain"
        want = dtype or t.dtype
        if copy or t.dtype is not want or t.device.type != "cpu" or not t.is_contiguous():
            if pool is not None:
                self.staging = pool.take(t.numel(), want, pinned=t.device.type == "cuda")
                self.staging.view(t.shape).copy_(t)  # (no contiguous temporary of ``t``)
            else:
                self.staging = t.to(device="cpu", dtype=want).contiguous()
        src = self.staging if self.staging is not None else t
        self.flat = src.reshape(-1)  # what ``array`` views, as a tensor
        self.array = _as_numpy(self.flat)

    def finish(self, size: int, average: bool, counts: np.ndarray | None = None,
               block: int = 0, *, keep: bool = False) -> torch.Tensor | None:
        """Write the sum back into the user's tensor, in place (runs on the I/O thread);
        with ``average``, divide it by ``size``, or in a quorum group by ``counts``: how many
        ranks each block of ``block`` elements holds (a k-of-n round always holds k: then
        one scalar division, as without a quorum). ``keep``: return the tensor's new values,
        flat on the CPU, in a buffer the caller then owns (the staging buffer where it holds
        them, else a copy); None otherwise."""
        t = self.tensor.detach()
        pool = self.pool  # (a kept copy's buffer comes from it: no fresh pages each time)
        divisor: Any = size
        if counts is not None and counts.size:
            if (counts == counts[0]).all():
                divisor, counts = int(counts[0]), None
            else:  # per element (rare: a round that completed with another count)
                divisor = torch.from_numpy(np.repeat(counts, block)[:t.numel()])
        else:
            counts = None
        if self.kind == "limbs":
            t.copy_(torch.from_numpy(_from_limbs(self.array)).reshape(t.shape))
        elif self.staging is not None:
            if average and self.staging.is_floating_point():
                # in the wider type: the result is rounded once more, not twice (sum, then
                # quotient) in a half type
                self.staging.reshape(-1).div_(divisor)
                average = False
            t.copy_(self.staging.reshape(t.shape))
            if keep and not average:  # the staging buffer holds the new values
                kept, self.staging, self.pool = self.staging.reshape(-1), None, None
                return kept
            self.release()
        if average:
            if counts is not None:
                divisor = divisor.reshape(t.shape)
            if t.is_floating_point():
                t.div_(divisor)
            else:
                t.copy_(torch.div(t, divisor, rounding_mode="trunc"))
        if not keep:
            return None
        flat = t.reshape(-1)
        kept = (pool.take(flat.numel(), flat.dtype) if pool is not None
                else torch.empty(flat.numel(), dtype=flat.dtype))
        kept.copy_(flat)
        return kept

    def release(self) -> None:
        """Give the staging buffer back to the pool (after ``finish``, or when the operation
        failed); idempotent."""
        if self.pool is not None and self.staging is not None:
            self.pool.give(self.staging)
            self.pool = None


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of its type (bfloat16: ml_dtypes', through its
    bits, since torch's ``numpy()`` refuses it)."""
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def wire_bits(dtype: torch.dtype, world: int, half_bits: int | None = None) -> int:
    """Bits per element on the wire for an all-reduce of ``dtype`` over ``world`` ranks.
    float16 and bfloat16: ``half_bits`` if given, else 16 where the 16-bit sum's error bound
    (``quantize.error_bound``) is at most half an ulp of the type at a block's scale
    ``2**emax`` (``eps / 2`` of it; the block's largest element lies in ``[2**(emax-1),
    2**emax)``): float16 up to 4 ranks, bfloat16 up to 15; 32 beyond. The bound is absolute:
    elements far below their block's largest keep fewer bits than the type has (those under
    about ``2**-(16 - bit_length(n))`` of it become 0), as in every fixed-point block, and a
    plain all-reduce has no error feedback (the 16-bit DDP hook does). Everything else: 32."""
    if dtype not in _HALF:
        return 32
    if half_bits is not None:
        return half_bits
    return 16 if error_bound(0, world, bits=16) <= torch.finfo(dtype).eps / 2 else 32


def _to_limbs(x: np.ndarray) -> np.ndarray:
    """Split int64 into three int32 limbs (low 22 bits, next 22, signed top 20)."""
    out = np.empty((3, x.size), dtype=np.int32)
    out[0] = x & (2**22 - 1)
    out[1] = (x >> 22) & (2**22 - 1)
    out[2] = x >> 44  # arithmetic shift: signed, |.| < 2**19
    return out.reshape(-1)


def _from_limbs(limbs: np.ndarray) -> np.ndarray:
    parts = limbs.reshape(3, -1).astype(np.int64)
    with np.errstate(over="ignore"):
        return parts[0] + (parts[1] << 22) + (parts[2] << 44)  # wraps modulo 2**64 like int64


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

    def _allreduce_switch(self, tensors: list[torch.Tensor], *, average: bool) -> dist.Work:
        """Queue one switch operation per tensor; the Work completes when all are done. Each
        tensor is written once every one has its sum (a failed operation leaves them as they
        were, when the failover keeps its inputs)."""
        completer, future = failable_future()
        size = self.size()
        with self._stats_lock:
            self.switch_ops["allreduce"] += 1
        rec = self.flight.start("all_reduce" + (" avg" if average else ""), "switch", tensors)
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
        pending = PendingOp(seq, list(tensors), average, done)
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
        size, average, done = self.size(), pending.average, pending.done
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
            """Every part is done (``error``: the first failure): write the tensors, or fail."""
            kept: list[torch.Tensor] = []
            if error is None:
                try:
                    for plan, handle in zip(plans, handles, strict=True):
                        assert handle is not None  # (every part succeeded)
                        counts = handle.contributors  # per block, in a quorum group
                        if counts is not None:
                            self._note_contributors(counts)
                        final = plan.finish(size, average, counts, handle.block,
                                            keep=fo is not None)
                        if final is not None:
                            kept.append(final)
                except Exception as exc:  # surfaced through the future
                    error = exc
            if error is None:
                if fo is not None:
                    fo.completed(pending.seq, kept)
                done(None)
                return
            for plan in plans:
                plan.release()
            if fo is not None and fo.failed(pending, error):
                return  # the failover completes it, over gloo
            done(error)

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
                handle = self.client.allreduce_async(plan.array, plan.array,
                                                     bits=self.wire_bits(plan.tensor.dtype))
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
                lambda f: self.flight.finish(rec, _error_of(f)))
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
        return self._delegate("allgather_into_tensor_coalesced", lambda: _all_of(
            [self._gloo._allgather_base(o, i, _gather_opts(opts)) for o, i in
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
        return self._delegate("reduce_scatter_tensor_coalesced", lambda: _all_of(
            [self._gloo._reduce_scatter_base(o, i, _scatter_opts(opts)) for o, i in
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
            _EMBEDDED.release()


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

class _Embedded:
    """The software switch this process started for its groups, shared and reference-counted.

    Each group whose rank 0 is this process acquires it; the last release stops it after a
    grace period (peers may still be collecting their last results); a new group within the
    grace period cancels the stop. It has a random secret, so that nobody else on the machine
    can create jobs on it; ranks get the secret through the group's store.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[str] | None = None
        self.address: tuple[str, int] | None = None
        self.secret: bytes = b""
        self.users = 0
        self.timer: threading.Timer | None = None

    def acquire(self) -> tuple[tuple[str, int], bytes]:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            self.users += 1
            assert self.address is not None
            return self.address, self.secret

    def release(self) -> None:
        with self.lock:
            self.users = max(0, self.users - 1)
            if self.users == 0 and self.proc is not None and self.timer is None:
                self.timer = threading.Timer(_SWITCH_GRACE_S, self._stop_if_unused)
                self.timer.daemon = True
                self.timer.start()

    def _start(self) -> None:
        secret = secrets.token_hex(32)
        # ``switchml switch`` in a child process; it announces its address (control.announce)
        # and its log (warnings) goes on to this process's standard error.
        child = service.start_switch_process(
            ["--log-level", "warning", "switch", "--port", "0", "--metrics-port", "0",
             "--stop-on-stdin-eof"],
            environ={**os.environ, "SWITCHML_SECRET": secret}, start_timeout_s=_SWITCH_START_S)
        self.proc, self.secret = child.proc, secret.encode()
        self.address = child.address
        atexit.register(self.stop)
        log.info("started an embedded switch at %s:%d (pid %d)", *self.address, child.proc.pid)

    def _stop_if_unused(self) -> None:
        with self.lock:
            if self.users:  # acquired again while the timer was firing
                return
            # Decide and detach in one critical section: an acquire() after this starts a
            # new switch instead of getting the one being stopped.
            proc, self.proc = self.proc, None
            self.timer = None
        self._terminate(proc)

    def stop(self) -> None:
        """Stop the switch (idempotent); it also exits by itself when this process does."""
        with self.lock:
            proc, self.proc = self.proc, None
            self.timer = None
            self.users = 0
        self._terminate(proc)

    @staticmethod
    def _terminate(proc: subprocess.Popen[str] | None) -> None:
        service.stop_switch_process(proc)  # it exits on EOF, once quiet (at most 5 s)


_EMBEDDED = _Embedded()
_SIGNAL_INSTALLED = False
_incarnation = 0  # how many times this process created a default group: keys stay fresh


def stop_embedded_switch() -> None:
    """Stop the switch this process started, if any (idempotent)."""
    _EMBEDDED.stop()


def embedded_switch_pid() -> int | None:
    """The process id of the switch this process started, if it is running."""
    proc = _EMBEDDED.proc
    return proc.pid if proc is not None and proc.poll() is None else None


def _resolve_switch(store: dist.Store, rank: int
                    ) -> tuple[tuple[Address, ...], bytes | None, bool]:
    """Return (switch address or shards, secret, whether this call acquired the embedded
    switch).

    SWITCHML_SWITCH wins; otherwise rank 0 acquires this process's embedded switch and
    publishes its address and secret in the group's store; other ranks always read them there.
    """
    configured = env.switch_addresses()
    if configured is not None:
        return as_addresses(configured), env.secret(), False
    key = f"switchml/{_incarnation}"
    if rank == 0:
        address, secret = _EMBEDDED.acquire()
        store.set(f"{key}/switch", format_address(address))
        store.set(f"{key}/secret", secret)
        return (address,), secret, True
    address = parse_address(store.get(f"{key}/switch").decode(), what="the group's switch")
    return (address,), store.get(f"{key}/secret"), False


def release_embedded_switch() -> None:
    """Release one use of the switch this process started (from :func:`resolve_switch_over_group`
    returning True); the last release stops it after a grace period."""
    _EMBEDDED.release()


def resolve_switch_over_group(pg: dist.ProcessGroup, rank: int
                              ) -> tuple[tuple[Address, ...], bytes | None, bool]:
    """Find the switch for a job over any process group (the DDP hooks' groups).

    ``SWITCHML_SWITCH`` (and ``SWITCHML_SECRET``) win; otherwise rank 0 of ``pg`` acquires this
    process's embedded switch and shares its address and secret with ``broadcast_object_list``
    over ``pg`` (the backend's own groups use their store instead). A collective: every rank of
    ``pg`` calls it.

    Returns:
        (the switch's address or its shards' as a tuple (``as_addresses``), secret, whether
        this call acquired the embedded switch: then call :func:`release_embedded_switch` once
        done with it).
    """
    configured = env.switch_addresses()
    if configured is not None:
        return as_addresses(configured), env.secret(), False
    box: list[Any] = [None]
    if rank == 0:
        box[0] = _EMBEDDED.acquire()
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    address, secret = box[0]
    return (tuple(address),), secret, rank == 0  # type: ignore[return-value]


def job_spec_for_ranks(size: int, mtus: Iterable[int], *, window: int | None = None,
                       elements_per_packet: int | None = None,
                       quorum: int | None = None, quorum_min: int | None = None,
                       quorum_deadline_s: float | None = None) -> JobSpec:
    """A new switch job for ``size`` ranks whose MTUs towards the switch are ``mtus``.

    Chunks fit the smallest MTU of any rank (no IP fragmentation on any path), unless
    ``elements_per_packet`` or ``SWITCHML_ELEMENTS_PER_PACKET`` says otherwise; the window is
    ``window``, else ``SWITCHML_WINDOW``, else :func:`switchml.control.new_job_spec`'s default for
    the chunk size. Called by the group's rank 0, which shares the result with the others.
    ``quorum``, ``quorum_min``, ``quorum_deadline_s``: ``JobSpec``'s (with a quorum, chunks
    leave room for the results' bitmap).
    """
    trailer = (size + 7) // 8 if quorum else 0
    k = (elements_per_packet or env.elements_per_packet()
         or elements_for_mtu(min(mtus), trailer=trailer))
    spec = new_job_spec(size, window=window if window is not None else env.window(),
                        elements_per_packet=k, quorum=quorum)
    if quorum_deadline_s is not None:
        spec = dataclasses.replace(spec, quorum_min=quorum_min,
                                   quorum_deadline_s=quorum_deadline_s)
    return spec


def _local_ranks(size: int) -> int:
    """The ranks on this machine (torchrun's ``LOCAL_WORLD_SIZE``; else all of them, the
    cautious guess): the cores are shared among them."""
    return max(1, env.local_world_size() or size)


def _create(store: dist.Store, rank: int, size: int,
            timeout: datetime.timedelta) -> SwitchMLProcessGroup:
    """The creator torch calls for every "switchml" group (default group and new_group)."""
    global _incarnation
    if not dist.is_initialized():
        _incarnation += 1  # a (re)created world: never read keys of an earlier one
    switch, secret, acquired = _resolve_switch(store, rank)
    gloo: Any = None
    try:
        key = f"switchml/{_incarnation}/job"
        # Every rank publishes its MTU towards the switch; rank 0 sizes the job's chunks.
        store.set(f"switchml/{_incarnation}/mtu/{rank}", str(local_mtu(switch)))
        # ... and the I/O threads it would use; the group uses the fewest any rank asked for
        # (every rank must split its job into the same parts).
        store.set(f"switchml/{_incarnation}/threads/{rank}", str(choose_threads(
            switch, requested=env.threads(), local_ranks=_local_ranks(size))))
        if rank == 0:  # rank 0's setting rules the group (checked here, raising if wrong)
            store.set(f"{key}/half_bits", str(env.half_bits() or "auto"))
            store.set(f"{key}/failover", env.failover())
            store.set(f"{key}/failover_probe_s", str(env.failover_probe_s()))
            spec = job_spec_for_ranks(size, (
                int(store.get(f"switchml/{_incarnation}/mtu/{r}").decode()) for r in range(size)),
                **_group_quorum(size))
            store.set(key, encode_job_spec(spec))
        else:
            spec = decode_job_spec(store.get(key).decode())
        group_half = store.get(f"{key}/half_bits").decode()
        if rank and env.half_bits_text() not in ("", group_half):
            log.warning("switchml rank %d: SWITCHML_HALF_BITS is %r here, but rank 0's (%s) "
                        "rules the group", rank, env.half_bits_text(), group_half)
        half_bits = None if group_half == "auto" else int(group_half)
        gloo = ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        seconds = max(timeout.total_seconds(), 2.0)
        config = WorkerConfig(op_timeout_s=seconds, max_rto_s=min(1.0, seconds / 2),
                              join_timeout_s=seconds, secret=secret)
        threads = min(int(store.get(f"switchml/{_incarnation}/threads/{r}").decode())
                      for r in range(size))
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
            _EMBEDDED.release()
        raise
    pg = SwitchMLProcessGroup(rank=rank, size=size, client=client, gloo=gloo, switch=switch,
                              half_bits=half_bits, quorum=spec.quorum)
    pg.owns_switch = acquired
    if store.get(f"{key}/failover").decode() == "gloo":
        keep = env.failover_keep_bytes()
        if keep is None:  # on one thread without a quorum, no rank is two all-reduces ahead
            keep = 0 if spec.quorum is None and threads == 1 else 256 * 2**20
        probe_config = dataclasses.replace(config, join_timeout_s=min(seconds, 2.0))

        def open_job(text: str | None) -> tuple[WorkerClient | ParallelClient, str]:
            """Join a fresh job like the group's (rank 0: a new one; others: rank 0's)."""
            job = decode_job_spec(text) if text else dataclasses.replace(
                spec, job_id=secrets.randbits(32), token=secrets.randbits(64))
            return (open_worker(switch, job, rank, probe_config, threads=threads,
                                batching=env.batching()), encode_job_spec(job))

        back = SwitchBack(probe=lambda: open_job(None), join=lambda text: open_job(text)[0],
                          install=pg._install_client, submit=pg._submit,
                          close=lambda c: c.close())
        pg.failover = Failover(store, rank, size, timeout, keep_bytes=keep,
                               close_switch=lambda: pg.client.close(),
                               recycle=pg._staging.give,
                               prefix=f"switchml/{_incarnation}/failover", back=back,
                               probe_s=float(store.get(f"{key}/failover_probe_s").decode()))
    flight.watch(pg, env.stall_log_s() or 30.0)
    if (name := env.flight_signal()) is not None and not _SIGNAL_INSTALLED:
        flight.install_signal(name)
        globals()["_SIGNAL_INSTALLED"] = True
    # Device-level lookups (``group._get_backend(device)``, used by some torch helpers) find
    # gloo's backend; the collectives themselves come through the methods above and are counted.
    cpu = torch.device("cpu")
    pg._register_backend(cpu, dist.ProcessGroup.BackendType.GLOO, gloo)
    return pg


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
    """Register the "switchml" backend with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=devices)
