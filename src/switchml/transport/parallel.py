"""One rank's all-reduces over several I/O threads: a job split into parts.

A :class:`~switchml.transport.udp.WorkerClient` drives its job from one I/O thread, and one
core carries about 4 Gbit/s of elements. :class:`ParallelClient` runs ``T`` of them, one per
part of the job (``protocol/parts.py``: each part a job of its own on the switch, with its share
of the window, its own socket and thread), and cuts every operation on block boundaries over
them, so the result is bit-identical to one thread's. The compiled loops release the GIL, so
the threads run on as many cores.

:func:`open_worker` is what the torch backend, its DDP hooks and the benchmarks call: it picks
``T`` (:func:`choose_threads`) and returns a plain ``WorkerClient`` for one thread.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import socket
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from switchml.costs import load as load_costs
from switchml.protocol.address import Address, as_addresses
from switchml.protocol.config import JobSpec, WorkerConfig
from switchml.protocol.errors import ConfigError, LocalProtocolError
from switchml.protocol.parts import MAX_THREADS, check_threads, part_specs, split
from switchml.protocol.session import prepare_submission
from switchml.protocol.wire import elements_for_mtu
from switchml.protocol.worker_ahead import Position
from switchml.transport.handles import AllreduceHandle
from switchml.transport.udp import WorkerClient

__all__ = ["ParallelClient", "choose_threads", "link_speed_bps",
           "open_worker"]

log = logging.getLogger(__name__)

BUSY_SHARE = 0.8
"""The share of a core the automatic choice plans a worker thread to use."""
_SIOCGIFADDR = 0x8915


def _interface_of(address: Address) -> str | None:
    """The name of the local interface whose address the route towards ``address`` uses."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(address[0]), int(address[1])))
            local = s.getsockname()[0]
            for _index, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                         struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
                if socket.inet_ntoa(packed[20:24]) == local:
                    return name
    except OSError:
        return None
    return None


def link_speed_bps(address: Address, sys_class_net: Path = Path("/sys/class/net")
                   ) -> float | None:
    """The line rate of the physical interface towards ``address`` in bits/s, or None: for
    loopback and virtual interfaces (veth, bridges, tunnels: no ``device``, and a nominal
    speed), and where the kernel does not say."""
    name = _interface_of(address)
    if name is None:
        return None
    path = sys_class_net / name
    try:
        if not (path / "device").exists():
            return None
        mbit = int((path / "speed").read_text().strip())
    except (OSError, ValueError):
        return None
    return mbit * 1e6 if mbit > 0 else None


