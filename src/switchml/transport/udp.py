"""UDP transports: thin socket pumps around the sans-I/O core.

Both pumps follow the Endpoint contract (``protocol/endpoint.py``): hand every batch of
received datagrams to the endpoint with the monotonic clock, send what it returns at once, fire
its timer when due. What turns events into completed operations (queues, handles, restarts,
failing everything on a fatal error) is not here but in ``protocol/session.py``, which the
in-memory fabric and the simulator use too.

System calls are batched where the kernel allows (``transport/batching.py``): ``recvmmsg``
takes everything queued at a socket per call, UDP GRO hands over several datagrams of one
sender per buffer, and what a batch released goes out with UDP GSO, one call per run of
equal-sized datagrams to one destination.

Socket buffers: a switch receives up to ``n x W`` datagrams in a burst. The server asks for
``rcvbuf_bytes`` (SO_RCVBUFFORCE as root, else SO_RCVBUF, which the kernel caps at
``net.core.rmem_max``) and logs what it got. Datagrams the kernel drops for lack of buffer are
recovered by retransmission, at a cost in speed.
"""

from __future__ import annotations

import errno
import logging
import select
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from switchml import env
from switchml.protocol.address import Address, as_addresses, format_address, format_addresses
from switchml.protocol.config import JobSpec, WorkerConfig
from switchml.protocol.endpoint import Batch, Endpoint
from switchml.protocol.errors import LocalProtocolError, OperationFailed
from switchml.protocol.events import OperationRestarted
from switchml.protocol.session import WorkerSession, prepare_submission
from switchml.protocol.worker import WorkerEndpoint, WorkerState
from switchml.protocol.worker_ahead import Position
from switchml.transport.batching import (
    MAX_GSO_BYTES,
    MAX_SEGMENTS,
    BatchSender,
    MultiReceiver,
    gso_supported,
    open_receiver,
)
from switchml.transport.fastpath import FP, ST, FastPath
from switchml.transport.fastpath import available as fastpath_available
from switchml.transport.handles import AllreduceHandle
from switchml.transport.inbox import Inbox
from switchml.transport.server import SwitchServer  # re-exported: udp.SwitchServer
from switchml.transport.sockets import (
    DEFAULT_PORT,
    SOCKET_BUFFER_BYTES,
    elements_per_packet_for,
    open_worker_socket,
    path_mtu,
    resolve_ipv4,
)

