"""How a live rank's state reaches a replacement (``switchml.torch.live``): one TCP stream from
the live rank to the replacement, which listens for it, proven by the one-time nonce the
replacement put in its request (docs/torch.md, "Replicas that come and go").

The stream::

    "SMS1" | nonce (16 bytes) | u32 n | position (n bytes, ``Position.to_bytes``)
           | u32 n | DDP's bucket layouts (n bytes of JSON) | u32 n | the state's skeleton
           (n bytes, ``torch.save`` of the state with every tensor on the meta device)
           | u64 n | every tensor's bytes, in the skeleton's flattening order (n bytes)

The tensors' bytes go out of the tensors' memory as they are (``sendall`` without the GIL)
and land in tensors allocated from the skeleton (``recv_into``): nothing is pickled but the
skeleton, and no copy of the whole state is made on either side beyond the live rank's
snapshot. A connection that does not open with the nonce is closed and counted; the
replacement goes on listening until its deadline.
"""

from __future__ import annotations

import hmac
import io
import json
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from switchml.protocol.worker_ahead import Position

__all__ = ["MAGIC", "NONCE_BYTES", "StateRefused", "receive_state", "route_address",
           "send_state"]

MAGIC = b"SMS1"
NONCE_BYTES = 16
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
OPENING_S = 2.0
"""How long a connection to the listener has to prove itself."""
_LIMITS = {"position": 1 << 20, "layouts": 64 << 20, "skeleton": 64 << 20}


class StateRefused(Exception):
    """A connection to a replacement's listener that did not prove itself (no magic, or
    another nonce): closed, counted, and the replacement goes on listening."""


def route_address(host: str, port: int) -> str:
    """This host's address on its route to ``host:port`` (what a UDP socket connected there
    sends from; nothing is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A dense tensor's bytes (contiguous), as a writable or readable buffer."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def send_state(address: tuple[str, int], nonce: bytes, position: Position,
               layouts: dict[int, tuple[int, ...]], state: dict[str, Any], *,
               timeout_s: float) -> int:
    """Connect to a replacement's listener at ``address`` and send it ``state`` (tensors,
    numbers, strings, dicts, lists: what ``torch.load(weights_only=True)`` reads) with
    ``position`` and ``layouts``. Returns the bytes sent.

    Raises:
        ValueError: a tensor that is not dense and strided (sparse, nested, quantized).
        OSError: the connection failed (the replacement is gone, or its address unreachable).
    """
    leaves, _ = tree_flatten(state)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    for t in tensors:
        if t.layout is not torch.strided or t.is_quantized or t.is_nested:
            raise ValueError(f"a tensor of layout {t.layout} cannot be sent: dense tensors only")
    tensors = [t.contiguous() for t in tensors]
    skeleton = io.BytesIO()
    torch.save(tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                        if isinstance(t, torch.Tensor) else t, state), skeleton)
    where = position.to_bytes()
    buckets = json.dumps({str(k): v for k, v in layouts.items()}).encode()
    total = sum(t.numel() * t.element_size() for t in tensors)
    head = b"".join([MAGIC, nonce, _U32.pack(len(where)), where, _U32.pack(len(buckets)),
                     buckets, _U32.pack(skeleton.tell()), skeleton.getvalue(),
                     _U64.pack(total)])
    with socket.create_connection(address, timeout=timeout_s) as conn:
        conn.sendall(head)
        for t in tensors:
            if t.numel():
                conn.sendall(_tensor_bytes(t))
    return len(head) + total


def receive_state(listener: socket.socket, nonce: bytes, deadline: float, *,
                  refused: Callable[[str], None] = lambda why: None
                  ) -> tuple[Position, dict[int, tuple[int, ...]], dict[str, Any]]:
    """Accept connections on ``listener`` until one proves ``nonce`` and sends a state
    (``send_state``), or ``deadline`` (``time.monotonic()``) passes. Each connection that
    does not prove itself is closed and reported to ``refused`` (why, and who).

    Raises:
        TimeoutError: no proven stream before the deadline.
        ValueError, EOFError: a proven stream that is not a whole state (its sender died
            mid-way, or sent something else).
    """
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no live rank connected with the state")
        listener.settimeout(left)
        try:
            conn, peer = listener.accept()
        except TimeoutError:
            raise TimeoutError("no live rank connected with the state") from None
        with conn:
            # (A live rank opens with the nonce at once: a peer that holds a connection open
            # saying nothing is dropped after OPENING_S, not at the deadline.)
            conn.settimeout(max(min(deadline - time.monotonic(), OPENING_S), 0.001))
            try:
                opening = _read(conn, len(MAGIC) + NONCE_BYTES)
                if opening[:len(MAGIC)] != MAGIC or not hmac.compare_digest(
                        opening[len(MAGIC):], nonce):
                    raise StateRefused("it did not open with this request's nonce")
            except (StateRefused, EOFError, OSError) as exc:
                refused(f"{peer[0]}:{peer[1]}: {exc}")
                continue
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            return _read_state(conn)


def _read_state(conn: socket.socket
                ) -> tuple[Position, dict[int, tuple[int, ...]], dict[str, Any]]:
    parts = {}
    for what in ("position", "layouts", "skeleton"):
        (n,) = _U32.unpack(_read(conn, _U32.size))
        if n > _LIMITS[what]:
            raise ValueError(f"its {what} is {n} bytes, more than {_LIMITS[what]}")
        parts[what] = _read(conn, n)
    position = Position.from_bytes(parts["position"])
    raw = json.loads(parts["layouts"])
    if not isinstance(raw, dict):
        raise ValueError("its bucket layouts are not a JSON object")
    layouts = {int(k): tuple(int(i) for i in v) for k, v in raw.items()}
    skeleton = torch.load(io.BytesIO(parts["skeleton"]), weights_only=True)
    if not isinstance(skeleton, dict):
        raise ValueError("its state is not a dict")
    leaves, spec = tree_flatten(skeleton)
    for t in leaves:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            raise ValueError("its skeleton holds a tensor with data")
    (total,) = _U64.unpack(_read(conn, _U64.size))
    expect = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
    if total != expect:
        raise ValueError(f"it announces {total} bytes of tensors; its skeleton's are {expect}")
    filled = []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            t = torch.empty(t.shape, dtype=t.dtype)
            if t.numel():
                _read_into(conn, _tensor_bytes(t))
        filled.append(t)
    return position, layouts, tree_unflatten(filled, spec)


def _read(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(conn, memoryview(buf))
    return bytes(buf)


def _read_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:])
        if not k:
            raise EOFError(f"the stream ended {len(view) - got} bytes short")
        got += k
