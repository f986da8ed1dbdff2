"""UDP transports: the software switch server and the worker client (threads around the core).

Both pumps follow one rule: feed each received datagram to the endpoint with the monotonic clock,
send everything it returns at once, fire its timer when due. The switch loop is a blocking
``recvmsg_into`` on a preallocated buffer (no copy into Python bytes); the worker's loop is
non-blocking reads with ``select`` only when nothing is pending. Where the kernel has them, both
batch their system calls (``transport/batching.py``): UDP GRO hands them several datagrams of one
sender per read, and what a batch released goes out with UDP GSO, one call per run of
equal-sized datagrams to one destination.

Socket buffers: a switch receives up to ``n x W`` datagrams in a burst. The server asks for
``rcvbuf_bytes`` (SO_RCVBUFFORCE as root, else SO_RCVBUF, which the kernel caps at
``net.core.rmem_max``) and logs what it got. Datagrams the kernel drops for lack of buffer are
recovered by retransmission, at a cost in speed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import random
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from switchml.protocol.address import Address
from switchml.protocol.address import format_address as _fmt
from switchml.protocol.config import JobSpec, SwitchConfig, WorkerConfig
from switchml.protocol.errors import (
    LocalProtocolError,
    OperationFailed,
    SwitchMLError,
    TransportError,
)
from switchml.protocol.events import (
    JobCreated,
    JobRefused,
    JobRemoved,
    Joined,
    JoinFailed,
    Left,
    MemberJoined,
    OperationCompleted,
    OperationRestarted,
)
from switchml.protocol.events import OperationFailed as OperationFailedEvent
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.tree import TreeFailed, UpstreamJoined
from switchml.protocol.wire import elements_for_mtu
from switchml.protocol.worker import WorkerEndpoint, WorkerState, validate_arrays
from switchml.transport.batching import (
    RECV_BUFFER_BYTES,
    BatchSender,
    MultiReceiver,
    enable_gro,
    gso_supported,
    receive_segments,
    recvmmsg_supported,
    segments,
)

__all__ = ["DEFAULT_PORT", "AllreduceHandle", "SwitchServer", "WorkerClient",
           "elements_per_packet_for", "path_mtu"]

log = logging.getLogger(__name__)
DEFAULT_PORT = 48864  # 0xBEE0, the P4 switch's UDP port
SOCKET_BUFFER_BYTES = 32 * 2**20
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)


IP_MTU = getattr(socket, "IP_MTU", 14)  # linux/in.h


def path_mtu(address: Address | Sequence[Address]) -> int | None:
    """The MTU of the route towards ``address`` (``IP_MTU`` of a connected UDP socket), or
    None where the platform does not say. Loopback: 65536; an Ethernet path: 1500 (or 9000)."""
    if not isinstance(address[0], str):  # the shards of a sharded switch: the smallest
        mtus = [m for m in (path_mtu(a) for a in address) if m]  # type: ignore[arg-type]
        return min(mtus) if mtus else None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(address[0]), int(address[1])))
            return int(s.getsockopt(socket.IPPROTO_IP, IP_MTU))
    except OSError:
        return None


def elements_per_packet_for(switch: Address | Sequence[Address], mtu: int | None = None) -> int:
    """The chunk size (int32 elements) whose datagrams fit the path to ``switch`` without IP
    fragmentation: from ``mtu`` if given, else from the route's MTU (``path_mtu``), else
    1500 (Ethernet). Loopback gives the largest datagram UDP allows (16366 elements)."""
    if mtu is None:
        mtu = path_mtu(switch) or 1500
    return elements_for_mtu(mtu)


def _size_buffers(sock: socket.socket, nbytes: int) -> tuple[int, int]:
    """Grow both socket buffers as far as allowed; return what the kernel granted."""
    for force, plain in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, nbytes)
        except OSError:  # not root: capped at net.core.[rw]mem_max
            sock.setsockopt(socket.SOL_SOCKET, plain, nbytes)
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))


# A queued all-reduce: input, output, handle, bits, residual.
_Command = tuple[np.ndarray, np.ndarray, "AllreduceHandle", int, "np.ndarray | None"]


class SwitchServer:
    """A software switch on a UDP socket.

    Example::

        with SwitchServer(host="127.0.0.1", port=0) as server:   # serves in a thread
            print(server.address)

    ``serve_forever()`` runs in the caller's thread instead (the ``switchml switch`` command).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 config: SwitchConfig | None = None,
                 rcvbuf_bytes: int = SOCKET_BUFFER_BYTES, *, batching: bool = True,
                 dataplane: Any = None) -> None:
        # ``dataplane``: another endpoint with the switch's contract to serve instead, e.g. a
        # rack switch of a tree (``protocol.tree.RackAggregator``, ``switchml switch
        # --upstream``); its inner switch's config is the one reported.
        self.dataplane = dataplane if dataplane is not None else SwitchDataplane(config)
        self._switch_config = getattr(self.dataplane, "switch", self.dataplane).config
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise TransportError(f"can't listen on {host}:{port}: {exc.strerror}") from exc
        self.rcvbuf, self.sndbuf = _size_buffers(self.sock, rcvbuf_bytes)
        self.address: Address = self.sock.getsockname()
        # Batched system calls (see transport/batching.py): recvmmsg (or else GRO) in, GSO out,
        # where available.
        self._rx = MultiReceiver(self.sock) if batching and recvmmsg_supported() else None
        # GRO on the socket: MultiReceiver asks for it itself (its buffers may be GRO buffers).
        self.gro = self._rx.gro if self._rx is not None else batching and enable_gro(self.sock)
        self._sender = BatchSender(self.sock, gso=batching and gso_supported(self.sock))
        self.internal_errors = 0
        self.send_errors = 0
        self.truncated = 0
        self.recv_calls = 0
        self._refusals_window_start = 0.0
        self._refusals_logged = 0
        self._refusals_suppressed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards dataplane for stats() from other threads

    def serve_forever(self) -> None:
        """Serve until :meth:`stop`. Never raises for anything a peer sends."""
        log.info("switch listening on udp %s (rcvbuf %d B, sndbuf %d B, pool %d slots, lease "
                 "%g s, job creation %s, GSO %s, receive %s)", _fmt(self.address), self.rcvbuf,
                 self.sndbuf, self._switch_config.pool_slots,
                 self._switch_config.lease_timeout_s,
                 "needs the secret" if self._switch_config.secret else "open",
                 "on" if self._sender.gso else "off",
                 ("recvmmsg" + (" + GRO" if self.gro else "")) if self._rx
                 else ("GRO" if self.gro else "one datagram per call"))
        timers = threading.Thread(target=self._run_timers, name="switchml-timers", daemon=True)
        timers.start()
        if self._rx is not None:
            self._serve_mmsg(self._rx)
        else:
            self._serve_gro()
        log.info("switch on %s stopped: %s", _fmt(self.address), self.stats())

    def _serve_mmsg(self, rx: MultiReceiver) -> None:
        """The receive loop with recvmmsg: every datagram queued at the socket per call."""
        dp = self.dataplane
        clock = time.monotonic
        while not self._stop.is_set():
            try:
                n = rx.receive(block=True)
            except OSError as exc:
                if self._stop.is_set():
                    break
                log.warning("recv failed: %s", exc)
                continue
            if not n:
                continue
            self.recv_calls += 1
            now = clock()
            self._process(dp.receive_many, (rx.buf, rx.starts, rx.lens, rx.senders, n,
                                            rx.address_of, now), now, "a batch")

    def _process(self, receive: Callable[..., None], args: tuple, now: float,
                 what: str) -> None:
        """Run one receive call of the dataplane; send what it released; log its events."""
        dp = self.dataplane
        with self._lock:
            try:
                receive(*args)
                out, runs = dp.output_runs(now)
            except Exception:  # a bug must not take the shared switch down
                self.internal_errors += 1
                log.exception("internal error on %s; dropped", what)
                dp.output_runs(now)  # nothing half-done goes out
                out, runs = [], {}
            add = self._sender.add
            for data, dst in out:
                add(data, dst)
            self._sender.send_runs(runs)
            while (ev := dp.next_event()) is not None:
                self._log_event(ev)

    def _serve_gro(self) -> None:
        """The receive loop with recvmsg: one datagram, or a GRO buffer of one sender."""
        buf = bytearray(RECV_BUFFER_BYTES)
        view = memoryview(buf)
        arr = np.frombuffer(buf, np.uint8)
        dp = self.dataplane
        sock = self.sock
        clock = time.monotonic
        while not self._stop.is_set():
            try:
                nbytes, seg, addr, truncated = receive_segments(sock, buf, view)
            except OSError as exc:
                if self._stop.is_set():
                    break
                log.warning("recv failed: %s", exc)
                continue
            if truncated:  # larger than any datagram of the protocol
                self.truncated += 1
                continue
            self.recv_calls += 1
            now = clock()
            self._process(dp.receive_batch, (arr, nbytes, seg, addr, now), now,
                          f"a buffer from {_fmt(addr)}")

    def _log_event(self, ev: object) -> None:
        """Structured job logs: ``event=... job=...`` key/value pairs, one line each."""
        if isinstance(ev, JobCreated):
            log.info("event=job_created job=%d n=%d slots=%d..%d elements_per_packet=%d "
                     "free_slots=%d", ev.job_id, ev.num_workers, ev.slot_base,
                     ev.slot_base + ev.window - 1, ev.elements_per_packet,
                     self.dataplane.allocator.free_slots)
        elif isinstance(ev, MemberJoined):
            log.info("event=member_joined job=%d rank=%d address=%s", ev.job_id, ev.rank,
                     _fmt(ev.address))
        elif isinstance(ev, JobRemoved):
            kind = "job_expired" if "lease" in ev.reason else "job_finished"
            log.info("event=%s job=%d reason=%r free_slots=%d", kind, ev.job_id, ev.reason,
                     self.dataplane.allocator.free_slots)
        elif isinstance(ev, TreeFailed):
            log.error("event=tree_failed rack=%d reason=%r", ev.rack, ev.reason)
        elif isinstance(ev, UpstreamJoined):
            log.info("event=upstream_joined rack=%d slot_base=%d", ev.rack, ev.slot_base)
        elif isinstance(ev, JobRefused):
            # Anyone can send JOINs: at most 10 refusal lines per 10 s, then a count.
            now = time.monotonic()
            if now - self._refusals_window_start > 10.0:
                if self._refusals_suppressed:
                    log.warning("event=job_refused_suppressed count=%d",
                                self._refusals_suppressed)
                self._refusals_window_start, self._refusals_logged = now, 0
                self._refusals_suppressed = 0
            if self._refusals_logged < 10:
                self._refusals_logged += 1
                log.warning("event=job_refused job=%d rank=%d address=%s reason=%r", ev.job_id,
                            ev.rank, _fmt(ev.address), ev.reason)
            else:
                self._refusals_suppressed += 1

    def run_command(self, command: Callable[..., None], *args: Any) -> None:
        """Run ``command(*args, now)`` on the dataplane (e.g. a rack's ``join``) and send what
        it released, under the dataplane's lock."""
        now = time.monotonic()
        self._process(command, (*args, now), now, command.__name__)

    def stats(self) -> dict[str, object]:
        with self._lock:
            s = self.dataplane.stats()
        s["internal_errors"] = self.internal_errors
        s["send_errors"] = self.send_errors + self._sender.errors + self._sender.blocked
        s["truncated"] = self.truncated
        s["send_calls"] = self._sender.calls
        s["recv_calls"] = self.recv_calls
        s["gso"] = self._sender.gso
        s["gro"] = self.gro
        s["recvmmsg"] = self._rx is not None
        return s

    def start(self) -> SwitchServer:
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="switchml-switch",
                                        daemon=True)
        self._thread.start()
        return self

    def _run_timers(self) -> None:
        """Fire the dataplane's deadlines (job leases) from a thread of their own, so the receive
        loop stays a plain blocking read with no timeout."""
        dp = self.dataplane
        while not self._stop.is_set():
            with self._lock:
                timer = dp.get_timer()
            now = time.monotonic()
            wait = 1.0 if timer is None else min(max(timer - now, 0.0), 1.0)
            if self._stop.wait(wait):
                return
            with self._lock:
                now = time.monotonic()
                timer = dp.get_timer()
                if timer is not None and timer <= now:
                    dp.handle_timer(now)
                    for data, dst in dp.datagrams_to_send(now):
                        try:
                            self.sock.sendto(data, dst)
                        except OSError:
                            self.send_errors += 1
                    while (ev := dp.next_event()) is not None:
                        self._log_event(ev)

    def stop(self) -> None:
        """Stop serving (wakes the blocking receive) and close the socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:  # wake recvfrom_into with an empty datagram (dropped as short if it gets that far)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                host = self.address[0] if self.address[0] != "0.0.0.0" else "127.0.0.1"
                s.sendto(b"", (host, self.address[1]))
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.sock.close()

    def __enter__(self) -> SwitchServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class AllreduceHandle:
    """The pending result of :meth:`WorkerClient.allreduce_async`."""

    def __init__(self, out: np.ndarray, finish: Callable[[], None] | None = None) -> None:
        self.out = out
        self.seq: int | None = None
        self._finish = finish
        self._done = threading.Event()
        self._lock = threading.Lock()  # orders add_done_callback against _set
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[AllreduceHandle], None]] = []

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until done; return the output array.

        Raises:
            OperationFailed: the operation failed (the message names who stopped answering).
            TimeoutError: ``timeout`` passed first (the operation goes on).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"all-reduce not done after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.out

    def add_done_callback(self, fn: Callable[[AllreduceHandle], None]) -> None:
        """Call ``fn(handle)`` when done (at once if already done); runs on the I/O thread."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def exception(self) -> BaseException | None:
        return self._error

    def _set(self, error: BaseException | None) -> None:
        """Complete the handle (once; later calls are ignored) and run its callbacks."""
        if self._done.is_set():
            return
        if error is None and self._finish is not None:
            try:
                self._finish()
            except Exception as exc:  # copying back failed: report, don't kill the I/O thread
                error = exc
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                log.exception("all-reduce done callback failed")


