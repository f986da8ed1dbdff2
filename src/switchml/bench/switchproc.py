"""A software switch in a process of its own, driven over a pipe (used by the benchmarks).

The server is the one ``switchml switch`` runs, built by :func:`switchml.service.build_server`
with the command's defaults.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["SwitchProcess", "rss_bytes"]


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _serve(conn: Any, lease_timeout_s: float, secret: bytes | None,
           batching: bool = True, shard: tuple[int, int] = (0, 1)) -> None:
    from switchml.service import SwitchSpec, build_server
    server = build_server(SwitchSpec(host="127.0.0.1", port=0, lease_timeout_s=lease_timeout_s,
                                     batching=batching, shard=shard), secret)
    conn.send(server.address)
    server.start()
    try:
        while True:  # "stats"; anything else, or EOF, stops
            if conn.recv() != "stats":
                break
            conn.send(server.stats())
    except EOFError:
        pass
    server.stop()


class SwitchProcess:
    """Start a switch on a free loopback port in a child process of ``ctx`` (spawn).

    ``shard``: (i, S), shard i of a switch sharded over S processes."""

    def __init__(self, ctx: Any, lease_timeout_s: float = 30.0,
                 secret: bytes | None = None, batching: bool = True,
                 shard: tuple[int, int] = (0, 1)) -> None:
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve,
                                args=(child, lease_timeout_s, secret, batching, shard),
                                daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 30.0
        while not self._conn.poll(0.1):  # its address, once listening
            if not self.proc.is_alive():
                raise RuntimeError(f"the switch process exited with code {self.proc.exitcode} "
                                   "before it listened (its error is above)")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("the switch process did not start within 30 s")
        self.address: tuple[str, int] = tuple(self._conn.recv())

    def stats(self) -> dict[str, Any]:
        self._conn.send("stats")
        return self._conn.recv()  # type: ignore[no-any-return]

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def stop(self) -> None:
        try:
            self._conn.send("stop")
        except OSError:
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
