"""A parameter server: holds shards, collects pushed gradients, runs the optimizer step.

Theory of operation. One thread accepts connections; one thread per worker connection reads its
messages in order (HELLO, INIT, PUSH, PULL, STATS, BYE). All shard state sits behind one
condition variable. A PUSH goes through the shard's step rule (:mod:`switchml.ps.rules`); when
the rule says the step is complete, the optimizer step runs at once (under the lock) and every
waiting PULL wakes. A PULL for version ``v`` waits until the shard's version reaches ``v``,
copies the values under the lock and sends them outside it.

Failures are bounded: a worker connection that closes without BYE marks the worker dead, and a
PULL whose step can no longer complete fails at once with an ERROR naming the dead worker(s);
a PULL that waits longer than ``timeout_s`` fails with an ERROR naming the workers whose
gradient is missing. Workers turn an ERROR into :class:`PSError`.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from switchml.links import (
    LinkSecurity,
    WarningBudget,
    check_exposure,
    identity_conflict,
    shutdown_descriptor,
)
from switchml.protocol.address import format_address
from switchml.protocol.errors import ConfigError
from switchml.ps.rules import AsyncStepRule, Decision, SyncStepRule
from switchml.ps.wire import (
    CONTROL_PAYLOAD_BYTES,
    Deadline,
    MessageType,
    PSError,
    recv_header,
    recv_payload,
    send_message,
)

__all__ = ["OPTIMIZERS", "ParameterServer", "ServerConfig"]

log = logging.getLogger(__name__)
OPTIMIZERS = ("sgd", "adam", "sum")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    workers: int
    """Number of worker processes (N)."""
    backup: int = 0
    """Backup workers b (synchronous mode): each step uses the first N - b gradients."""
    mode: str = "sync"
    """``sync`` (steps, backup workers) or ``async`` (every gradient applied on arrival)."""
    optimizer: str = "sgd"
    """``sgd`` (with ``momentum``), ``adam``, or ``sum`` (the shard becomes the sum of the
    step's gradients: an all-reduce through the servers, the benchmarks' baseline)."""
    lr: float = 0.05
    momentum: float = 0.0
    timeout_s: float = 60.0
    """How long a PULL waits for missing gradients before failing, naming the missing
    workers. Keep it above the slowest step."""
    max_shard_bytes: int = 1 << 30
    """The largest shard an INIT may bring; a PUSH must match its shard's size exactly.
    Anything announcing more is refused before a byte of it is read. Default 1 GiB."""
    max_connections: int | None = None
    """Workers' connections served at once (a thread each), counted from their HELLO; more
    are closed at once and counted. Default ``2 * workers + 8``: every worker, a
    reconnecting one, and some slack. Connections that have not said HELLO yet (or are in
    their TLS handshake) are limited apart, to as many: when they are all taken, a new one
    closes the oldest, so strangers can delay a worker by at most ``hello_timeout_s``, never
    keep it out."""
    hello_timeout_s: float = 5.0
    """How long a connection may take to finish its TLS handshake and say HELLO."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.mode not in ("sync", "async"):
            raise ConfigError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if self.mode == "sync" and not 0 <= self.backup < self.workers:
            raise ConfigError(f"backup workers must be in 0..{self.workers - 1}, got "
                              f"{self.backup}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; known: "
                              f"{', '.join(OPTIMIZERS)}")
        if self.lr <= 0 or self.timeout_s <= 0 or self.hello_timeout_s <= 0:
            raise ConfigError("lr, timeout_s and hello_timeout_s must be > 0")
        if self.max_shard_bytes < 4:
            raise ConfigError(f"max_shard_bytes must be >= 4, got {self.max_shard_bytes}")
        if self.max_connections is not None and self.max_connections < self.workers:
            raise ConfigError(f"max_connections must be >= workers ({self.workers}), got "
                              f"{self.max_connections}")