class WorkerClient:
    """One rank of a job, all-reducing numpy arrays through a switch over UDP.

    Operations run one at a time, in the order they were issued, on an I/O thread; every rank
    must issue the same operations (size, dtype) in the same order.

    Example::

        spec = new_job_spec(num_workers=2)        # shared with every rank, e.g. by a launcher
        with WorkerClient(("127.0.0.1", 48864), spec, rank=0) as w:
            total = w.allreduce(np.ones(1_000_000, np.float32))

    Raises (constructor):
        OperationFailed: the switch refused or did not answer the JOIN in ``join_timeout_s``.
    """

    def __init__(self, switch: Address | Sequence[Address], spec: JobSpec, rank: int,
                 config: WorkerConfig | None = None, *, bind_host: str | None = None,
                 buffer_bytes: int = SOCKET_BUFFER_BYTES, loss_rate: float = 0.0,
                 loss_seed: int = 0, batching: bool = True) -> None:
        if not 0.0 <= loss_rate < 1.0:
            raise ValueError(f"loss_rate must be in [0, 1), got {loss_rate}")
        # Fault injection for tests and soak runs: drop this fraction of datagrams in each
        # direction, from a seeded generator (reproducible), without touching the socket.
        self._loss_rate = loss_rate
        self._loss_rng = random.Random(loss_seed)
        self.injected_losses = 0
        # One switch, or the shards of a sharded switch (``switchml switch --shards``): the
        # job's lanes are striped over them.
        shards = [switch] if isinstance(switch[0], str) else list(switch)  # type: ignore
        self.switches = [(socket.gethostbyname(h), int(p)) for h, p in shards]
        self.switch = self.switches[0]
        sharded = len(self.switches) > 1
        env_secret = os.environ.get("SWITCHML_SECRET")
        if env_secret and (config is None or config.secret is None):
            config = dataclasses.replace(config or WorkerConfig(), secret=env_secret.encode())
        self.endpoint = WorkerEndpoint(spec=spec, rank=rank,
                                       switch_address=self.switches if sharded else self.switch,
                                       config=config)
        self.spec = spec
        self.rank = rank
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            loopback = all(a[0].startswith("127.") for a in self.switches)
            self.sock.bind((bind_host or ("127.0.0.1" if loopback else "0.0.0.0"), 0))
            if not sharded:  # filters other sources; surfaces ICMP unreachable
                self.sock.connect(self.switch)
        except OSError as exc:
            self.sock.close()
            raise TransportError(f"can't open a socket towards {_fmt(self.switch)}: {exc}") \
                from exc
        _size_buffers(self.sock, buffer_bytes)
        self.sock.setblocking(False)
        self._rx = MultiReceiver(self.sock) if batching and recvmmsg_supported() else None
        # GRO on the socket: MultiReceiver asks for it itself (its buffers may be GRO buffers).
        self.gro = self._rx.gro if self._rx is not None else batching and enable_gro(self.sock)
        self._sender = BatchSender(self.sock, gso=batching and gso_supported(self.sock),
                                   connected=not sharded, raise_errors=True)
        self.icmp_errors = 0
        self.send_blocked = 0
        self.truncated = 0
        self.recv_calls = 0
        self._queue: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._pending: dict[int, AllreduceHandle] = {}
        self._waiting: list[_Command] = []
        self._joined = threading.Event()
        self._closed = threading.Event()
        # Held across "closed?", queue put and wake-up write, and by whoever closes: a command
        # is either seen by the I/O thread or refused, and nobody writes to a closed pipe.
        self._submit_lock = threading.Lock()
        self._join_error: str | None = None
        self._fatal: str | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        # Non-blocking writes too: a full pipe already means a wake-up is pending, and a
        # blocking write under the submit lock could deadlock with a busy I/O thread.
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=f"switchml-worker-{rank}",
                                        daemon=True)
        self._thread.start()
        try:
            self._joined.wait()
        except BaseException:  # e.g. Ctrl-C while joining: leave no thread or socket behind
            self.close()
            raise
        if self._join_error is not None:
            self.close()
            raise OperationFailed(self._join_error)

    # -- user API ----------------------------------------------------------------------------

    def allreduce(self, data: np.ndarray, out: np.ndarray | None = None, *, bits: int = 32,
                  residual: np.ndarray | None = None) -> np.ndarray:
        """Sum ``data`` over all ranks; return ``out`` (a new array if None; may be ``data``).

        ``bits=16`` sends floats as 16-bit fixed point (half the bytes); ``residual`` receives
        this rank's quantization error for error feedback. See ``WorkerEndpoint``.
        """
        return self.allreduce_async(data, out, bits=bits, residual=residual).wait()

    def allreduce_async(self, data: np.ndarray, out: np.ndarray | None = None, *,
                        bits: int = 32, residual: np.ndarray | None = None) -> AllreduceHandle:
        """Queue an all-reduce and return at once; ``handle.wait()`` gives the result.

        Raises:
            LocalProtocolError: bad arrays (dtype, size), or the client is closed or failed.
        """
        if not isinstance(data, np.ndarray):
            raise LocalProtocolError(f"data must be a numpy array, got {type(data).__name__}")
        if out is None:
            out = np.empty_like(data)
        elif out.shape != data.shape or out.dtype != data.dtype:
            raise LocalProtocolError(f"out must match data: {out.dtype}{out.shape} vs "
                                     f"{data.dtype}{data.shape}")
        src = np.ascontiguousarray(data)
        dst = out if out.flags.c_contiguous and out.flags.writeable else np.empty_like(src)
        finish = None if dst is out else (lambda: np.copyto(out, dst))
        validate_arrays(src, dst)  # the core's own checks, raised in the caller's thread
        handle = AllreduceHandle(out, finish)
        if bits not in (32, 16) or (bits == 16 and src.dtype.kind != "f"):
            raise LocalProtocolError(f"bits must be 32, or 16 for float data; got {bits} for "
                                     f"{src.dtype}")
        with self._submit_lock:
            if self._fatal is not None:
                raise LocalProtocolError(f"client failed earlier: {self._fatal}")
            if self._closed.is_set():
                raise LocalProtocolError("client is closed")
            self._queue.put((src, dst, handle, bits, residual))
            self._wake()
        return handle

    def close(self) -> None:
        """Leave the job and stop the I/O thread. Idempotent; pending operations fail.

        Safe from any thread, including a done-callback on the I/O thread (which then only
        asks the thread to stop; the thread closes its own socket and pipes when it ends).
        """
        with self._submit_lock:
            if self._closed.is_set():
                return
            self._closed.set()
            self._queue.put(None)
            self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _wake(self) -> None:
        """Wake the I/O thread (call with the submit lock held, so the pipe is open)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is pending anyway

    @property
    def counters(self) -> dict[str, int]:
        """Sent, retransmitted, results, timeouts and drops of this rank (a snapshot)."""
        for _ in range(10):  # the I/O thread may add a key while we copy
            try:
                c = dict(self.endpoint.counters)
                c.update({f"drop_{k}": v for k, v in list(self.endpoint.drops.items())})
                break
            except RuntimeError:
                continue
        c["icmp_errors"] = self.icmp_errors
        c["injected_losses"] = self.injected_losses
        c["send_blocked"] = self.send_blocked
        c["send_errors"] = self._sender.errors
        c["send_calls"] = self._sender.calls
        c["recv_calls"] = self.recv_calls
        c["truncated"] = self.truncated
        return c

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- I/O thread --------------------------------------------------------------------------

    def _run(self) -> None:
        ep = self.endpoint
        try:
            ep.join(time.monotonic())
            self._pump_loop()
        except Exception as exc:  # never let the thread die silently
            log.exception("worker %d I/O thread failed", self.rank)
            self._fatal = f"I/O thread failed: {exc!r}"
            self._join_error = self._join_error or self._fatal
        finally:
            with self._submit_lock:  # no command can be queued after this
                self._closed.set()
            self._joined.set()
            self._fail_all(self._fatal or "client closed")
            self.sock.close()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _pump_loop(self) -> None:
        ep = self.endpoint
        sock = self.sock
        buf = bytearray(RECV_BUFFER_BYTES)
        view = memoryview(buf)
        arr = np.frombuffer(buf, np.uint8)
        clock = time.monotonic
        closing = False
        waiting = self._waiting
        while True:
            self._transmit(clock())
            if ep.state is WorkerState.CLOSED:
                return
            if ep.state is WorkerState.ERROR and self._fatal is None and self._joined.is_set():
                self._fatal = ep.error
            # Take new commands.
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                else:
                    waiting.append(item)
            if closing and ep.state not in (WorkerState.CLOSING, WorkerState.CLOSED):
                ep.close(clock())
                continue
            if waiting and ep.state is WorkerState.READY:
                src, dst, handle, bits, residual = waiting.pop(0)
                try:
                    seq = ep.start_allreduce(src, dst, clock(), bits=bits, residual=residual)
                except Exception as exc:  # e.g. MemoryError copying the input: fail this one
                    handle._set(exc if isinstance(exc, SwitchMLError) else OperationFailed(
                        f"could not start the all-reduce: {exc!r}"))
                    continue
                handle.seq = seq
                self._pending[seq] = handle
                continue
            if waiting and ep.state is WorkerState.ERROR:
                for command in waiting:
                    command[2]._set(OperationFailed(f"job failed earlier: {ep.error}"))
                waiting.clear()
            # Read everything pending, then wait for a datagram, a command or the timer.
            got = self._read_mmsg() if self._rx is not None else False
            while self._rx is None:
                try:
                    nbytes, seg, _addr, truncated = receive_segments(sock, buf, view)
                except BlockingIOError:
                    break
                except ConnectionRefusedError:
                    self._icmp_refused(1)  # nothing listens at the switch address (yet)
                    continue
                if truncated:
                    self.truncated += 1
                    continue
                self.recv_calls += 1
                now = clock()
                # One datagram, or several coalesced by GRO: take them all in one call, then
                # send what they released in as few system calls as possible.
                if self._loss_rate:
                    for start, end in segments(nbytes, seg):
                        if self._loss_rng.random() < self._loss_rate:
                            self.injected_losses += 1
                            continue
                        ep.receive_datagram(view[start:end], self.switch, now)
                else:
                    ep.receive_batch(arr, nbytes, seg, self.switch, now)
                got = True
                self._transmit(clock())
            if got:
                timer = ep.get_timer()  # a steady inflow must not starve the timers
                now = clock()
                if timer is not None and timer <= now:
                    ep.handle_timer(now)
                continue
            timer = ep.get_timer()
            now = clock()
            if timer is not None and timer <= now:
                ep.handle_timer(now)
                continue
            timeout = None if timer is None else timer - now
            readable, _, _ = select.select([sock, self._wake_r], [], [], timeout)
            if self._wake_r in readable:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass

    def _read_mmsg(self) -> bool:
        """Take every datagram queued at the socket, many per recvmmsg call."""
        rx, ep, clock = self._rx, self.endpoint, time.monotonic
        assert rx is not None
        got = False
        while True:
            try:
                n = rx.receive()
            except ConnectionRefusedError:
                self._icmp_refused(1)  # nothing listens at the switch address (yet)
                continue
            if not n:
                return got
            self.recv_calls += 1
            now = clock()
            if self._loss_rate:
                view = memoryview(rx.buf)
                for i in range(n):
                    if self._loss_rng.random() < self._loss_rate:
                        self.injected_losses += 1
                        continue
                    o = int(rx.starts[i])
                    ep.receive_datagram(view[o:o + int(rx.lens[i])], self.switch, now)
            else:
                ep.receive_many(rx.buf, rx.starts, rx.lens, n, now)
            got = True
            self._transmit(clock())

    def _icmp_refused(self, count: int) -> None:
        """ICMP port unreachable: say so at once (the operation keeps its timeout semantics:
        the switch may be starting, or restarting)."""
        if not self.icmp_errors:
            log.warning("worker %d: nothing listens at %s (ICMP port unreachable); still "
                        "trying until the join or operation timeout: is the switch running "
                        "there (SWITCHML_SWITCH)?", self.rank, _fmt(self.switch))
        self.icmp_errors += count

    def _transmit(self, now: float) -> None:
        """Send the endpoint's datagrams and dispatch its events."""
        ep = self.endpoint
        sender = self._sender
        for data, addr in ep.datagrams_to_send(now):
            if self._loss_rate and self._loss_rng.random() < self._loss_rate:
                self.injected_losses += 1
                continue
            sender.add(data, addr)  # ignored on a connected socket (one switch, not shards)
        sender.flush()
        if sender.blocked or sender.refused:
            # A full socket buffer is a loss (the retransmission timer recovers); a refusal is
            # ICMP port unreachable: nothing listens at the switch address (yet).
            self.send_blocked += sender.blocked
            if sender.refused:
                self._icmp_refused(sender.refused)
            sender.blocked = sender.refused = 0
        while (ev := ep.next_event()) is not None:
            if isinstance(ev, OperationCompleted):
                handle = self._pending.pop(ev.seq, None)
                if handle is not None:
                    handle._set(None)
            elif isinstance(ev, OperationFailedEvent):
                handle = self._pending.pop(ev.seq, None)
                reason = ev.reason
                if self.icmp_errors:
                    reason += (f" ({self.icmp_errors} ICMP port-unreachable errors: is a switch "
                               f"listening at {_fmt(self.switch)}?)")
                self._fatal = reason
                if handle is not None:
                    handle._set(OperationFailed(reason))
            elif isinstance(ev, Joined):
                log.debug("worker %d joined job %d (slots %d..)", self.rank, self.spec.job_id,
                          ev.slot_base)
                self._joined.set()
            elif isinstance(ev, JoinFailed):
                self._join_error = ev.reason + (
                    f" ({self.icmp_errors} ICMP port-unreachable errors: is a switch listening "
                    f"at {_fmt(self.switch)}?)" if self.icmp_errors else "")
                self._joined.set()
            elif isinstance(ev, OperationRestarted):
                log.warning("worker %d, job %d: %s; operation %d restarts as %d", self.rank,
                            self.spec.job_id, ev.reason, ev.seq, ev.new_seq)
                handle = self._pending.pop(ev.seq, None)
                if handle is not None:
                    handle.seq = ev.new_seq
                    self._pending[ev.new_seq] = handle
            elif isinstance(ev, Left):
                pass
        if ep.state is WorkerState.ERROR and self._pending:
            # Whatever the failure (a refused rejoin, a bad grant), no handle may wait forever.
            reason = ep.error or "the worker failed"
            self._fatal = self._fatal or reason
            for handle in self._pending.values():
                handle._set(OperationFailed(reason))
            self._pending.clear()

    def _fail_all(self, reason: str) -> None:
        for handle in self._pending.values():
            handle._set(OperationFailed(reason))
        self._pending.clear()
        for command in self._waiting:
            command[2]._set(OperationFailed(reason))
        self._waiting.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[2]._set(OperationFailed(reason))
