"""Which secure transport for the parameter servers: TLS over the framed protocol (Python's
``ssl``, what ``links.py`` uses) or gRPC with TLS? Both authenticate both ends with the same
certificates; measured on loopback as a parameter server's round: a worker sends a shard and
gets a shard of the same size back (PUSH, then PULL), ``--mib`` MiB each way, interleaved,
with the machine's busy CPU (/proc/stat) per round.

    pip install grpcio && python experiments/ps_link_choice.py --mib 16 --rounds 20

gRPC carries raw bytes (identity serializers: no protobuf copy), with its message limit
raised above the shard.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

from switchml.bench.cpu import machine_busy_s
from switchml.links import LinkSecurity, make_credentials
from switchml.ps.wire import MessageType, recv_message, send_message


def ssl_rounds(sec: LinkSecurity, payload: bytes, rounds: int) -> tuple[float, float]:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen()
    sctx = sec.server_context()

    def serve() -> None:
        conn, _ = ls.accept()
        tls = sec.accept(conn, sctx)
        buf = memoryview(bytearray(len(payload)))
        for _ in range(rounds):
            _h, body = recv_message(tls, buf)
            send_message(tls, MessageType.PARAMS, payload=body)
        tls.close()

    t = threading.Thread(target=serve)
    t.start()
    c = sec.connect(socket.create_connection(ls.getsockname()), sec.client_context())
    into = memoryview(bytearray(len(payload)))
    c0, t0 = machine_busy_s(), time.perf_counter()
    for _ in range(rounds):
        send_message(c, MessageType.PUSH, payload=payload)
        recv_message(c, into)
    dt, cpu = time.perf_counter() - t0, machine_busy_s() - c0
    c.close()
    t.join()
    ls.close()
    return dt / rounds, cpu / rounds


def grpc_rounds(sec: LinkSecurity, payload: bytes, rounds: int) -> tuple[float, float]:
    import grpc

    def ident(b: bytes) -> bytes:
        return b

    limit = [("grpc.max_send_message_length", 2 * len(payload) + 1024),
             ("grpc.max_receive_message_length", 2 * len(payload) + 1024)]
    handler = grpc.method_handlers_generic_handler("ps", {
        "Round": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req,
                                                     request_deserializer=ident,
                                                     response_serializer=ident)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=limit)
    server.add_generic_rpc_handlers((handler,))
    key, cert, ca = sec.key.read_bytes(), sec.cert.read_bytes(), sec.ca.read_bytes()
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                        require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    channel = grpc.secure_channel(
        f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca, key, cert),
        options=limit + [("grpc.ssl_target_name_override", "switchml peer")])
    call = channel.unary_unary("/ps/Round", request_serializer=ident,
                               response_deserializer=ident)
    call(payload)  # connect and warm up
    c0, t0 = machine_busy_s(), time.perf_counter()
    for _ in range(rounds):
        got = call(payload)
        assert len(got) == len(payload)
    dt, cpu = time.perf_counter() - t0, machine_busy_s() - c0
    channel.close()
    server.stop(None)
    return dt / rounds, cpu / rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    payload = bytes(a.mib * 2**20)
    rows: dict[str, list[tuple[float, float]]] = {"ssl framed": [], "grpc": []}
    with tempfile.TemporaryDirectory() as d:
        sec = make_credentials(f"{d}/tls")
        for _ in range(a.repeats):
            rows["ssl framed"].append(ssl_rounds(sec, payload, a.rounds))
            rows["grpc"].append(grpc_rounds(sec, payload, a.rounds))
    mb = 2 * len(payload) / 1e6
    out = {}
    for k, v in rows.items():
        t = statistics.median(x for x, _ in v)
        c = statistics.median(y for _, y in v)
        out[k] = {"round_s": t, "mb_per_s": mb / t, "busy_cpu_s_per_round": c}
        print(f"{k:11s} {mb / t:7.0f} MB/s  {1e3 * t:7.1f} ms/round  {c:6.3f} CPU-s/round")
    print(f"gRPC / ssl: time {out['grpc']['round_s'] / out['ssl framed']['round_s']:.2f}x, CPU "
          f"{out['grpc']['busy_cpu_s_per_round'] / out['ssl framed']['busy_cpu_s_per_round']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "median": out}, indent=1))


if __name__ == "__main__":
    main()
