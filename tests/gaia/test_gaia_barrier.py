"""The selective barrier with crafted timings: a data centre announces which tensors its update
touches, finishes its clock, and sends the entries later. Data centre 1 is played by a plain
socket speaking the protocol, so every message's time is chosen."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from switchml.gaia.mirror import Mirror
from switchml.gaia.rules import encode_announce, encode_sparse, tensor_of
from switchml.gaia.trainer import GaiaSync
from switchml.ps.wire import MessageType, recv_header, recv_payload, send_message


class _FakeDC:
    """Data centre 1 of two, by hand: its link to data centre 0, and the one it accepts."""

    def __init__(self, leaders, m0: Mirror) -> None:
        self.lsock = socket.create_server(leaders[1])
        starter = threading.Thread(target=m0.start)
        starter.start()
        self.out = socket.create_connection(leaders[0], timeout=5)
        send_message(self.out, MessageType.HELLO, worker=1)
        self.inc, _ = self.lsock.accept()
        starter.join(10)

    def send(self, mtype: MessageType, **kw) -> None:
        send_message(self.out, mtype, worker=1, **kw)

    def announce(self, clock: int, idx: np.ndarray, count: int) -> None:
        tensors = np.unique(tensor_of(self.offsets, idx))
        self.send(MessageType.CLOCK, step=clock, flags=1,
                  payload=encode_announce(idx.size, tensors, count))

    def close(self) -> None:
        for s in (self.out, self.inc, self.lsock):
            s.close()


@pytest.fixture
def dc0_and_fake(free_ports):
    leaders = [("127.0.0.1", p) for p in free_ports(2)]
    m0 = Mirror(dc=0, leaders=leaders, staleness=0, timeout_s=10)
    fake = _FakeDC(leaders, m0)
    yield m0, fake
    m0.close()
    fake.close()


def test_readers_of_other_tensors_go_on_and_readers_of_announced_ones_wait(dc0_and_fake):
    m0, fake = dc0_and_fake
    m0.expect_layout([4, 6])
    fake.offsets = np.array([0, 4, 10])
    idx = np.array([5, 8], np.int32)
    fake.announce(1, idx, 2)  # tensor 1 only
    fake.send(MessageType.CLOCK, step=1)
    got = []
    m0.clock.finish()
    t0 = time.monotonic()
    m0.exchange(lambda i, v: got.append(i.tolist()))  # the clock is enough to go on
    # (bounds: well under the mirror's 10 s timeout and each wait's own, never a machine's pace)
    assert time.monotonic() - t0 < 5 and got == []
    assert m0.wait_tensors({0}, got.append, timeout_s=5) == set()  # nothing announced for it
    t0 = time.monotonic()
    assert m0.wait_tensors({1}, got.append, timeout_s=0.3) == {1}  # the bound: read stale
    assert 0.3 <= time.monotonic() - t0 < 5 and got == []  # its 0.3 s, not the mirror's 10
    threading.Timer(0.2, fake.send, (MessageType.SPARSE,), dict(
        step=1, payload=encode_sparse(idx, np.array([0.5, -1.0], np.float32)))).start()
    t0 = time.monotonic()
    assert m0.wait_tensors({0, 1}, lambda i, v: got.append(i.tolist()), timeout_s=5) == set()
    assert 0.15 < time.monotonic() - t0 < 4.5 and got == [[5, 8]]  # before its 5 s bound
    st = m0.stats()
    assert st["barrier_waits"] == 2 and st["barrier_timeouts"] == 1
    assert st["updates_received"] == 1 and st["entries_received"] == 2


def test_barriers_and_clocks_overtake_an_update_still_being_sent(free_ports):
    """Leader 0 publishes a 12 MB update in pieces, then its next clock's barrier and clock,
    while data centre 1 reads nothing (the socket buffers fill): once it reads, the second
    clock's messages come before the first update's last pieces."""
    leaders = [("127.0.0.1", p) for p in free_ports(2)]
    lsock = socket.create_server(leaders[1])
    m0 = Mirror(dc=0, leaders=leaders, staleness=5, timeout_s=10, piece_entries=4096)
    n = 1_500_000
    m0.expect_layout([n // 2, n // 2])
    starter = threading.Thread(target=m0.start)
    starter.start()
    conn, _ = lsock.accept()
    out = socket.create_connection(leaders[0], timeout=5)
    send_message(out, MessageType.HELLO, worker=1)
    starter.join(10)
    try:
        m0.publish(1, np.arange(n, dtype=np.int32), np.ones(n, np.float32))
        time.sleep(0.5)  # the sender blocks on full buffers
        m0.publish(2, np.array([3], np.int32), np.ones(1, np.float32))
        conn.settimeout(10)
        seen = []
        while True:
            h = recv_header(conn)
            recv_payload(conn, h)
            seen.append((h.type, h.step, h.flags))
            if h.type == MessageType.SPARSE and h.step == 2:
                break
        kinds = [(t.name, step, flags) for t, step, flags in seen]
        assert kinds[:2] == [("HELLO", 0, 0), ("CLOCK", 1, 1)] and kinds[2] == ("CLOCK", 1, 0)
        second = kinds.index(("CLOCK", 2, 1))
        pieces_of_1 = [i for i, k in enumerate(kinds) if k[:2] == ("SPARSE", 1)]
        assert len(pieces_of_1) == -(-n // 4096)
        assert second < pieces_of_1[-1] - 10  # well before the first update's end
        assert kinds[second + 1] == ("CLOCK", 2, 0)
    finally:
        m0.close()
        for s in (conn, out, lsock):
            s.close()


def test_a_modules_forward_waits_for_its_own_parameters_only(dc0_and_fake):
    """Gaia on a two-layer model: data centre 1's update touches only the second layer's
    weight and comes 1 s after its clock. The first layer's forward runs at once, the
    second's waits for the entries, then reads them."""
    m0, fake = dc0_and_fake
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    gaia = GaiaSync(model, mirror=m0, threshold=0.0, decay=False, barrier_timeout_s=5)
    fake.offsets = np.array([0, 12, 16, 24, 26])
    started = {}
    def stamp(name):
        def hook(_module, _inputs):
            started.setdefault(name, time.monotonic())
        return hook

    model[0].register_forward_pre_hook(stamp("first"))
    model[1].register_forward_pre_hook(stamp("second"))
    idx = np.array([16, 23], np.int32)  # the second layer's weight (tensor 2)
    fake.announce(1, idx, 4)
    fake.send(MessageType.CLOCK, step=1)
    before = model[1].weight.detach().clone()
    gaia.after_step()  # publishes nothing (no step taken), takes the clock; tensor 2 blocked
    assert gaia._blocked == {2}
    t_data = time.monotonic() + 1.0
    threading.Timer(1.0, fake.send, (MessageType.SPARSE,), dict(
        step=1, payload=encode_sparse(idx, np.array([1.0, 2.0], np.float32)))).start()
    model(torch.zeros(1, 3))
    assert started["first"] < t_data - 0.5
    assert started["second"] >= t_data - 0.05
    after = model[1].weight.detach()
    assert after.reshape(-1)[0] == before.reshape(-1)[0] + 1.0
    assert after.reshape(-1)[7] == before.reshape(-1)[7] + 2.0
    assert gaia.reads_blocked == 1 and gaia.entries_applied == 2


