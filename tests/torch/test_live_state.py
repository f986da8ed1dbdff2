"""The stream that carries a live rank's state to a replacement (``switchml.torch.live_state``):
the state arrives whole and equal to what was sent (checked against the sender's tensors, dtype
by dtype), only a connection that proves the request's nonce (and the secret) is read, slow or
silent connections neither stall nor block the real sender, a stream altered on the way fails
its tag, and a stream that is not a state, or none at all, ends in a clear error within the
deadline."""

from __future__ import annotations

import collections
import socket
import threading
import time

import pytest
import torch

from switchml.protocol.worker_ahead import Position
from switchml.torch import live_state as ls

NONCE = bytes(range(16))
POSITION = Position((7, 1 << 31), (b"\x00\x01\x01", b"\x01\x00\x00"))
LAYOUTS = {0: (3, 2), 1: (1, 0)}


def _state():
    g = torch.Generator().manual_seed(5)
    return {"model": collections.OrderedDict(
                w=torch.randn(4, 3, generator=g),
                t=torch.randn(3, 5, generator=g).t(),  # not contiguous
                h=torch.randn(6, generator=g).to(torch.bfloat16),
                mask=torch.tensor([True, False, True]), empty=torch.zeros(0, 2)),
            "opt": {"state": {0: {"step": torch.tensor(3.0), "m": torch.arange(5.0)}},
                    "param_groups": [{"lr": 0.1, "params": [0], "nesterov": False,
                                      "name": None}]},
            "step": 12}


def _listener():
    return socket.create_server(("127.0.0.1", 0))


def _send_later(address, nonce=NONCE, state=None, delay_s=0.0, secret=None):
    errors = []

    def run():
        time.sleep(delay_s)
        try:
            ls.send_state(address, nonce, POSITION, LAYOUTS, state or _state(), timeout_s=10,
                          secret=secret)
        except Exception as exc:  # noqa: BLE001 - a test's reader may close early
            errors.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return (type(a) is type(b) and list(a) == list(b)
                and all(_equal(a[k], b[k]) for k in a))
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_a_state_arrives_whole_and_equal_to_what_was_sent():
    with _listener() as lst:
        t, errors = _send_later(lst.getsockname())
        position, layouts, state = ls.receive_state(lst, NONCE, time.monotonic() + 10)
    t.join(10)
    assert not errors
    assert position == POSITION and layouts == LAYOUTS
    assert _equal(_state(), state)
    assert type(state["model"]) is collections.OrderedDict


def test_the_senders_operation_number_travels_beside_the_layouts():
    """A live rank with a failover sends the number of its next operation (its failover's
    count, which the worker's sequence numbers need not match); the receiver gets it in
    ``extras``, once the tag verified, and the layouts without it. Without one, none."""
    for numbered in (123456, None):
        extras = {}
        with _listener() as lst:
            t = threading.Thread(target=ls.send_state, args=(
                lst.getsockname(), NONCE, POSITION, LAYOUTS, _state()),
                kwargs={"timeout_s": 10, "numbered": numbered}, daemon=True)
            t.start()
            _, layouts, _ = ls.receive_state(lst, NONCE, time.monotonic() + 10, extras=extras)
        t.join(10)
        assert layouts == LAYOUTS
        assert extras == ({"numbered": numbered} if numbered is not None else {})


def test_only_a_connection_that_proves_the_nonce_is_read():
    """Another nonce, a stranger's bytes and a connection that says nothing (held past the
    opening's limit) are each closed and reported; the live rank's stream that follows is
    read, and its state is the one sent."""
    refused = []
    with _listener() as lst:
        address = lst.getsockname()
        _, other = _send_later(address, nonce=bytes(16))
        time.sleep(0.3)
        with socket.create_connection(address) as stranger:
            stranger.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(16))
            silent = socket.create_connection(address)
            real, errors = _send_later(address, delay_s=0.5)
            old = ls.OPENING_S
            ls.OPENING_S = 0.3
            try:
                _, _, state = ls.receive_state(lst, NONCE, time.monotonic() + 10,
                                               refused=refused.append)
            finally:
                ls.OPENING_S = old
                silent.close()
    real.join(10)
    assert not errors and _equal(_state(), state)
    assert len(refused) == 3, refused
    # (the stranger's 34 bytes are short of a proof: it waits, then times out)
    assert sum("did not prove this request" in why for why in refused) == 1, refused
    assert sum("within 0.3 s" in why for why in refused) == 2, refused