def choose_threads(switch: Address | Sequence[Address], config: WorkerConfig | None = None,
                   *, requested: int | None = None, local_ranks: int = 1,
                   ns_per_element: float | None = None,
                   rate_bps: float | None = None, cores: int | None = None) -> int:
    """How many I/O threads a rank drives its job with.

    ``requested`` (``SWITCHML_THREADS``, a backend option), else ``config.threads``, else
    chosen: enough threads that each is busy at most ``BUSY_SHARE`` of a core when the link
    towards the switch (:func:`link_speed_bps`) runs at line rate, at ``ns_per_element`` per
    element sent and received (default: this machine's calibration, ``costs.load``, with
    1500-byte datagrams), and no more than this machine's ``cores`` (default: those this
    process may run on) shared over its ``local_ranks``. Loopback, virtual interfaces,
    unknown rates and a config with a ``job_key`` get one thread. ``rate_bps`` gives the
    link's rate instead of asking the interface.

    Raises:
        ConfigError: a requested count outside 1..MAX_THREADS.
    """
    for chosen in (requested, config.threads if config is not None else None):
        if chosen is not None:
            check_threads(chosen)
            return chosen
    if config is not None and (config.job_key is not None or config.tenant_key is not None):
        return 1  # a job (or tenant) key proves the job's id, and threads make a job each
    if rate_bps is None:
        rates = [r for r in (link_speed_bps(a) for a in as_addresses(switch)) if r]
        rate_bps = max(rates) if rates else None
    if not rate_bps:
        return 1
    if ns_per_element is None:
        ns_per_element = load_costs().worker_s(1 / elements_for_mtu(1500), 1) * 1e9
    need = math.ceil(rate_bps / 32 * ns_per_element * 1e-9 / BUSY_SHARE)
    if cores is None:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
    return max(1, min(need, cores // max(1, local_ranks), MAX_THREADS))


def open_worker(switch: Address | Sequence[Address], spec: JobSpec, rank: int,
                config: WorkerConfig | None = None, *, threads: int | None = None,
                local_ranks: int = 1, **kwargs: Any) -> WorkerClient | ParallelClient:
    """A rank's client with :func:`choose_threads` threads: a ``WorkerClient`` for one, a
    :class:`ParallelClient` for more. ``kwargs`` go to every ``WorkerClient``."""
    count = choose_threads(switch, config, requested=threads, local_ranks=local_ranks)
    if count == 1:
        return WorkerClient(switch, spec, rank, config, **kwargs)
    return ParallelClient(switch, spec, rank, config, threads=count, **kwargs)


class ParallelClient:
    """One rank of a job, over ``threads`` I/O threads: the ``WorkerClient`` API, with every
    operation cut over the job's parts (``protocol/parts.py``).

    Every rank of a job must use the same ``threads`` (the parts are jobs on the switch; a
    rank with fewer never joins the others' last parts, and they time out waiting for it).

    Example::

        spec = new_job_spec(num_workers=2, switch=switch)
        with ParallelClient(switch, spec, rank=0, threads=2) as w:
            total = w.allreduce(np.ones(10_000_000, np.float32))

    Raises (constructor):
        ConfigError: ``threads`` outside 1..MAX_THREADS.
        OperationFailed: a part's JOIN failed (the parts joined so far leave again).
    """

    def __init__(self, switch: Address | Sequence[Address], spec: JobSpec, rank: int,
                 config: WorkerConfig | None = None, *, threads: int, **kwargs: Any) -> None:
        self.spec, self.rank, self.threads = spec, rank, threads
        if threads > 1 and config is not None and (config.job_key is not None
                                                    or config.tenant_key is not None):
            raise ConfigError(f"threads={threads} makes a job per thread on the switch, and a "
                              "job (or tenant) key proves one job's id: give the switch's "
                              "secret instead, or use one thread")
        self.part_specs = part_specs(spec, threads)
        self.parts: list[WorkerClient] = []
        self._lock = threading.Lock()  # one operation's pieces queue in order on every part
        self._error: str | None = None
        joins: list[Any] = [None] * threads

        def join(t: int) -> None:
            try:
                joins[t] = WorkerClient(switch, self.part_specs[t], rank, config, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - reported below, in the caller
                joins[t] = exc

        # The parts join at once (each waits a round trip or two for its challenge).
        starters = [threading.Thread(target=join, args=(t,), daemon=True)
                    for t in range(threads)]
        for s in starters:
            s.start()
        for s in starters:
            s.join()
        self.parts = [c for c in joins if isinstance(c, WorkerClient)]
        failed = [c for c in joins if not isinstance(c, WorkerClient)]
        if failed:
            self.close()
            raise failed[0]

    def allreduce(self, data: np.ndarray, out: np.ndarray | None = None, *, bits: int = 32,
                  residual: np.ndarray | None = None) -> np.ndarray:
        """Sum ``data`` over all ranks (``WorkerClient.allreduce``)."""
        return self.allreduce_async(data, out, bits=bits, residual=residual).wait()

    def allreduce_async(self, data: np.ndarray, out: np.ndarray | None = None, *,
                        bits: int = 32, residual: np.ndarray | None = None) -> AllreduceHandle:
        """Queue an all-reduce on the parts it spans; the handle completes when they all have
        (with the first part's error if one failed).

        Raises:
            LocalProtocolError: bad arrays, or the client is closed or failed.
        """
        sub = prepare_submission(data, out, bits=bits, residual=residual,
                                 handle_type=AllreduceHandle)
        src, dst = sub.data.reshape(-1), sub.out.reshape(-1)
        res = sub.residual.reshape(-1) if sub.residual is not None else None
        if res is not None and res.size != src.size:
            raise LocalProtocolError(f"residual must have {src.size} elements, got {res.size}")
        pieces = split(src.size, self.spec, self.threads, bits)
        handle = sub.handle
        left = [len(pieces)]
        errors: list[BaseException] = []
        count = threading.Lock()
        contributors: list[np.ndarray | None] = [None] * len(pieces)

        def piece_done(h: AllreduceHandle, t: int) -> None:
            with count:
                if h.exception() is not None:
                    errors.append(h.exception())
                contributors[t] = h.contributors
                handle.block = h.block or handle.block
                left[0] -= 1
                last = left[0] == 0
            if last:
                counts = [c for c in contributors if c is not None]
                if not errors and counts:
                    # Pieces start on block boundaries: the parts' blocks, in order.
                    handle.contributors = np.concatenate(counts)
                handle.resolve(errors[0] if errors else None)

        refused = False
        with self._lock:
            if self._error is not None:
                raise LocalProtocolError(f"client failed earlier: {self._error}")
            for t, (a, b) in enumerate(pieces):
                try:
                    h = self.parts[t].allreduce_async(
                        src[a:b], dst[a:b], bits=bits,
                        residual=None if res is None else res[a:b])
                except LocalProtocolError as exc:
                    # Parts before this one took their pieces: the ranks are out of step now.
                    self._error = str(exc)
                    if t == 0:
                        raise
                    with count:  # (pieces taken may be completing on their threads)
                        errors.append(exc)
                        left[0] -= len(pieces) - t
                        refused = left[0] == 0
                    break
                h.add_done_callback(lambda h, t=t: piece_done(h, t))
        if refused:  # (outside the lock: the handle's callbacks may issue operations)
            handle.resolve(errors[0])
        return handle

    def position(self) -> Position:
        """Where this rank stands, every part (``WorkerClient.position``)."""
        with self._lock:
            return Position.of_parts([c.position() for c in self.parts])

    def ops_behind(self) -> int:
        """The most operations any part is behind (``WorkerClient.ops_behind``)."""
        return max(c.ops_behind() for c in self.parts)

    def catch_up(self) -> None:
        """Every part falls back to a live rank's position (``WorkerClient.catch_up``), or
        none does: what a part would refuse for (a job without a quorum, a part busy,
        failed or not resumed) is checked on every part first. Should a part refuse all the
        same, the parts that had fallen back resume where they stood (without the results
        they had kept: a part behind then fails its next all-reduce after the timeout), and
        the refusal is raised."""
        with self._lock:
            if not self.parts[0].spec.quorum:
                raise LocalProtocolError("catch_up is for a quorum job's rank (a job without "
                                         "one waits for every rank: nobody is ahead)")
            stood = [c.position() for c in self.parts]  # (raises, changing nothing)
            done: list[tuple[WorkerClient, Position]] = []
            try:
                for c, where in zip(self.parts, stood):
                    c.catch_up()
                    done.append((c, where))
            except BaseException:
                for c, where in done:
                    c.resume(where)
                raise

    def resume(self, position: Position) -> None:
        """Start every part where a live rank's stand (``WorkerClient.resume``; the client
        joined with ``late_join=True``). Raises LocalProtocolError for a position of another
        thread count."""
        if len(position.seqs) != len(self.parts):
            raise LocalProtocolError(f"a position of {len(position.seqs)} parts; this rank "
                                     f"runs {len(self.parts)} (every rank needs the same "
                                     "threads)")
        with self._lock:
            for t, c in enumerate(self.parts):
                c.resume(position.part(t))

    def close(self) -> None:
        """Leave every part's job and stop the threads (pending operations fail)."""
        closers = [threading.Thread(target=c.close, daemon=True) for c in self.parts]
        for c in closers:
            c.start()
        for c in closers:
            c.join()

    def progress(self) -> str | None:
        """What each busy part waits for, or None when all are idle."""
        said = [f"thread {t}: {p}" for t, c in enumerate(self.parts)
                if (p := c.progress()) is not None]
        return "; ".join(said) if said else None

    @property
    def counters(self) -> dict[str, int]:
        """Every part's counters, summed, with ``threads``."""
        total: dict[str, int] = {}
        for c in self.parts:
            for key, value in c.counters.items():
                total[key] = total.get(key, 0) + value
        total["threads"] = self.threads
        return total

    @property
    def switches(self) -> list[Address]:
        return self.parts[0].switches if self.parts else []

    def __enter__(self) -> ParallelClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