def test_entries_for_a_tensor_already_read_wait_for_the_clocks_end(dc0_and_fake):
    """The first layer's wait passes its bound (it reads its weight stale); the entries come
    while the second layer waits, for both weights: the second layer's are applied before its
    forward, the first layer's (read already: changing it now would corrupt the gradient
    autograd computes from it) at the end of the clock, and backward works."""
    m0, fake = dc0_and_fake
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # steps change nothing: entries do
    gaia = GaiaSync(model, mirror=m0, threshold=1.0, decay=False, barrier_timeout_s=1.0)
    fake.offsets = np.array([0, 12, 16, 24, 26])
    idx = np.array([0, 16], np.int32)  # the first weight's first entry, the second's
    fake.announce(1, idx, 4)
    fake.send(MessageType.CLOCK, step=1)
    w0, w1 = (model[i].weight.detach().clone() for i in (0, 1))
    gaia.after_step()
    assert gaia._blocked == {0, 2}
    threading.Timer(1.5, fake.send, (MessageType.SPARSE,), dict(
        step=1, payload=encode_sparse(idx, np.array([1.0, 2.0], np.float32)))).start()
    model(torch.ones(1, 3)).sum().backward()  # no "modified by an inplace operation"
    assert model[0].weight[0, 0] == w0[0, 0] and model[1].weight[0, 0] == w1[0, 0] + 2.0
    assert m0.stats()["barrier_timeouts"] == 1
    opt.step()
    fake.send(MessageType.CLOCK, step=2)
    gaia.after_step()
    assert model[0].weight[0, 0] == w0[0, 0] + 1.0
    assert gaia.entries_applied == 2 and gaia.entries_published == 0
