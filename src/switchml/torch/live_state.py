"""How a live rank's state reaches a replacement (``switchml.torch.live``): one TCP stream from
the live rank to the replacement, which listens for it, proven with the one-time nonce the
replacement put in its request and, where the job has one, the secret (docs/torch.md,
"Replicas that come and go").

The stream::

    "SMS2" | proof (32 bytes) | u32 n | position (n bytes, ``Position.to_bytes``)
           | u32 n | DDP's bucket layouts (n bytes of JSON) | u32 n | the state's skeleton
           (n bytes, ``torch.save`` of the state with every tensor on the meta device)
           | u64 n | every tensor's bytes, in the skeleton's flattening order (n bytes)
           | tag (32 bytes)

``proof`` is HMAC-SHA256(secret, "open" | nonce), and ``tag`` HMAC-SHA256(secret, nonce |
everything between the proof and the tag); without a secret the key is empty, and the nonce
alone proves the sender (it travels in the store: a listener beyond loopback then needs the
caller's explicit ``insecure``, as the project's other servers do).

The tensors' bytes go out of the tensors' memory as they are (``sendall`` without the GIL)
and land in tensors allocated from the skeleton (``recv_into``): nothing is pickled but the
skeleton, and no copy of the whole state is made on either side beyond the live rank's
snapshot. The listener handles connections' openings side by side (``selectors``), each
within ``OPENING_S`` all told: a connection that does not prove itself in time is closed and
counted, and the replacement goes on listening until its deadline.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import selectors
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from switchml.links import is_loopback
from switchml.protocol.errors import ConfigError
from switchml.protocol.worker_ahead import Position

__all__ = ["MAGIC", "NONCE_BYTES", "OPENING_S", "check_listener", "receive_state",
           "route_address", "send_state"]


MAGIC = b"SMS2"
NONCE_BYTES = 16
_MAC = 32
OPENING_S = 2.0
"""How long, all told, a connection to the listener has to prove itself."""
MAX_PENDING = 64
"""Connections proving themselves at once; one more closes the oldest of them (a stranger who
keeps that many open cannot keep the live rank's out: its proof is read the moment it
arrives)."""
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_LIMITS = {"position": 1 << 20, "layouts": 64 << 20, "skeleton": 64 << 20}


def route_address(host: str, port: int) -> str:
    """This host's address on its route to ``host:port`` (what a UDP socket connected there
    sends from; nothing is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def check_listener(host: str, secret: bytes | None, *, insecure: bool = False) -> None:
    """Refuse a state listener beyond loopback without a secret.

    Raises:
        ConfigError: ``host`` is not loopback, ``secret`` is None, and not ``insecure``.
    """
    if secret is None and not insecure and not is_loopback(host):
        raise ConfigError(
            f"the state listener would listen on {host} with no secret: whoever reads the "
            "store's request could send this replica a model. Set SWITCHML_SECRET (or "
            "LiveQuorum(state_secret=)) on every replica, listen on loopback "
            "(state_host=), or pass LiveQuorum(insecure=True)")


def _proof(secret: bytes | None, nonce: bytes) -> bytes:
    return MAGIC + hmac.new(secret or b"", b"open" + nonce, hashlib.sha256).digest()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A dense CPU tensor's bytes (contiguous), as a writable or readable buffer."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def send_state(address: tuple[str, int], nonce: bytes, position: Position,
               layouts: dict[int, tuple[int, ...]], state: dict[str, Any], *,
               timeout_s: float, secret: bytes | None = None,
               numbered: int | None = None) -> int:
    """Connect to a replacement's listener at ``address`` and send it ``state`` (CPU
    tensors, numbers, strings, dicts, lists: what ``torch.load(weights_only=True)`` reads)
    with ``position`` and ``layouts`` (and ``numbered``: the sender's failover number of its
    next operation, beside the layouts). Returns the bytes sent.

    Raises:
        ValueError: a tensor that is not a dense CPU tensor (sparse, nested, quantized, on
            a device: copy it to the CPU first).
        OSError: the connection failed (the replacement is gone, or its address unreachable).
    """
    leaves, _ = tree_flatten(state)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    for t in tensors:
        if t.layout is not torch.strided or t.is_quantized or t.is_nested:
            raise ValueError(f"a tensor of layout {t.layout} cannot be sent: dense tensors only")
        if t.device.type != "cpu":
            raise ValueError(f"a tensor on {t.device} cannot be sent: copy the state to the CPU")
    tensors = [t.detach().contiguous() for t in tensors]
    skeleton = io.BytesIO()
    torch.save(tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                        if isinstance(t, torch.Tensor) else t, state), skeleton)
    where = position.to_bytes()
    buckets = json.dumps({**{str(k): v for k, v in layouts.items()},
                          **({"numbered": numbered} if numbered is not None else {})}).encode()
    total = sum(t.numel() * t.element_size() for t in tensors)
    body = b"".join([_U32.pack(len(where)), where, _U32.pack(len(buckets)), buckets,
                     _U32.pack(skeleton.tell()), skeleton.getvalue(), _U64.pack(total)])
    mac = hmac.new(secret or b"", nonce, hashlib.sha256)
    mac.update(body)
    with socket.create_connection(address, timeout=timeout_s) as conn:
        conn.sendall(_proof(secret, nonce) + body)
        for t in tensors:
            if t.numel():
                data = _tensor_bytes(t)
                mac.update(data)
                conn.sendall(data)
        conn.sendall(mac.digest())
    return len(MAGIC) + _MAC + len(body) + total + _MAC


