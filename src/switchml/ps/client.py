"""A worker's connections to every parameter server: init, push gradients, pull parameters.

Every call is bounded: an answer's header must arrive within ``timeout_s`` of the call, and
its payload within ``timeout_s`` more plus its size at ``MIN_ANSWER_BYTES_PER_S`` (a server
that dribbles its bytes cannot stretch the wait); a server that does not answer in time,
closes the connection, replies ERROR or replies what is not an answer raises
:class:`PSError` naming the server (``ps1 at 10.0.0.5:40001``) and what it was asked.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from switchml.links import LinkSecurity, dial
from switchml.protocol.address import Address, format_address
from switchml.ps.placement import Shard
from switchml.ps.wire import (
    CONTROL_PAYLOAD_BYTES,
    Deadline,
    MessageType,
    PSError,
    recv_header,
    recv_payload,
    send_message,
)

__all__ = ["PSClient"]

MIN_ANSWER_BYTES_PER_S = 1 << 20
"""The slowest an answer's payload may arrive (beyond ``timeout_s``): 1 MiB/s, far below any
link a parameter server runs on; a server slower than that is treated as gone."""
STATS_BYTES = 1 << 20
"""The most a server's STATS answer may carry (its counters as JSON)."""


class PSClient:
    """Connections from worker ``worker`` (of ``workers``) to the servers, in server order."""

    def __init__(self, servers: Sequence[Address], *, worker: int, workers: int | None,
                 timeout_s: float = 60.0, connect_timeout_s: float = 30.0,
                 security: LinkSecurity | None = None) -> None:
        """``security``: mutual TLS to every server (``links.py``); the servers must have
        credentials from the same CA."""
        self.security = security
        self._tls = security.client_context() if security is not None else None
        if not servers:
            raise PSError("no parameter servers given")
        self.servers = [tuple(a) for a in servers]
        self.worker = worker
        self.bytes_sent = 0
        self.bytes_received = 0
        self._socks: list[socket.socket] = []
        try:
            for i, addr in enumerate(self.servers):
                self._socks.append(self._connect(i, addr, workers, timeout_s,
                                                 connect_timeout_s))
        except BaseException:
            self.close(bye=False)
            raise

    def _name(self, i: int) -> str:
        return f"ps{i} at {format_address(self.servers[i])}"

    def _connect(self, i: int, addr: Address, workers: int | None, timeout_s: float,
                 connect_timeout_s: float) -> socket.socket:
        # servers may still be starting: dial retries until the deadline
        sock = dial(addr, what=f"parameter server {self._name(i)}",
                    connect_timeout_s=connect_timeout_s, io_timeout_s=timeout_s, retry_s=0.1,
                    security=self.security, ctx=self._tls, role="server", index=i,
                    claims=f"shard {i}", error=PSError)
        opts = {} if workers is None else {"workers": workers}  # None: the server's count
        send_message(sock, MessageType.HELLO, worker=self.worker,
                     payload=json.dumps(opts).encode())
        self._expect(i, sock, MessageType.HELLO, "hello")
        return sock

    def _expect(self, i: int, sock: socket.socket, mtype: MessageType, what: str,
                into: memoryview | None = None, limit: int = CONTROL_PAYLOAD_BYTES
                ) -> tuple[Any, memoryview]:
        """The server's answer, of at most ``limit`` bytes (what this answer can hold: a
        server that announces more is refused before anything is read or allocated)."""
        timeout = sock.gettimeout()

        def bounded(extra_s: float) -> socket.socket | Deadline:
            return sock if timeout is None else Deadline(sock, time.monotonic() + timeout
                                                         + extra_s)
        try:
            h = recv_header(bounded(0.0))
            payload = recv_payload(bounded(h.nbytes / MIN_ANSWER_BYTES_PER_S), h, into,
                                   limit=limit)
        except TimeoutError as exc:
            raise PSError(f"parameter server {self._name(i)} did not answer {what} within "
                          f"{timeout:g} s (its header), or its payload within that and its "
                          f"size at {MIN_ANSWER_BYTES_PER_S >> 20} MiB/s") from exc
        except (ConnectionError, OSError) as exc:
            raise PSError(f"parameter server {self._name(i)} closed the connection during "
                          f"{what} (dead?): {exc}") from exc
        finally:
            sock.settimeout(timeout)  # (a Deadline set it to what was left)
        self.bytes_received += 24 + h.nbytes
        if h.type == MessageType.ERROR:
            raise PSError(f"parameter server {self._name(i)} failed {what}: "
                          f"{bytes(payload).decode(errors='replace')}")
        if h.type != mtype:
            raise PSError(f"parameter server {self._name(i)} answered {what} with "
                          f"{h.type.name}")
        return h, payload

    def _send(self, i: int, mtype: MessageType, what: str, **kw: Any) -> None:
        try:
            self.bytes_sent += send_message(self._socks[i], mtype, worker=self.worker, **kw)
        except TimeoutError as exc:
            raise PSError(f"parameter server {self._name(i)} did not take {what} within "
                          f"the timeout") from exc
        except OSError as exc:
            raise PSError(f"parameter server {self._name(i)} closed the connection during "
                          f"{what} (dead?): {exc}") from exc

    def init(self, shards: Sequence[Shard], values: Mapping[int, np.ndarray]) -> None:
        """Offer each shard's initial values (the first worker's INIT wins on the server)."""
        for s in shards:
            self._send(s.server, MessageType.INIT, f"init of shard {s.shard_id}",
                       shard=s.shard_id, payload=np.ascontiguousarray(values[s.shard_id]))

    def push(self, shards: Sequence[Shard], step: int, grads: Mapping[int, np.ndarray]) -> None:
        for s in shards:
            self._send(s.server, MessageType.PUSH, f"push of shard {s.shard_id} step {step}",
                       shard=s.shard_id, step=step,
                       payload=np.ascontiguousarray(grads[s.shard_id], dtype=np.float32))

    def pull(self, shards: Sequence[Shard], version: int,
             out: Mapping[int, np.ndarray]) -> int:
        """Fetch every shard once its version is >= ``version`` into ``out[shard_id]``;
        returns the smallest version received."""
        for s in shards:
            self._send(s.server, MessageType.PULL, f"pull of shard {s.shard_id}",
                       shard=s.shard_id, step=version)
        got = []
        for s in shards:
            buf = out[s.shard_id]
            h, payload = self._expect(s.server, self._socks[s.server], MessageType.PARAMS,
                                      f"pull of shard {s.shard_id} version {version}",
                                      memoryview(buf).cast("B"),
                                      limit=max(buf.nbytes, CONTROL_PAYLOAD_BYTES))
            if h.nbytes != buf.nbytes:
                raise PSError(f"parameter server {self._name(s.server)} sent {h.nbytes} bytes "
                              f"for shard {s.shard_id} of {buf.nbytes}")
            got.append(h.step)
        return min(got)

    def stats(self) -> list[dict[str, Any]]:
        out = []
        for i, sock in enumerate(self._socks):
            self._send(i, MessageType.STATS, "stats")
            _, payload = self._expect(i, sock, MessageType.STATS, "stats", limit=STATS_BYTES)
            try:
                out.append(json.loads(bytes(payload)))
            except ValueError as exc:  # (UnicodeDecodeError and JSONDecodeError included)
                raise PSError(f"parameter server {self._name(i)} answered stats with what is "
                              f"not JSON: {exc}") from exc
        return out

    def close(self, bye: bool = True) -> None:
        for sock in self._socks:
            try:
                if bye:
                    send_message(sock, MessageType.BYE, worker=self.worker)
            except OSError:
                pass
            sock.close()
        self._socks = []

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(bye=exc[0] is None)