__all__ = ["DEFAULT_PORT", "AllreduceHandle", "SwitchServer", "WorkerClient",
           "elements_per_packet_for", "path_mtu"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class _Call:
    """A call to run on the I/O thread (the endpoint's state is that thread's), and its
    outcome."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.future = fn, Future()  # type: Future[Any]


class WorkerClient:
    """One rank of a job, all-reducing numpy arrays through a switch over UDP.

    Operations run one at a time, in the order they were issued, on an I/O thread that pumps a
    :class:`~switchml.protocol.session.WorkerSession`; every rank must issue the same
    operations (size, dtype) in the same order. ``switch``: an address, or the list of a
    sharded switch's shards. ``wrap``: wraps the session for the pump, e.g. seeded loss
    injection (``transport.faults.LossyEndpoint``).

    Datagrams carry ``spec.elements_per_packet`` elements, which every rank and the switch
    share. ``new_job_spec`` sizes them to fit the MTU of the path to the switch it is given
    (``transport.sockets.local_mtu``, the torch backend's rule: ``SWITCHML_MTU``, else the
    route's, else 1500; loopback: 64 KB datagrams), and without one to a 1500-byte Ethernet
    MTU, so that IP never fragments them.

    Example::

        switch = ("127.0.0.1", 48864)
        spec = new_job_spec(num_workers=2, switch=switch)  # shared with every rank
        with WorkerClient(switch, spec, rank=0) as w:
            total = w.allreduce(np.ones(1_000_000, np.float32))

    ``late_join``: this rank joins a running quorum job (a replacement for a rank that died):
    take a live rank's ``position()`` with its state, then ``resume(position)`` before the
    first all-reduce (docs/protocol.md section 7, "Joining a running job").

    Raises (constructor):
        OperationFailed: the switch refused or did not answer the JOIN in ``join_timeout_s``.
        TransportError: no socket towards the switch.
        LocalProtocolError: ``late_join`` for a job without a quorum.
    """

    def __init__(self, switch: Address | Sequence[Address], spec: JobSpec, rank: int,
                 config: WorkerConfig | None = None, *, bind_host: str | None = None,
                 buffer_bytes: int = SOCKET_BUFFER_BYTES, batching: bool = True,
                 wrap: Callable[[WorkerSession], Endpoint] | None = None,
                 late_join: bool = False) -> None:
        if late_join and not spec.quorum:
            raise LocalProtocolError("late_join: only a quorum job can take a rank while it "
                                     "runs; this job has no quorum")
        self._late_join = late_join
        self.switches: list[Address] = [(resolve_ipv4(h), int(p))
                                        for h, p in as_addresses(switch)]
        self.switch = self.switches[0]
        sharded = len(self.switches) > 1
        self.spec, self.rank = spec, rank
        self.session = WorkerSession(
            WorkerEndpoint(spec=spec, rank=rank, config=config, switch_address=self.switches),
            handle_type=AllreduceHandle, explain=self._icmp_note)
        self.endpoint = self.session.endpoint
        self._driven: Endpoint = wrap(self.session) if wrap is not None else self.session
        self.sock = open_worker_socket(self.switches, bind_host, buffer_bytes)
        self._rx = open_receiver(self.sock, batching=batching)
        self.gro = self._rx.gro
        self._sender = BatchSender(self.sock, gso=batching and gso_supported(self.sock),
                                   connected=not sharded, raise_errors=True)
        # One switch: the socket is connected to it, so the kernel drops datagrams from anyone
        # else; a sharded switch's socket is not, and the core checks every sender.
        self._peer = None if sharded else self.switch
        # The compiled receive-and-send loop (recvmmsg, GSO): to one switch on the connected
        # socket, or each lane to its shard, taking results from the shards alone.
        self._inbox = Inbox()
        self._fast = (FastPath(self.sock, self._rx, self._inbox.fileno(),
                               max_segments=MAX_SEGMENTS, max_bytes=MAX_GSO_BYTES,
                               shards=self.switches)
                      if (isinstance(self._rx, MultiReceiver) and self._sender.gso
                          and env.fast_path() and fastpath_available())
                      else None)
        self.icmp_errors = self.send_blocked = self.recv_calls = 0
        self._joined = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"switchml-worker-{rank}",
                                        daemon=True)
        self._thread.start()
        try:
            self._joined.wait()
        except BaseException:  # e.g. Ctrl-C while joining: leave no thread or socket behind
            self.close()
            raise
        if not self.session.joined:
            self.close()
            raise OperationFailed(self.session.error or "the worker stopped while joining")

    # -- user API ----------------------------------------------------------------------------

    def allreduce(self, data: np.ndarray, out: np.ndarray | None = None, *, bits: int = 32,
                  residual: np.ndarray | None = None) -> np.ndarray:
        """Sum ``data`` over all ranks; return ``out`` (a new array if None; may be ``data``).
        ``bits=16`` sends floats as 16-bit fixed point (half the bytes); ``residual`` receives
        this rank's quantization error for error feedback. See ``WorkerEndpoint``."""
        return self.allreduce_async(data, out, bits=bits, residual=residual).wait()

    def allreduce_async(self, data: np.ndarray, out: np.ndarray | None = None, *,
                        bits: int = 32, residual: np.ndarray | None = None) -> AllreduceHandle:
        """Queue an all-reduce and return at once; ``handle.wait()`` gives the result.

        Raises:
            LocalProtocolError: bad arrays (dtype, size), or the client is closed or failed.
        """
        sub = prepare_submission(data, out, bits=bits, residual=residual,
                                 handle_type=AllreduceHandle)
        self._put(sub)
        return sub.handle  # type: ignore[return-value]

    def _put(self, item: Any) -> None:
        """Queue ``item`` for the I/O thread. Raises LocalProtocolError if the client failed
        or is closed."""
        def healthy() -> None:
            if self.session.error is not None:
                raise LocalProtocolError(f"client failed earlier: {self.session.error}")

        try:
            self._inbox.put(item, check=healthy)
        except RuntimeError:
            raise LocalProtocolError("client is closed") from None

    def position(self) -> Position:
        """Where this rank stands, between all-reduces (wait for every handle first): hand
        it, with the state the all-reduces so far produced, to a rank that joins the running
        job (``late_join``) for its ``resume``. Raises LocalProtocolError with an all-reduce
        in flight or queued, or if the client failed or closed."""
        return self._on_io_thread(self._idle_position)

    def _idle_position(self) -> Position:
        if self.session.busy:
            raise LocalProtocolError("a position is taken between all-reduces: wait for "
                                     "every handle first")
        return self.endpoint.position()

    def resume(self, position: Position) -> None:
        """Start where a live rank stands (its ``position()``), once, after joining with
        ``late_join`` and before the first all-reduce. Raises LocalProtocolError otherwise,
        or for a position of another job's geometry."""
        self._on_io_thread(lambda: self.endpoint.resume(position))

    def pin(self, position: Position) -> None:
        """The position this rank will resume at, as soon as it is known, before the state
        that goes with it (``WorkerEndpoint.pin``)."""
        self._on_io_thread(lambda: self.endpoint.pin(position))

    def ops_behind(self) -> int:
        """A quorum job's rank between all-reduces: how many operations the others are ahead
        of it, as the results it kept show (``WorkerEndpoint.ops_behind``)."""
        return self._on_io_thread(lambda: self.endpoint.ops_behind)

    def catch_up(self) -> None:
        """Fall back to a live rank's position (``WorkerEndpoint.catch_up``): from now on
        every result is kept until ``resume``. Between all-reduces."""
        self._on_io_thread(self._idle_catch_up)

    def _idle_catch_up(self) -> None:
        if self.session.busy:
            raise LocalProtocolError("catch_up is for a rank between all-reduces: wait for "
                                     "every handle first")
        self.endpoint.catch_up()

    def _on_io_thread(self, fn: Callable[[], _T]) -> _T:
        if threading.current_thread() is self._thread:  # (a done-callback: run it here)
            return fn()
        call = _Call(fn)
        self._put(call)
        return call.future.result()  # type: ignore[no-any-return]

    def close(self) -> None:
        """Leave the job and stop the I/O thread. Idempotent; pending operations fail. Safe
        from any thread, including a done-callback on the I/O thread (which then only asks
        the thread to stop; the thread closes its own socket and pipes when it ends)."""
        if self._inbox.close() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def progress(self) -> str | None:
        """What the operation in flight waits for, from the worker's state (a best-effort
        snapshot from any thread, for diagnostics), or None when idle."""
        try:
            return self.endpoint.progress(time.monotonic())
        except Exception:  # noqa: BLE001 - state changing under us: no account this time
            return None

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
        c.update(icmp_errors=self.icmp_errors, send_blocked=self.send_blocked,
                 injected_losses=getattr(self._driven, "injected_losses", 0),
                 send_errors=self._sender.errors, send_calls=self._sender.calls,
                 recv_calls=self.recv_calls, truncated=self._rx.truncated)
        return c

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- I/O thread --------------------------------------------------------------------------

    def _run(self) -> None:
        reason = "client closed"
        try:
            self.session.join(time.monotonic(), late=self._late_join)
            self._pump()
        except Exception as exc:  # never let the thread die silently
            log.exception("worker %d I/O thread failed", self.rank)
            reason = f"I/O thread failed: {exc!r}"
            self.session.error = self.session.error or reason
        finally:
            self._inbox.shut()  # no command can be queued after this
            self._joined.set()
            self.session.fail_all(reason)
            for sub in self._inbox.drain():
                if isinstance(sub, _Call):
                    sub.future.set_exception(LocalProtocolError(f"client stopped: {reason}"))
                elif sub is not Inbox.CLOSE:
                    sub.handle.resolve(OperationFailed(reason))
            self.sock.close()
            self._inbox.release()

    def _pump(self) -> None:
        """Commands in, datagrams in, timers, datagrams out; until the endpoint is closed."""
        ep, driven, clock = self.endpoint, self._driven, time.monotonic
        poller = select.poll()  # one wake-up source set, made once
        poller.register(self.sock, select.POLLIN)
        poller.register(self._inbox.fileno(), select.POLLIN)
        joined = False
        while ep.state is not WorkerState.CLOSED:
            self._transmit()
            if self._run_commands():
                continue
            self._read()  # everything queued (it sends what each batch released)
            if not joined and (self.session.joined or self.session.error is not None):
                self._joined.set()  # the constructor returns
                joined = True
            timer, now = driven.get_timer(), clock()
            if timer is not None and timer <= now:  # also after reads: an inflow can't starve it
                driven.handle_timer(now)
            elif ep.state is not WorkerState.CLOSED:
                # Wait for the next datagram, command or deadline (at once if one came in
                # meanwhile): one wake-up per burst, not a loop around an empty socket.
                poller.poll(None if timer is None else (timer - now) * 1e3)

    def _run_commands(self) -> bool:
        """Hand queued all-reduces to the session (a close last); whether there were any."""
        items = self._inbox.drain()
        for sub in items:
            if sub is Inbox.CLOSE:
                self.session.close(time.monotonic())
                continue
            if isinstance(sub, _Call):
                try:
                    sub.future.set_result(sub.fn())
                except Exception as exc:  # noqa: BLE001 - the caller's to see
                    sub.future.set_exception(exc)
                continue
            try:
                self.session.enqueue(sub, time.monotonic())
            except LocalProtocolError as exc:  # the job failed or closed meanwhile
                sub.handle.resolve(exc)
        return bool(items)

    def _read(self) -> bool:
        """Take every datagram queued at the socket, many per call; stop at an empty socket,
        or when a ``recvmmsg`` came back with room to spare (it took all there was). While an
        operation is in flight, the compiled loop does it (:meth:`_read_fast`)."""
        rx, got = self._rx, False
        while True:
            if self._fast is not None and self._driven is self.session:
                state = self.endpoint.fast_path_state()
                if state is not None:
                    why, took = self._read_fast(state)
                    got = got or took
                    if why in (FP.STOPPED, FP.SEND_FAILED):
                        continue
                    if why != FP.RECV_FAILED:
                        return got
                    # A failed recvmmsg: the Python path below repeats it and reads the error.
            try:
                n = rx.receive()
            except ConnectionRefusedError:
                self._icmp_refused(1)  # nothing listens at the switch address (yet)
                continue
            if not n:
                return got
            self.recv_calls += 1
            self._driven.receive_many(Batch(rx.buf, rx.starts, rx.lens, rx.senders, n,
                                            rx.address_of, sender=self._peer), time.monotonic())
            got = True
            self._transmit()
            if rx.drained:
                return got

    def _read_fast(self, state: tuple) -> tuple[int, bool]:
        """One call of the compiled loop (``fastpath.pump``), then what it left to Python:
        the rest of a batch (``receive_many`` from where the kernel stopped), requests a
        failed ``sendmsg`` left queued, a failed ``recvmmsg`` (repeated in Python, which reads
        its error). Returns (why it returned, took datagrams)."""
        fast, rx = self._fast, self._rx
        why, at, nseg, code = fast.run(*state)
        took = bool(fast.stats[ST.RECV_CALLS])
        err = self._take_fast_stats(send_failed=why == FP.SEND_FAILED)
        if why == FP.STOPPED:
            now = time.monotonic()
            self.session.after_results_kernel(state[0], code, now)
            if at < nseg:
                self._driven.receive_many(Batch(rx.buf, rx.starts, rx.lens, rx.senders, nseg,
                                                rx.address_of, sender=self._peer
                                                ).slice(at, nseg), now)
            self._transmit(compiled=not err)  # (after a failed sendmsg: the sender reads it)
            return why, True
        if why == FP.SEND_FAILED:
            self._transmit(compiled=False)  # the rest, through the sender (it reads the error)
        return why, took

    def _take_fast_stats(self, *, send_failed: bool) -> int:
        """Add what the compiled loop counted to this client's counters; say what failed.
        Returns the errno of the system call that failed (0: none)."""
        st, sender = self._fast.stats, self._sender
        self.recv_calls += int(st[ST.RECV_CALLS])
        sender.calls += int(st[ST.SEND_CALLS])
        sender.datagrams += int(st[ST.DATAGRAMS_SENT])
        err = int(st[ST.ERRNO])
        st[:] = 0
        if err == errno.ECONNREFUSED:  # ICMP port unreachable, reported (once) to the loop
            self._icmp_refused(1)
        elif err == errno.EAGAIN and send_failed:
            self.send_blocked += 1  # a full socket buffer: a loss, recovered as one
        return err

    def _transmit(self, *, compiled: bool = True) -> None:
        """Send the session's datagrams; log what it reports. With the compiled loop (and
        ``compiled``), the operation's queued requests (its first window as it starts, what
        Python's receive or timers released) go out as the loop sends them, after the
        datagrams queued before them; what a failed ``sendmsg`` left queued goes through the
        sender below, which reads the error. ``compiled=False``: the compiled send just
        failed, the sender takes it all."""
        sender = self._sender
        tx = self._driven.poll_transmit(
            time.monotonic(), gso=(MAX_SEGMENTS, MAX_GSO_BYTES),
            compiled=(compiled and self._fast is not None and self._driven is self.session
                      and sender.gso))
        for data, addr in tx.datagrams:
            sender.add(data, addr)  # ignored on a connected socket (one switch, not shards)
        sender.flush()
        for buffers, size, addr in tx.runs:
            sender.send_run(buffers, size, addr)
        if tx.compiled is not None:
            sent = self._fast.send(tx.compiled)
            self._take_fast_stats(send_failed=not sent)
            if not sent:  # what the failed sendmsg left queued: the sender below reads why
                self._transmit(compiled=False)
                return
        if sender.blocked or sender.refused:
            # A full socket buffer is a loss (the retransmission timer recovers); a refusal is
            # ICMP port unreachable: nothing listens at the switch address (yet).
            self.send_blocked += sender.blocked
            if sender.refused:
                self._icmp_refused(sender.refused)
            sender.blocked = sender.refused = 0
        while (ev := self._driven.next_event()) is not None:
            if isinstance(ev, OperationRestarted):
                log.warning("worker %d, job %d: %s; operation %d restarts as %d", self.rank,
                            self.spec.job_id, ev.reason, ev.seq, ev.new_seq)

    def _icmp_refused(self, count: int) -> None:
        """ICMP port unreachable: say so at once (the operation keeps its timeout semantics:
        the switch may be starting, or restarting)."""
        if not self.icmp_errors:
            log.warning("worker %d: nothing listens at %s (ICMP port unreachable); still "
                        "trying until the join or operation timeout: is the switch running "
                        "there (SWITCHML_SWITCH)?", self.rank, format_address(self.switch))
        self.icmp_errors += count

    def _icmp_note(self) -> str:
        """What a failure's reason should add about ICMP errors seen."""
        if not self.icmp_errors:
            return ""
        return (f" ({self.icmp_errors} ICMP port-unreachable errors: is a switch listening at "
                f"{format_addresses(self.switches)}?)")