def receive_state(listener: socket.socket, nonce: bytes, deadline: float, *,
                  secret: bytes | None = None,
                  refused: Callable[[str], None] = lambda why: None,
                  on_position: Callable[[Position], None] = lambda position: None,
                  extras: dict[str, Any] | None = None
                  ) -> tuple[Position, dict[int, tuple[int, ...]], dict[str, Any]]:
    """Accept connections on ``listener`` until one proves ``nonce`` (and ``secret``) and
    sends a state (``send_state``), or ``deadline`` (``time.monotonic()``) passes. Openings
    are read side by side, each within ``OPENING_S``, at most ``MAX_PENDING`` at once (one
    more closes the oldest); each connection that does not prove itself is closed and
    reported to ``refused`` (who, and why). ``on_position`` gets the
    position as soon as it is read, before the state (``WorkerClient.pin``). ``extras``
    receives ``numbered`` where the sender sent it.

    Raises:
        TimeoutError: no proven stream before the deadline.
        ValueError, EOFError, OSError: a proven stream that is not a whole state, or whose
            tag does not verify (its sender died mid-way, or sent something else).
    """
    expect = _proof(secret, nonce)
    pending: dict[socket.socket, tuple[bytearray, float, str]] = {}
    sel = selectors.DefaultSelector()
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ)

    def drop(conn: socket.socket, why: str) -> None:
        _, _, who = pending.pop(conn)
        sel.unregister(conn)
        conn.close()
        refused(f"{who}: {why}")

    try:
        while True:
            if listener.fileno() == -1:
                raise OSError("the state listener was closed")
            now = time.monotonic()
            for conn, (_, until, _) in list(pending.items()):
                if now >= until:
                    drop(conn, f"it did not prove itself within {OPENING_S:g} s")
            if now >= deadline:
                raise TimeoutError("no live rank connected with the state")
            wake = min([deadline, now + 0.25] + [until for _, until, _ in pending.values()])
            for key, _ in sel.select(max(wake - now, 0.001)):
                if key.fileobj is listener:
                    try:
                        conn, peer = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    who = f"{peer[0]}:{peer[1]}"
                    if len(pending) >= MAX_PENDING:  # the oldest goes, not the newcomer
                        oldest = min(pending, key=lambda c: pending[c][1])
                        drop(oldest, f"{MAX_PENDING} newer connections were proving "
                                     "themselves")
                    conn.setblocking(False)
                    pending[conn] = (bytearray(), time.monotonic() + OPENING_S, who)
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj  # type: ignore[assignment]
                buf = pending[conn][0]
                try:
                    chunk = conn.recv(len(expect) - len(buf))
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    drop(conn, str(exc))
                    continue
                if not chunk:
                    drop(conn, "it closed before proving itself")
                    continue
                buf += chunk
                if len(buf) < len(expect):
                    continue
                if not hmac.compare_digest(bytes(buf), expect):
                    drop(conn, "it did not prove this request (nonce or secret)")
                    continue
                del pending[conn]
                sel.unregister(conn)
                with conn:
                    conn.setblocking(True)
                    return _read_state(conn, deadline, hmac.new(secret or b"", nonce,
                                                                hashlib.sha256), on_position,
                                       extras if extras is not None else {})
    finally:
        for conn, (_, _, who) in pending.items():
            conn.close()
            refused(f"{who}: closed unproven as the listener stopped")
        sel.close()


def _read_state(conn: socket.socket, deadline: float, mac: Any,
                on_position: Callable[[Position], None], extras: dict[str, Any]
                ) -> tuple[Position, dict[int, tuple[int, ...]], dict[str, Any]]:
    def read(n: int) -> bytes:
        buf = bytearray(n)
        _read_into(conn, memoryview(buf), deadline)
        mac.update(buf)
        return bytes(buf)

    parts = {}
    for what in ("position", "layouts", "skeleton"):
        (n,) = _U32.unpack(read(_U32.size))
        if n > _LIMITS[what]:
            raise ValueError(f"its {what} is {n} bytes, more than {_LIMITS[what]}")
        parts[what] = read(n)
    position = Position.from_bytes(parts["position"])
    on_position(position)  # (proven by the opening; the tag is checked at the end)
    raw = json.loads(parts["layouts"])
    if not isinstance(raw, dict):
        raise ValueError("its bucket layouts are not a JSON object")
    numbered = raw.pop("numbered", None)
    if numbered is not None and not (isinstance(numbered, int) and numbered >= 0):
        raise ValueError(f"its operation number is not one: {numbered!r}")
    layouts = {int(k): tuple(int(i) for i in v) for k, v in raw.items()}
    skeleton = torch.load(io.BytesIO(parts["skeleton"]), weights_only=True)
    if not isinstance(skeleton, dict):
        raise ValueError("its state is not a dict")
    leaves, spec = tree_flatten(skeleton)
    for t in leaves:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            raise ValueError("its skeleton holds a tensor with data")
    (total,) = _U64.unpack(read(_U64.size))
    expect = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
    if total != expect:
        raise ValueError(f"it announces {total} bytes of tensors; its skeleton's are {expect}")
    filled = []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            t = torch.empty(t.shape, dtype=t.dtype)
            if t.numel():
                data = _tensor_bytes(t)
                _read_into(conn, data, deadline)
                mac.update(data)
        filled.append(t)
    tag = bytearray(_MAC)
    _read_into(conn, memoryview(tag), deadline)
    if not hmac.compare_digest(bytes(tag), mac.digest()):
        raise ValueError("its tag does not verify (altered on the way, or another secret)")
    if numbered is not None:  # (the tag verified above)
        extras["numbered"] = numbered
    return position, layouts, tree_unflatten(filled, spec)


def _read_into(conn: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the state's stream did not finish by the deadline")
        conn.settimeout(left)
        k = conn.recv_into(view[got:])
        if not k:
            raise EOFError(f"the stream ended {len(view) - got} bytes short")
        got += k