class _ShardState:
    def __init__(self, values: np.ndarray, cfg: ServerConfig) -> None:
        self.values = values
        self.rule: SyncStepRule | AsyncStepRule = (
            SyncStepRule(cfg.workers, cfg.backup) if cfg.mode == "sync"
            else AsyncStepRule(cfg.workers))
        self.opt: Any = None
        if cfg.optimizer != "sum":
            import torch
            self.param = torch.nn.Parameter(torch.from_numpy(values))
            self.opt = (torch.optim.SGD([self.param], lr=cfg.lr, momentum=cfg.momentum)
                        if cfg.optimizer == "sgd" else torch.optim.Adam([self.param], lr=cfg.lr))

    def apply(self, total: np.ndarray, count: int) -> None:
        if self.opt is None:
            self.values[:] = total
            return
        import torch
        if count > 1:
            total = total / np.float32(count)
        self.param.grad = torch.from_numpy(np.ascontiguousarray(total, dtype=np.float32))
        self.opt.step()


class ParameterServer:
    """One parameter server. ``start()`` serves in background threads; ``stop()`` ends it.

    Example::

        ps = ParameterServer(0, ServerConfig(workers=2), port=0).start()
        print(ps.address)
    """

    def __init__(self, index: int, config: ServerConfig, *, host: str = "127.0.0.1",
                 port: int = 0, security: LinkSecurity | None = None,
                 insecure: bool = False) -> None:
        """``security``: mutual TLS on every connection (``links.py``); required to listen
        beyond loopback unless ``insecure``.

        Raises:
            ConfigError: a non-loopback ``host`` without ``security`` or ``insecure``.
        """
        check_exposure(host, security, insecure=insecure, what=f"parameter server {index}")
        self.index = index
        self.config = config
        self.security = security
        self._tls = security.server_context() if security is not None else None
        if config.optimizer != "sum":
            import torch  # noqa: F401  # now, not under the lock at the first INIT (seconds)
        self._lsock = socket.socket()
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind((host, port))
        self._lsock.listen(256)
        self.address: tuple[str, int] = self._lsock.getsockname()[:2]
        self._cond = threading.Condition()
        self._shards: dict[int, _ShardState] = {}
        self._dead: dict[int, str] = {}
        self._finished: set[int] = set()
        self._stopping = False
        self._conns: list[tuple[socket.socket, threading.Thread]] = []
        # Connections before their HELLO, oldest first: their threads and file descriptors (a
        # TLS handshake detaches the socket object from its descriptor, not the descriptor).
        self._pending: dict[threading.Thread, int] = {}
        self._threads: list[threading.Thread] = []
        self._live: dict[int, str] = {}  # worker id -> the peer its connection comes from
        self._warn = WarningBudget(log)
        self._max_conns = config.max_connections or 2 * config.workers + 8
        self.counters = {"pushes": 0, "dropped_late": 0, "steps_applied": 0, "pulls": 0,
                         "bytes_in": 0, "bytes_out": 0, "refused_connections": 0,
                         "protocol_errors": 0, "pending_evicted": 0, "hello_timeouts": 0}

    def __repr__(self) -> str:
        return f"ps{self.index}@{format_address(self.address)}"

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> ParameterServer:
        t = threading.Thread(target=self._accept_loop, name=f"ps{self.index}-accept",
                             daemon=True)
        t.start()
        self._threads.append(t)
        log.info("parameter server %d listening on %s:%d (%s, %d workers, backup %d, %s; %s)",
                 self.index, *self.address, self.config.mode, self.config.workers,
                 self.config.backup, self.config.optimizer,
                 "mutual TLS" if self._tls is not None else "plain TCP, loopback")
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        try:
            self._lsock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._lsock.close()
        # Join every thread, the accept loop's too, before returning. A daemon thread that
        # outlives stop() holds a reference to this server; if it drops the last one while
        # the interpreter shuts down, it frees the shards' torch tensors there, torch's
        # deallocator releases the GIL, Python ends the thread with pthread_exit, and the
        # forced unwind through torch's C++ frames aborts the process ("terminate called
        # without an active exception", status -6: gdb showed THPVariable_dealloc ->
        # PyEval_RestoreThread -> PyThread_exit_thread in the accept thread).
        with self._cond:
            conns, self._conns = self._conns, []
        for conn, _t in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        me = threading.current_thread()
        for t in [t for _conn, t in conns] + self._threads:
            if t is not me:
                t.join(timeout=5.0)

    def __enter__(self) -> ParameterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_finished(self, timeout_s: float) -> bool:
        """Block until every worker said BYE or died (``stats()["dead_workers"]`` says which
        died); False if that did not happen within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._finished | set(self._dead)) < self.config.workers:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {**self.counters, "server": self.index, "shards": len(self._shards),
                    "dead_workers": dict(self._dead),
                    "versions": {k: s.rule.step for k, s in sorted(self._shards.items())}}

    def values(self, shard: int) -> np.ndarray:
        with self._cond:
            return self._shards[shard].values.copy()

    # -- connections ------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._lsock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self._serve, args=(conn, format_address(peer[:2])),
                                 daemon=True)
            with self._cond:  # stop() joins what it finds here: started, then
                self._conns = [(c, th) for c, th in self._conns if th.is_alive()]
                full = len(self._conns) - len(self._pending) >= self._max_conns
                if full:
                    self.counters["refused_connections"] += 1
                else:
                    if len(self._pending) >= self._max_conns:  # strangers: the oldest goes
                        shutdown_descriptor(self._pending.pop(next(iter(self._pending))))
                        self.counters["pending_evicted"] += 1
                    self._conns.append((conn, t))
                    self._pending[t] = conn.fileno()
                    t.start()
            if full:
                self._warn.warn("ps%d: refused a connection from %s: %d connections open "
                                "(max_connections)", self.index, format_address(peer[:2]),
                                self._max_conns)
                conn.close()

    def _refuse(self, peer: str, worker: int, why: str) -> None:
        """A connection broke the protocol: log it, count it, and cut off the worker it
        claimed to be (after its HELLO), so that nobody waits for it."""
        self._warn.warn("ps%d: %s (worker %d): %s", self.index, peer, worker, why)
        with self._cond:
            self.counters["protocol_errors"] += 1
            if worker >= 0:
                self._dead[worker] = f"protocol error: {why}"
                self._cond.notify_all()

    def _limit(self, mtype: MessageType, shard: int) -> int:
        """The most a message of this type may carry (bounded by the job's geometry)."""
        if mtype == MessageType.INIT:
            return self.config.max_shard_bytes
        if mtype == MessageType.PUSH:
            with self._cond:
                state = self._shards.get(shard)
            return self.config.max_shard_bytes if state is None else state.values.nbytes
        return CONTROL_PAYLOAD_BYTES

    def _serve(self, conn: socket.socket, peer: str) -> None:
        worker = -1
        try:
            if self._tls is not None and self.security is not None:
                tls = self._handshake(conn, peer)
                if tls is None:
                    return
                conn = tls
            # until its HELLO, all of it: a peer dribbling bytes does not stretch the bound
            hello = Deadline(conn, time.monotonic() + self.config.hello_timeout_s)
            while True:
                src = conn if worker >= 0 else hello
                try:
                    h = recv_header(src)
                    if worker < 0 and h.type != MessageType.HELLO:
                        # refused from its header: nothing read or allocated
                        raise PSError(f"{h.type.name} before HELLO")
                    payload = recv_payload(src, h, limit=self._limit(h.type, h.shard)
                                           if worker >= 0 else CONTROL_PAYLOAD_BYTES)
                except TimeoutError:
                    if worker >= 0:
                        raise
                    with self._cond:
                        self.counters["hello_timeouts"] += 1
                    self._warn.warn("ps%d: closed a connection from %s: no HELLO within "
                                    "%g s", self.index, peer, self.config.hello_timeout_s)
                    return
                self.counters["bytes_in"] += 24 + h.nbytes
                if h.type == MessageType.HELLO:
                    if worker >= 0:
                        raise PSError(f"a second HELLO (as worker {h.worker})")
                    worker = self._handle_hello(conn, h.worker, bytes(payload), peer)
                    conn.settimeout(None)  # a worker may be idle between steps
                    with self._cond:
                        self._pending.pop(threading.current_thread(), None)
                elif self._handle(conn, worker, h, payload):
                    return  # BYE
        except (ConnectionError, OSError) as exc:
            if worker >= 0 and not self._stopping:
                log.warning("ps%d: worker %d died: %s", self.index, worker, exc)
                with self._cond:
                    self._dead[worker] = f"connection lost ({exc})"
                    self._cond.notify_all()
        except (PSError, ValueError) as exc:
            self._refuse(peer, worker, str(exc))
            try:
                send_message(conn, MessageType.ERROR, payload=f"ps{self.index}: {exc}".encode())
            except OSError:
                pass
        finally:
            with self._cond:
                self._pending.pop(threading.current_thread(), None)
                if worker >= 0 and self._live.get(worker) == peer:
                    del self._live[worker]
            conn.close()

    def _handshake(self, raw: socket.socket, peer: str) -> socket.socket | None:
        """The TLS server side of a new connection within the HELLO timeout: the TLS socket
        (which ``stop()`` shuts down from then on), or None, refused and counted."""
        assert self._tls is not None and self.security is not None
        try:
            conn = self.security.accept(raw, self._tls, self.config.hello_timeout_s)
        except (OSError, ValueError) as exc:
            with self._cond:
                self.counters["refused_connections"] += 1
            self._warn.warn("ps%d: refused a connection from %s: TLS handshake failed: %s",
                            self.index, peer, exc)
            return None
        with self._cond:  # (raw is detached)
            self._conns = [(conn if c is raw else c, t) for c, t in self._conns]
        return conn

    def _handle(self, conn: socket.socket, worker: int, h: Any, payload: Any) -> bool:
        """One message of a worker after its HELLO; whether it said BYE.

        Raises:
            PSError: a message type a worker does not send (HELLO is the caller's)."""
        if h.type == MessageType.INIT:
            self._handle_init(worker, h.shard, payload)
        elif h.type == MessageType.PUSH:
            self._handle_push(worker, h.shard, h.step, payload)
        elif h.type == MessageType.PULL:
            self._handle_pull(conn, h.shard, h.step)
        elif h.type == MessageType.STATS:
            send_message(conn, MessageType.STATS, payload=json.dumps(self.stats()).encode())
        elif h.type == MessageType.BYE:
            with self._cond:
                self._finished.add(worker)
                self._cond.notify_all()
            return True
        else:
            raise PSError(f"unexpected {h.type.name} from worker {worker}")
        return False

    def _handle_hello(self, conn: socket.socket, worker: int, payload: bytes,
                      peer: str) -> int:
        try:
            opts = json.loads(payload or b"{}")
        except (ValueError, RecursionError) as exc:  # (RecursionError: JSON nested too deep)
            raise PSError(f"HELLO options are not valid JSON: {type(exc).__name__}") from None
        if not isinstance(opts, dict):
            raise PSError("HELLO options must be a JSON object")
        if opts.get("workers", self.config.workers) != self.config.workers:
            raise PSError(f"worker {worker} expects {opts['workers']} workers, this server "
                          f"was started for {self.config.workers}")
        if not 0 <= worker < self.config.workers:
            raise PSError(f"worker id {worker} out of range 0..{self.config.workers - 1}")
        wrong = identity_conflict(conn, "worker", worker)
        if wrong is not None:
            raise PSError(f"a HELLO as worker {worker}, but {wrong}")
        with self._cond:
            if worker in self._live:  # refused without cutting the live one off
                raise PSError(f"worker id {worker} is already connected (from "
                              f"{self._live[worker]})") from None
            self._live[worker] = peer
            self._dead.pop(worker, None)  # a restarted worker (its connection had died)
        send_message(conn, MessageType.HELLO, worker=worker, shard=self.index,
                     payload=json.dumps({"mode": self.config.mode}).encode())
        return worker

    def _handle_init(self, worker: int, shard: int, payload: memoryview) -> None:
        if not payload.nbytes or payload.nbytes % 4:
            raise PSError(f"worker {worker}: INIT of shard {shard} with {payload.nbytes} bytes "
                          "(float32 values expected)")
        with self._cond:
            if shard not in self._shards:  # the first INIT wins; every worker's is the same
                values = np.frombuffer(payload, dtype=np.float32).copy()
                self._shards[shard] = _ShardState(values, self.config)
                self._cond.notify_all()

    def _handle_push(self, worker: int, shard: int, step: int, payload: memoryview) -> None:
        grad = np.frombuffer(payload, dtype=np.float32)
        deadline = time.monotonic() + self.config.timeout_s
        with self._cond:
            # Another worker's INIT may still be on its way (another connection): wait for it.
            while (state := self._shards.get(shard)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    raise PSError(f"worker {worker} pushed to shard {shard}, which this server "
                                  f"does not hold (no INIT within {self.config.timeout_s:g} s)")
                self._cond.wait(min(left, 0.5))
            if grad.size != state.values.size:
                raise PSError(f"worker {worker} pushed {grad.size} elements to shard {shard} "
                              f"of {state.values.size}")
            self.counters["pushes"] += 1
            decision = state.rule.offer(worker=worker, step=step, grad=grad)
            if decision is Decision.DROPPED_LATE:
                self.counters["dropped_late"] += 1
            elif decision is Decision.COMPLETED:
                total, who = state.rule.take_sum()
                state.apply(total, len(who))
                self.counters["steps_applied"] += 1
                self._cond.notify_all()

    def _blocked_reason(self, shard: int, version: int) -> str | None:
        """Why shard ``shard`` can never reach ``version`` (dead workers), or None."""
        state = self._shards.get(shard)
        if state is None or not self._dead or not isinstance(state.rule, SyncStepRule):
            return None
        rule = state.rule
        alive = [w for w in range(self.config.workers)
                 if w not in rule.pending and w not in self._dead]
        if len(rule.pending) + len(alive) < rule.needed:
            dead = ", ".join(f"worker {w} ({why})" for w, why in sorted(self._dead.items()))
            return (f"shard {shard} cannot complete step {rule.step}: {dead}; "
                    f"{len(rule.pending)} of {rule.needed} gradients in")
        return None

    def _handle_pull(self, conn: socket.socket, shard: int, version: int) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        with self._cond:
            while True:
                state = self._shards.get(shard)
                if state is not None and state.rule.step >= version:
                    values, current = state.values.copy(), state.rule.step
                    break
                reason = self._blocked_reason(shard, version)
                if reason is not None:
                    raise PSError(reason)
                if self._stopping:
                    raise PSError("server stopping")
                left = deadline - time.monotonic()
                if left <= 0:
                    if state is None:
                        raise PSError(f"shard {shard} was never initialised (no INIT within "
                                      f"{self.config.timeout_s:g} s)")
                    rule = state.rule
                    missing = [w for w in range(self.config.workers)
                               if isinstance(rule, SyncStepRule) and w not in rule.pending]
                    raise PSError(f"shard {shard} step {rule.step}: no gradient from worker(s) "
                                  f"{missing} within {self.config.timeout_s:g} s")
                self._cond.wait(min(left, 0.5))
            self.counters["pulls"] += 1
        self.counters["bytes_out"] += send_message(conn, MessageType.PARAMS, shard=shard,
                                                   step=current, payload=values)
