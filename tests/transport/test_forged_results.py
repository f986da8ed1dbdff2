"""Forged switch-to-worker traffic over real sockets: a stranger who knows a job's token sends
RESULTs that match every (chunk, slot, set) of the job, and the control replies that fail or
redirect an operation (UNKNOWN_JOB, WAITING naming gone ranks, MISMATCH, REFUSED), to the
workers' ports while they all-reduce through a sharded switch (whose workers' socket is not
connected) and through one switch. Once, a forged RESULT made a rank of a sharded job return
666 where its peer returned the true sum.

With the switch's own source address spoofed (raw IPv4, root only), the control replies change
nothing either: the switch seals them (``auth.seal_reply``), and a worker drops and counts
every one that does not verify. A RESULT with a spoofed source is still taken: the data plane
is not authenticated (docs/operations.md, the threat table).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Callable

import numpy as np
import pytest

from switchml.control import new_job_spec
from switchml.protocol.config import SwitchConfig, WorkerConfig
from switchml.protocol.wire import ElementType, Header, MessageType, pack_header
from switchml.transport.udp import SwitchServer, WorkerClient

N, K, W, SIZE, OPS = 2, 256, 8, 256 * 200, 4


def _forgeries(job: int, token: int, seq_range: range) -> list[bytes]:
    """RESULTs of 666 for every chunk, slot and set an operation of the job can use, and one
    of each control reply that ends or redirects an operation, every ``seq``."""
    out = []
    for seq in seq_range:
        for chunk in range(SIZE // K):
            for set_bit in (0, 1):
                h = Header(MessageType.RESULT, job, rank=0, token=token, seq=seq, chunk=chunk,
                           slot=chunk % W, set_bit=set_bit, count=K, elem=ElementType.INT32)
                out.append(pack_header(h) + np.full(K, 666, "<i4").tobytes())
        gone = (1).to_bytes(1, "little")
        for mtype, payload in ((MessageType.UNKNOWN_JOB, b""),
                               (MessageType.WAITING, gone + gone),
                               (MessageType.MISMATCH, bytes(32)),
                               (MessageType.REFUSED, b"forged")):
            h = Header(mtype, job, rank=0, token=token, seq=seq, count=len(payload),
                       elem=ElementType.BYTES)
            out.append(pack_header(h) + payload)
    return out


def _spoofed(src: tuple[str, int], dst: tuple[str, int], payload: bytes) -> bytes:
    """An IPv4 + UDP datagram from ``src`` to ``dst`` (UDP checksum 0: none, which IPv4
    allows; the kernel fills in the IP checksum and id)."""
    udp = struct.pack("!HHHH", src[1], dst[1], 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP,
                     0, socket.inet_aton(src[0]), socket.inet_aton(dst[0]))
    return ip + udp


def _allreduce_under_forgeries(shards: int, spec, forged: Callable[[object], list[bytes]], *,
                               spoof: bool, secret: bytes | None = None) -> list:
    """``N`` ranks of ``spec`` all-reduce ``OPS`` times through ``shards`` switch processes
    while ``forged(spec)``'s datagrams go to their ports without pause, from a stranger's
    socket, or (``spoof``, root) from the switch's (shard 0's) own address; every sum is
    checked by hand (rank r sends (r + 1)(op + 1)). Returns the ranks' clients, closed."""
    servers = [SwitchServer(port=0, config=SwitchConfig(shard_index=i, shard_count=shards,
                                                        secret=secret)).start()
               for i in range(shards)]
    try:
        addrs = [s.address for s in servers]
        clients: list = [None] * N
        outs: dict[int, list] = {r: [] for r in range(N)}
        errors: list = []
        started = threading.Barrier(N + 1)
        stop = threading.Event()
        flooded = threading.Event()  # every forgery sent once: the operations start after

        def rank(r: int) -> None:
            try:
                with WorkerClient(addrs if shards > 1 else addrs[0], spec, r,
                                  WorkerConfig(op_timeout_s=20, secret=secret)) as w:
                    clients[r] = w
                    started.wait(30)
                    flooded.wait(30)  # (fast operations could end before the first forgery)
                    for op in range(OPS):
                        outs[r].append(w.allreduce(np.full(SIZE, (r + 1) * (op + 1), np.int32)))
            except BaseException as exc:  # noqa: BLE001
                errors.append(f"rank {r}: {exc!r}")
                started.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(N)]
        for t in threads:
            t.start()
        started.wait(30)
        datagrams = forged(spec)
        ports = [c.sock.getsockname()[1] for c in clients]

        def forge() -> None:
            kind = ((socket.SOCK_RAW, socket.IPPROTO_RAW) if spoof
                    else (socket.SOCK_DGRAM, 0))
            with socket.socket(socket.AF_INET, *kind) as s:
                while not stop.is_set():
                    for d in datagrams:
                        for p in ports:
                            if spoof:  # from the switch's (shard 0's) own address
                                s.sendto(_spoofed(addrs[0], ("127.0.0.1", p), d),
                                         ("127.0.0.1", 0))
                            else:
                                s.sendto(d, ("127.0.0.1", p))
                        if stop.is_set():
                            return
                    flooded.set()  # (and on: the forgeries go on during the operations)

        forger = threading.Thread(target=forge)
        forger.start()
        for t in threads:
            t.join(120)
        stop.set()
        forger.join(10)
        assert not errors, errors
        for r in range(N):
            assert len(outs[r]) == OPS
            for op, out in enumerate(outs[r]):
                np.testing.assert_array_equal(out, np.full(SIZE, 3 * (op + 1), np.int32))
        return clients
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize("shards", [2, 1])
@pytest.mark.parametrize("spoof", [False, True], ids=["stranger", "switch-address-spoofed"])
def test_forged_results_and_control_from_a_stranger_change_nothing(shards, spoof) -> None:
    if spoof and os.geteuid() != 0:
        pytest.skip("spoofing the switch's source address needs a raw socket (root)")

    def forged(spec) -> list[bytes]:
        out = _forgeries(spec.job_id, spec.token, range(OPS + 1))
        # (a RESULT from the switch's address is taken by a job without auth_data)
        return [d for d in out if d[3] != MessageType.RESULT] if spoof else out

    clients = _allreduce_under_forgeries(shards, new_job_spec(N, window=W, elements_per_packet=K),
                                         forged, spoof=spoof)
    if spoof:  # every rank saw them, from the switch's address, and dropped them
        for c in clients:
            assert c.endpoint.drops["unauthenticated_reply"] > 0, c.endpoint.drops
    elif shards > 1:  # (one switch: the connected socket's kernel drops them unseen)
        assert sum(c.endpoint.drops["foreign_sender"] for c in clients) > 0


@pytest.mark.parametrize("shards", [2, 1])
def test_forged_results_from_the_switchs_own_address_change_no_sum_of_an_authenticated_job(
        shards) -> None:
    """The authenticated data plane (``JobSpec.auth_data``): RESULTs of 666 from the switch's
    spoofed address, with AUTH and a tag that is not the job's, or without AUTH, while the
    ranks all-reduce: every sum is right, and the ranks dropped the forgeries (``bad_mac``)."""
    if os.geteuid() != 0:
        pytest.skip("spoofing the switch's source address needs a raw socket (root)")

    def forged(spec) -> list[bytes]:
        results = [d for d in _forgeries(spec.job_id, spec.token, range(OPS + 1))
                   if d[3] == MessageType.RESULT]
        return [bytes([*d[:4], d[4] | 0x40, *d[5:]]) + os.urandom(16) for d in results] + results

    spec = new_job_spec(N, window=W, elements_per_packet=K, auth_data=True)
    clients = _allreduce_under_forgeries(shards, spec, forged, spoof=True,
                                         secret=b"forged-results-auth-data-secret")
    assert all(c.endpoint.drops["bad_mac"] > 0 for c in clients), \
        [dict(c.endpoint.drops) for c in clients]