def test_no_state_by_the_deadline_is_a_timeout_error():
    with _listener() as lst:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no live rank"):
            ls.receive_state(lst, NONCE, t0 + 0.3)
    assert time.monotonic() - t0 < 5


def _proven(address, body):
    with socket.create_connection(address) as c:
        c.sendall(ls._proof(None, NONCE) + body)


def _head(skeleton_state, total, layouts=None):
    import io
    import json
    buf = io.BytesIO()
    torch.save(skeleton_state, buf)
    where, lay = POSITION.to_bytes(), json.dumps(layouts or {"0": [1]}).encode()
    u32 = ls._U32.pack
    return (u32(len(where)) + where + u32(len(lay)) + lay + u32(buf.tell()) + buf.getvalue()
            + ls._U64.pack(total))


@pytest.mark.parametrize("body, error, match", [
    (lambda: _head({"w": torch.empty(4, device="meta")}, 16) + b"\0" * 7, EOFError,
     "short"),
    (lambda: _head({"w": torch.empty(4, device="meta")}, 15), ValueError, "announces"),
    (lambda: _head({"w": torch.ones(4)}, 16), ValueError, "with data"),
    (lambda: _head([torch.empty(4, device="meta")], 16), ValueError, "not a dict"),
    (lambda: ls._U32.pack(1 << 30), ValueError, "more than"),
    (lambda: _head({"w": torch.empty(4, device="meta")}, 16, {"0": [1], "numbered": -3}),
     ValueError, "operation number"),
], ids=["truncated", "wrong-total", "data-in-skeleton", "not-a-dict", "huge-position",
        "bad-number"])
def test_a_proven_stream_that_is_not_a_state_is_refused_naming_the_fault(body, error, match):
    with _listener() as lst:
        threading.Thread(target=_proven, args=(lst.getsockname(), body()),
                         daemon=True).start()
        with pytest.raises(error, match=match):
            ls.receive_state(lst, NONCE, time.monotonic() + 10)


@pytest.mark.parametrize("tensor, match", [
    (torch.eye(3).to_sparse(), "dense tensors only"),
    (torch.empty(3, device="meta"), "copy the state to the CPU")], ids=["sparse", "meta"])
def test_a_tensor_that_cannot_be_sent_is_refused_before_anything_is_sent(tensor, match):
    with _listener() as lst, pytest.raises(ValueError, match=match):
        ls.send_state(lst.getsockname(), NONCE, POSITION, LAYOUTS, {"w": tensor}, timeout_s=5)


def test_with_a_secret_only_a_sender_that_holds_it_is_read():
    """The nonce travels in the store; with the job's secret, knowing it is not enough: a
    sender with another secret (or none) is refused, one with the secret is read."""
    refused = []
    with _listener() as lst:
        address = lst.getsockname()
        _, _ = _send_later(address, secret=b"another")
        _, _ = _send_later(address, delay_s=0.2)  # the nonce alone
        real, errors = _send_later(address, secret=b"the job's", delay_s=0.5)
        _, _, state = ls.receive_state(lst, NONCE, time.monotonic() + 10, secret=b"the job's",
                                       refused=refused.append)
    real.join(10)
    assert not errors and _equal(_state(), state)
    assert len(refused) == 2 and all("did not prove this request" in why
                                     for why in refused), refused


