"""The software switch over UDP: a thin socket pump around the sans-I/O dataplane
(``protocol/switch.py``), with its compiled receive-aggregate-send loop (``switchpath.py``)
where the platform allows. ``udp.py`` re-exports it beside the worker's client; its module text
says how both batch their system calls and size their socket buffers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from switchml import env
from switchml.protocol.address import Address, format_address
from switchml.protocol.config import SwitchConfig
from switchml.protocol.endpoint import Batch, Transmit
from switchml.protocol.errors import TransportError
from switchml.protocol.switch import SwitchDataplane
from switchml.transport.batching import (
    MAX_GSO_BYTES,
    MAX_SEGMENTS,
    BatchSender,
    MultiReceiver,
    gso_supported,
    open_receiver,
)
from switchml.transport.eventlog import SwitchEventLog
from switchml.transport.fastpath import FP
from switchml.transport.fastpath import available as fastpath_available
from switchml.transport.sockets import (
    DEFAULT_PORT,
    SOCKET_BUFFER_BYTES,
    resolves_to_loopback,
    size_buffers,
)
from switchml.transport.switchpath import SC as RSC
from switchml.transport.switchpath import SP, ResultSender, SwitchFastPath

__all__ = ["SwitchServer"]

log = logging.getLogger("switchml.transport.udp")  # (the name operators filter on, as before)


class SwitchServer:
    """A software switch on a UDP socket.

    Example::

        with SwitchServer(host="127.0.0.1", port=0) as server:   # serves in a thread
            print(server.address)

    ``serve_forever()`` runs in the caller's thread instead (the ``switchml switch`` command).
    ``dataplane``: another endpoint with the switch's contract to serve instead, e.g. a rack
    switch of a tree (``protocol.tree.RackAggregator``, ``switchml switch --upstream``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 config: SwitchConfig | None = None,
                 rcvbuf_bytes: int = SOCKET_BUFFER_BYTES, *, batching: bool = True,
                 dataplane: Any = None, insecure: bool = False) -> None:
        self.dataplane = dataplane if dataplane is not None else SwitchDataplane(config)
        self._switch_config = getattr(self.dataplane, "switch", self.dataplane).config
        # Job creation is open to whoever can reach the socket unless the switch has a secret.
        if not (insecure or self._switch_config.secret or resolves_to_loopback(host)):
            raise TransportError(
                f"a switch on {host} without a secret exposes job creation to the network: "
                "give SwitchConfig(secret=...), listen on 127.0.0.1, or pass insecure=True")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise TransportError(f"can't listen on {host}:{port}: {exc.strerror}") from exc
        self.rcvbuf, self.sndbuf = size_buffers(self.sock, rcvbuf_bytes)
        self.address: Address = self.sock.getsockname()
        self._rx = open_receiver(self.sock, batching=batching)
        self.gro = self._rx.gro
        self._sender = BatchSender(self.sock, gso=batching and gso_supported(self.sock))
        # Results sent from the jobs' arrays by a compiled call (a plain switch, with GSO):
        # wrapped dataplanes (loss injection, a rack switch) go through their own methods.
        self._results = (ResultSender(self.sock, max_segments=MAX_SEGMENTS,
                                      max_bytes=MAX_GSO_BYTES)
                         if (type(self.dataplane) is SwitchDataplane and self._sender.gso
                             and env.fast_path() and fastpath_available()) else None)
        # Threads waiting for the lock: the compiled loop, which holds it while it streams,
        # returns when this is nonzero, and the receive loop lets them go first.
        self._asks = np.zeros(1, np.int64)
        self._asks_lock = threading.Lock()
        # The compiled loop that receives, aggregates and sends while jobs stream.
        self._fast = (SwitchFastPath(self._rx, self._results, asks=self._asks)
                      if self._results is not None and isinstance(self._rx, MultiReceiver)
                      else None)
        self._events = SwitchEventLog(lambda: self.dataplane.allocator.free_slots)
        self.internal_errors = 0
        self.recv_calls = 0
        self.fast_path_datagrams = 0  # requests the compiled loop took
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the dataplane against the timer thread, stats()

    def serve_forever(self) -> None:
        """Serve until :meth:`stop`. Never raises for anything a peer sends."""
        cfg = self._switch_config
        log.info("switch listening on udp %s (rcvbuf %d B, sndbuf %d B, pool %d slots, lease "
                 "%g s, job creation %s, GSO %s, receive %s)", format_address(self.address),
                 self.rcvbuf, self.sndbuf, cfg.pool_slots, cfg.lease_timeout_s,
                 "needs the secret" if cfg.secret else "open",
                 "on" if self._sender.gso else "off",
                 ("recvmmsg" + (" + GRO" if self.gro else ""))
                 if isinstance(self._rx, MultiReceiver)
                 else ("GRO" if self.gro else "one datagram per call"))
        timers = threading.Thread(target=self._run_timers, name="switchml-timers", daemon=True)
        timers.start()
        rx, clock = self._rx, time.monotonic
        stable = isinstance(rx, MultiReceiver)  # (numbers senders by address and port)
        while not self._stop.is_set():
            if self._fast is not None and self._serve_fast():
                continue
            try:
                n = rx.receive(block=True)
            except OSError as exc:
                if not self._stop.is_set():
                    log.warning("recv failed: %s", exc)
                continue
            if n:
                self.recv_calls += 1
                now = clock()
                self._process(self.dataplane.receive_many,
                              (Batch(rx.buf, rx.starts, rx.lens, rx.senders, n, rx.address_of,
                                     stable), now), now)
        log.info("switch on %s stopped: %s", format_address(self.address), self.stats())

    def _serve_fast(self) -> bool:
        """One call of the compiled loop (``switchpath.switch_pump``) for the dataplane's hot
        job, under the dataplane's lock, then what it left to Python (the rest of its last
        batch). False when the dataplane has no state for it (the Python path serves)."""
        dp, fast, rx = self.dataplane, self._fast, self._rx
        if self._asks[0]:  # another thread waits for the dataplane: it goes first
            time.sleep(0.0001)
            return True
        with self._lock:
            state = dp.fast_path_state()
            if state is None:
                return False
            # (an idle loop holds the dataplane this long: a quorum deadline's timer waits)
            fast.max_wait_s = min(0.2, getattr(dp, "timer_granularity", lambda: 1.0)())
            jobs = state[0]
            why, at, nseg, code, k = fast.run(*state)
            now = time.monotonic()
            st = fast.stats
            self.recv_calls += int(st[SP.RECV_CALLS])
            self.fast_path_datagrams += int(st[SP.TAKEN])
            dp.after_fast_path(jobs, fast.taken[:len(jobs)].tolist(),
                               results_out=int(st[SP.RESULTS]), replies=int(st[SP.REPLIES]),
                               now=now)
            err = int(st[SP.ERRNO])
            st[:] = 0
            self._count_result_sends()
        if why == FP.STOPPED:
            batch = Batch(rx.buf, rx.starts, rx.lens, rx.senders, nseg, rx.address_of, True)
            self._process(dp.resume, (batch, jobs[k], code, at, now), now)
        elif why == FP.RECV_FAILED and not self._stop.is_set():
            log.warning("recv failed: %s", os.strerror(err))
        return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The dataplane's lock, asked for so that the compiled loop lets go of it."""
        with self._asks_lock:
            self._asks[0] += 1
        try:
            self._lock.acquire()
        finally:
            with self._asks_lock:
                self._asks[0] -= 1
        try:
            yield
        finally:
            self._lock.release()

    def _process(self, call: Callable[..., None], args: tuple, now: float) -> None:
        """Run one call of the dataplane; send what it released; log its events."""
        dp = self.dataplane
        with self._locked():
            try:
                call(*args)
                # a plain switch's results go out from its jobs' arrays, compiled
                tx = dp.poll_transmit(now, gso=(MAX_SEGMENTS, MAX_GSO_BYTES),
                                      compiled=self._results is not None)
            except Exception:  # a bug must not take the shared switch down
                self.internal_errors += 1
                log.exception("internal error in %s; dropped", call.__name__)
                dp.poll_transmit(now)  # nothing half-done goes out
                tx = Transmit([], {}, [])
            for data, dst in tx.datagrams:
                self._sender.add(data, dst)
            self._sender.send_runs(tx.groups)
            for buffers, size, dst in tx.runs:
                self._sender.send_run(buffers, size, dst)
            jobs = tx.compiled
            if jobs:
                for job, n in jobs:
                    self._results.send(job, n)  # type: ignore[union-attr]
                self._count_result_sends()
            while (ev := dp.next_event()) is not None:
                self._events.log(ev, now)

    def _count_result_sends(self) -> None:
        """Fold the compiled sends' counters into the sender's."""
        st, sender = self._results.stats, self._sender  # type: ignore[union-attr]
        sender.calls += int(st[RSC.SEND_CALLS])
        sender.datagrams += int(st[RSC.DATAGRAMS_SENT])
        sender.blocked += int(st[RSC.BLOCKED])
        sender.errors += int(st[RSC.ERRORS])
        st[:] = 0

    def run_command(self, command: Callable[..., None], *args: Any) -> None:
        """Run ``command(*args, now)`` on the dataplane (e.g. a rack's ``join``) and send what
        it released, under the dataplane's lock."""
        now = time.monotonic()
        self._process(command, (*args, now), now)

    def _run_timers(self) -> None:
        """Fire the dataplane's deadlines (job leases, a rack's upstream retransmissions) from
        a thread of their own, so the receive loop stays a plain blocking read."""
        dp = self.dataplane
        while not self._stop.is_set():
            with self._locked():
                timer = dp.get_timer()
                # (read again at least every 0.1 s: a job created meanwhile may bring a
                # quorum deadline sooner than this reading's timer)
                cap = min(0.1, getattr(dp, "timer_granularity", lambda: 1.0)())
            wait = cap if timer is None else min(max(timer - time.monotonic(), 0.0), cap)
            if self._stop.wait(wait):
                return
            now = time.monotonic()
            with self._locked():
                timer = dp.get_timer()
            if timer is not None and timer <= now:
                self._process(dp.handle_timer, (now,), now)

    def stats(self) -> dict[str, object]:
        """The dataplane's counters plus the pump's."""
        with self._locked():
            s = self.dataplane.stats()
            states = getattr(self.dataplane, "job_states", None)
            if states is not None:
                s["job_states"] = states(time.monotonic())
        s.update(internal_errors=self.internal_errors, truncated=self._rx.truncated,
                 send_errors=self._sender.errors + self._sender.blocked,
                 send_calls=self._sender.calls, recv_calls=self.recv_calls,
                 fast_path_datagrams=self.fast_path_datagrams,
                 gso=self._sender.gso, gro=self.gro, recvmmsg=isinstance(self._rx, MultiReceiver))
        return s

    def start(self) -> SwitchServer:
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="switchml-switch",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (wakes the blocking receive) and close the socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:  # wake the blocking receive with an empty datagram (dropped as short)
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