def test_slow_openers_neither_stall_the_listener_nor_block_the_real_sender(monkeypatch):
    """Connections that dribble a byte every 0.1 s, or say nothing, are dropped within
    OPENING_S all told, however they space their bytes; and they are read side by side with
    the live rank's: its state arrives at once, not after theirs time out."""
    monkeypatch.setattr(ls, "OPENING_S", 1.0)
    stop = threading.Event()

    def dribble(address):
        with socket.create_connection(address) as c:
            for b in ls._proof(None, bytes(16)):
                if stop.is_set():
                    return
                try:
                    c.sendall(bytes([b]))
                except OSError:
                    return
                time.sleep(0.1)

    def openers(address):
        for _ in range(5):
            threading.Thread(target=dribble, args=(address,), daemon=True).start()
        return [socket.create_connection(address) for _ in range(5)]

    with _listener() as lst:
        address = lst.getsockname()
        silent = openers(address)
        refused = []
        with pytest.raises(TimeoutError):
            ls.receive_state(lst, NONCE, time.monotonic() + 1.6, refused=refused.append)
        assert len(refused) == 10 and all("within 1 s" in why for why in refused), refused
        silent += openers(address)
        time.sleep(0.2)
        t0 = time.monotonic()
        real, errors = _send_later(address)
        refused.clear()
        _, _, state = ls.receive_state(lst, NONCE, t0 + 10, refused=refused.append)
        took = time.monotonic() - t0
        stop.set()
        for c in silent:
            c.close()
    real.join(10)
    assert not errors and _equal(_state(), state)
    assert took < ls.OPENING_S, took  # not held up by the ten openers
    assert len(refused) == 10 and all("listener stopped" in why for why in refused), refused


def test_strangers_holding_every_opening_cannot_keep_the_live_rank_out(monkeypatch):
    """MAX_PENDING silent connections (and more coming) fill the openings; the live rank's,
    arriving after them, still gets read: a newcomer closes the oldest opening, not itself."""
    monkeypatch.setattr(ls, "MAX_PENDING", 8)
    with _listener() as lst:
        address = lst.getsockname()
        silent = [socket.create_connection(address) for _ in range(8)]
        stop = threading.Event()

        def flood():  # a new silent connection every 20 ms, each held open
            while not stop.is_set():
                try:
                    silent.append(socket.create_connection(address))
                except OSError:
                    return
                time.sleep(0.02)
        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        real, errors = _send_later(address, delay_s=0.3)
        refused = []
        try:
            _, _, state = ls.receive_state(lst, NONCE, time.monotonic() + 10,
                                           refused=refused.append)
        finally:
            stop.set()
            flooder.join(5)
            for c in silent:
                c.close()
    real.join(10)
    assert not errors and _equal(_state(), state)
    assert any("8 newer connections were proving themselves" in why for why in refused)


def test_a_stream_altered_on_the_way_fails_its_tag():
    """A relay that flips one byte of a tensor's data on the way: the state would load, but
    its tag does not verify."""
    with _listener() as lst, socket.create_server(("127.0.0.1", 0)) as relay:
        def forward():
            inbound, _ = relay.accept()
            with inbound, socket.create_connection(lst.getsockname()) as out:
                data = bytearray()
                while chunk := inbound.recv(1 << 16):
                    data += chunk
                data[-40] ^= 0x01  # a tensor's byte (the tag is the last 32)
                out.sendall(bytes(data))
        threading.Thread(target=forward, daemon=True).start()
        _send_later(relay.getsockname())
        with pytest.raises(ValueError, match="tag does not verify"):
            ls.receive_state(lst, NONCE, time.monotonic() + 10)


def test_a_listener_beyond_loopback_needs_a_secret_or_an_explicit_insecure():
    from switchml.protocol.errors import ConfigError
    with pytest.raises(ConfigError, match="SWITCHML_SECRET"):
        ls.check_listener("10.1.2.3", None)
    ls.check_listener("10.1.2.3", b"s")
    ls.check_listener("10.1.2.3", None, insecure=True)
    ls.check_listener("127.0.0.1", None)
