"""All-reduce over the emulated testbed: switchml, gloo (ring) and a parameter server, over the
same shaped links in the same run.

Each worker runs in its own namespace, behind a link of ``rate`` bits/s each way; the router
namespace routes worker-to-worker traffic (gloo's ring crosses two links per hop, as in a real
star) and runs the software switch itself (switchml crosses one link each way; worker i talks
to its gateway address); the parameter server has a host (and link) of its own, as in
TensorFlow's deployment. Bounds per worker, in
elements/s: in-network aggregation B/32 (each worker sends and receives its vector once), ring
B/32 / (2(n-1)/n), parameter server B/32 / n (its one link carries all n vectors).

Training over the same testbed: :mod:`switchml.bench.testbed_train`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from switchml.bench.cpu import cpu_per_gelem, span_cpu_percent
from switchml.protocol.config import default_window
from switchml.protocol.parts import check_threads
from switchml.protocol.wire import AUTH_TAG_SIZE, elements_for_mtu
from switchml.protocol.worker import RECOVERY_COUNTERS
from switchml.testbed import LinkSpec, Testbed, TestbedError, Topology

log = logging.getLogger(__name__)

__all__ = ["C10D_ABORT", "DEFAULT_MTU", "TestbedBenchConfig", "elements_for_mtu",
           "once_more_if_torch_aborted", "run_testbed_allreduce", "start_switch"]

SWITCH_PORT = 48864
SYSTEMS = ("switchml", "gloo", "ps", "floor")
DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_SYSTEMS = ("switchml", "gloo", "ps")
"""``floor`` (the cost of moving switchml's bytes with no protocol: ``bench/floor.py``) runs
when asked for."""
FLOOR_PORT = SWITCH_PORT + 2
DEFAULT_MTU = 1500
"""Ethernet's MTU; 9000 for jumbo frames. Larger MTUs (veth takes up to 65535) are no real
network's."""


@dataclass(frozen=True)
class TestbedBenchConfig:
    __test__ = False

    workers: int = 4
    sizes_bytes: tuple[int, ...] = (64 * 2**20,)
    rate_bps: float = 1e9
    loss_rate: float = 0.0
    mtu: int = DEFAULT_MTU
    iters: int = 3
    warmup: int = 1
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    window: int | None = None
    """Slots per job; default from the chunk size (``protocol.config.default_window``). On
    shaped links keep W x packet below tbf's queue (rate x 20 ms)."""
    timeout_s: float = 900.0
    fast_retransmit: bool = False
    """switchml workers re-send a chunk when a later one's result arrives (RACK)."""
    bits: int = 32
    """Wire width of switchml's floats: 32, or 16 (half the bytes on the wire)."""
    residual: bool = False
    """With 16 bits: each worker keeps a float32 rounding residual, as the DDP hook does."""
    threads: int = 1
    """I/O threads per switchml worker (``transport/parallel.py``)."""
    nack_gap: int = 4
    """The switch's NACK gap (``SwitchConfig.nack_gap``); 0: recovery by timeouts only."""
    jobs: int = 1
    """Jobs the workers are split into, running at once (worker i in job i mod ``jobs``):
    switchml's share the switch, gloo's are separate rings. switchml and gloo only."""
    dtype: str = "float32"
    """The all-reduced tensors' type. float16 and bfloat16 (switchml and gloo only): both run
    through torch.distributed, switchml on its "switchml" backend, whose rule sets the wire
    width (``torch.staging.wire_bits``), gloo on the same type; elements as float32's."""
    torch: bool = False
    """switchml through its torch backend whatever the type (float32 too): what a
    ``dist.all_reduce`` costs beside the worker library's own rows."""
    auth_data: bool = False
    """switchml's jobs authenticate their data plane (``JobSpec.auth_data``: a MAC on every
    request and result; the switch gets a secret of this run's); its chunks leave room for
    the MAC. The worker library's rows only."""

    @property
    def through_torch(self) -> bool:
        """Whether switchml runs through its torch backend (``torch``, or a half type)."""
        return self.torch or self.dtype != "float32"

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"TestbedBenchConfig.timeout_s must be > 0, got {self.timeout_s}")
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown:
            raise ValueError(f"unknown system(s) {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
        if self.jobs < 1 or self.workers % self.jobs or self.workers // self.jobs < 2:
            raise ValueError(f"TestbedBenchConfig.jobs must divide the {self.workers} workers "
                             f"into jobs of at "
                             f"least 2, got {self.jobs}")
        check_threads(self.threads)
        if self.residual and self.bits != 16:
            raise ValueError("TestbedBenchConfig.residual is the 16-bit hook's error feedback: it "
                             "needs TestbedBenchConfig.bits 16")
        if self.dtype not in DTYPES:
            raise ValueError(f"TestbedBenchConfig.dtype must be one of {', '.join(DTYPES)}, got "
                             f"{self.dtype!r}")
        if self.through_torch and (set(self.systems) - {"switchml", "gloo"} or self.jobs > 1
                                   or self.bits != 32 or self.residual):
            raise ValueError(f"through torch (dtype {self.dtype}) only the systems switchml and "
                             "gloo run, one job, and the backend sets the wire width (no "
                             "TestbedBenchConfig.bits, TestbedBenchConfig.residual)")
        n, ops = self.workers, self.warmup + self.iters
        if self.dtype == "float16" and n * (n + 1) / 2 * n ** (ops - 1) > 65504:
            raise ValueError(f"float16: {ops} in-place sums of {n} workers' values overflow "
                             "float16; take fewer "
                             "TestbedBenchConfig.warmup/TestbedBenchConfig.iters")
        if self.auth_data and self.through_torch:
            raise ValueError("TestbedBenchConfig.auth_data is for the worker library's rows, "
                             "not through torch")
        if self.jobs > 1 and set(self.systems) - {"switchml", "gloo"}:
            raise ValueError("with TestbedBenchConfig.jobs > 1, only the systems switchml and "
                             "gloo run, got "
                             f"{', '.join(self.systems)}")

    def job_of(self, worker: int) -> tuple[int, int]:
        """(job, rank in it) of worker ``worker``."""
        return worker % self.jobs, worker // self.jobs

    @property
    def elements_per_packet(self) -> int:
        """The largest chunk that fits the MTU (:func:`elements_for_mtu`), an authenticated
        job's MAC included."""
        return elements_for_mtu(self.mtu, trailer=AUTH_TAG_SIZE if self.auth_data else 0)


def _nsproc(role: str, args: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "switchml.bench.nsproc", role, json.dumps(args)]


def _wait_all(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[dict[str, Any]]:
    """Wait for every process; the first failure (or the deadline) kills the rest and raises
    with that process's stderr, so one dead worker never leaves the others hanging.

    Each process's pipes are read while it runs (a thread per process), so a process that
    writes more than a pipe holds never stalls.
    """
    outputs: dict[int, tuple[str, str]] = {}

    def read(i: int, p: subprocess.Popen[str]) -> None:
        outputs[i] = p.communicate()

    readers = [threading.Thread(target=read, args=(i, p), daemon=True)
               for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.returncode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for q in procs:
                q.kill()
            for t in readers:
                t.join(timeout=10)
            if failed:
                _, stderr = outputs.get(procs.index(failed[0]), ("", ""))
                raise TestbedError(f"a benchmark process failed ({failed[0].returncode}): "
                                   f"{stderr.strip()[-1500:]}")
            raise TestbedError(f"benchmark processes did not finish in {timeout_s:g} s")
        time.sleep(0.05)
    for t in readers:
        t.join(timeout=30)
    out = []
    for i, p in enumerate(procs):
        stdout, stderr = outputs.get(i, ("", ""))
        if p.returncode != 0:
            raise TestbedError(f"a benchmark process failed ({p.returncode}): "
                               f"{stderr.strip()[-1500:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


_PIPE: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
"""Popen arguments for a benchmark process whose JSON line and stderr are read."""


def _start_workers(tb: Testbed, hosts: Iterable[int], argv_of: Callable[[int], list[str]],
                   env_of: Callable[[int], dict[str, str]] | None = None
                   ) -> list[subprocess.Popen[str]]:
    """Start ``argv_of(i)`` in worker i's namespace for each i in ``hosts`` (environment
    ``env_of(i)``, or this process's)."""
    return [tb.popen(tb.worker_ns(i), argv_of(i), **({} if env_of is None else
                                                     {"env": env_of(i)}), **_PIPE)
            for i in hosts]


def _start_server(tb: Testbed, ns: str, role: str, args: dict[str, Any], failure: str,
                  timeout_s: float = 60.0, error: type[Exception] = TestbedError
                  ) -> subprocess.Popen[str]:
    """Start ``nsproc`` role ``role`` in namespace ``ns`` with its stdin and stdout piped (it
    stops when its stdin closes); raise ``error(failure)`` unless it says ``ready`` in time."""
    proc = tb.popen(ns, _nsproc(role, args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    text=True)
    return _expect_ready(proc, failure, timeout_s, error)


def start_switch(tb: Testbed, ns: str, port: int, failure: str, timeout_s: float = 60.0,
                 error: type[Exception] = TestbedError) -> subprocess.Popen[str]:
    """A testbed switch in namespace ``ns`` on ``port`` (``nsproc``'s ``switch`` role, built
    as ``switchml switch`` builds one), once it listens; it stops when its stdin closes."""
    return _start_server(tb, ns, "switch", {"port": port}, failure, timeout_s, error)


def _expect_ready(proc: subprocess.Popen[str], failure: str, timeout_s: float = 60.0,
                  error: type[Exception] = TestbedError) -> subprocess.Popen[str]:
    """``proc``, once its first line says it is ready: a switch's listening line
    (``control.announce``, parsed), another server's ``ready``; ``error(failure)`` if it is
    not in time."""
    from switchml.control.announce import parse_listening
    line = _read_line(proc, timeout_s)
    try:
        ready = line.strip() == "ready" or parse_listening(line) is not None
    except ValueError:  # a listening line with no address in it
        ready = False
    if not ready:
        raise error(f"{failure} (its first line: {line.strip()[:200]!r})")
    return proc


def _stop_servers(procs: list[subprocess.Popen[str]]) -> list[str]:
    """Close every server's stdin (they stop), then read the line each prints as it ends."""
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
    return [_read_line(p, 60) for p in procs]


def _ate_row(cfg: TestbedBenchConfig, system: str, n: int, size: int,
             rows: list[dict[str, Any]], loss_rate: float) -> dict[str, Any]:
    """A result row's setup, its ATE/s (the slowest worker's) and the bounds."""
    numel = size // 4
    elapsed = max(r["elapsed_s"] for r in rows)
    ate = numel * cfg.iters / elapsed
    line = cfg.rate_bps / 32
    return {"system": system, "workers": n, "size_bytes": size, "numel": numel,
            "rate_bps": cfg.rate_bps, "loss_rate": loss_rate, "mtu": cfg.mtu,
            "iters": cfg.iters, "elapsed_s": elapsed, "ate_per_s": ate,
            "bound_line_ate": line,
            "bound_ring_ate": line / (2 * (n - 1) / n) if n > 1 else line,
            "bound_ps_ate": line / n, "fraction_of_line_rate": ate / line}


def _cpu_percent(rows: list[dict[str, Any]]) -> list[float]:
    return [100 * r["cpu_s"] / r["elapsed_s"] for r in rows]


def _cpu_figures(rows: list[dict[str, Any]], elements: float) -> dict[str, Any]:
    """CPU-seconds per 10^9 elements: the worker processes' (summed) and the whole machine's
    over the span from the first worker's timed start to the last one's end."""
    busy = [r["busy"] for r in rows if "busy" in r]
    span = (min(b[0] for b in busy), max(b[1] for b in busy)) if busy else None
    return cpu_per_gelem(worker_cpu_s=[r["cpu_s"] for r in rows], machine_busy=span,
                         elements=elements)


def _switchml_extra(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """switchml's figures summed over its workers: errors, re-sends, datagrams per call."""
    calls = [r.get("system_calls", {}) for r in rows]
    return {
        "max_abs_error": max(r["max_abs_error"] for r in rows),
        "retransmissions": sum(r["retransmissions"] for r in rows),
        "fast_retransmissions": sum(r.get("fast_retransmissions", 0) for r in rows),
        "recovery": {k: sum(r.get("recovery", {}).get(k, 0) for r in rows)
                     for k in RECOVERY_COUNTERS},
        "worker_datagrams_per_recv_call": round(
            sum(c.get("results_received", 0) for c in calls)
            / max(1, sum(c.get("recv_calls", 0) for c in calls)), 2),
        "worker_datagrams_per_send_call": round(
            sum(c.get("packets_sent", 0) for c in calls)
            / max(1, sum(c.get("send_calls", 0) for c in calls)), 2),
    }


def _run_switchml(tb: Testbed, cfg: TestbedBenchConfig, common: dict[str, Any],
                  switch_pid: int, secret: bytes | None = None
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """switchml's workers through the switch: their rows, and the switch's CPU with theirs.
    ``secret``: the switch's (its workers need it to create their jobs)."""
    from switchml.control import encode_job_spec, new_job_spec
    topo = tb.topology
    specs = [encode_job_spec(new_job_spec(cfg.workers // cfg.jobs, window=cfg.window,
                                          elements_per_packet=cfg.elements_per_packet,
                                          auth_data=cfg.auth_data))
             for _ in range(cfg.jobs)]
    # each worker samples the switch's CPU at the start and end of its timed loop: its share
    # of a core over those loops, not over the workers' start-up, warm-up and checks
    common = {**common, "switch_pid": switch_pid}
    if cfg.through_torch:
        rows = _run_switchml_torch(tb, cfg, common)
        switch_cpu = span_cpu_percent([r["watched"] for r in rows if "watched" in r])
        return rows, {**_percent("switch_cpu_percent", switch_cpu),
                      "wire_bits": rows[0]["wire_bits"],
                      "payload_bytes_sent": [r["payload_bytes_sent"] for r in rows],
                      **_switchml_extra(rows)}
    procs = _start_workers(tb, range(cfg.workers), lambda i: _nsproc("switchml", {
        **common, "spec": specs[cfg.job_of(i)[0]], "rank": cfg.job_of(i)[1],
        "switch": topo.switch_ip(i), "port": SWITCH_PORT, "offset": 100 * cfg.job_of(i)[0],
        "fast_retransmit": cfg.fast_retransmit, "bits": cfg.bits, "residual": cfg.residual,
        "threads": cfg.threads, "secret": secret.hex() if secret else None}))
    rows = _wait_all(procs, cfg.timeout_s)
    switch_cpu = span_cpu_percent([r["watched"] for r in rows if "watched" in r])
    return rows, {**_percent("switch_cpu_percent", switch_cpu), **_switchml_extra(rows)}


def _percent(key: str, value: float | None) -> dict[str, float]:
    """``{key: value}``, or nothing where there was no span to measure over."""
    return {} if value is None else {key: value}


def _run_switchml_torch(tb: Testbed, cfg: TestbedBenchConfig, common: dict[str, Any]
                        ) -> list[dict[str, Any]]:
    """switchml's workers through its torch backend (``dist.all_reduce`` of ``cfg.dtype``
    tensors on a "switchml" group), each at the switch behind its own link."""
    port, k = 29000 + secrets.randbelow(20000), cfg.elements_per_packet
    with _store_dir() as store:
        procs = _start_workers(tb, range(cfg.workers), lambda i: _nsproc("switchml-torch", {
            **common, "rank": i, "n": cfg.workers, "master": tb.topology.worker_ip(0),
            "port": port, "store_file": f"{store}/group"}),
            lambda i: {**os.environ, "GLOO_SOCKET_IFNAME": tb.host_device(i),
                       "SWITCHML_SWITCH": f"{tb.topology.switch_ip(i)}:{SWITCH_PORT}",
                       "SWITCHML_ELEMENTS_PER_PACKET": str(k),
                       "SWITCHML_WINDOW": str(cfg.window or default_window(k))})
        return _wait_all(procs, cfg.timeout_s)


C10D_ABORT = "terminate called without an active exception"
"""What torch's C++ prints when a process aborts (``std::terminate``: a thread of its process
group destroyed while joinable). Seen on the testbed in about one run in seven while a TCP
store formed the group (torch 2.13, in a namespace without DNS: it warns that the client's host
name cannot be retrieved, then aborts; the benchmarks now rendezvous through files), and since
then, rarer, with a file store (one training row in about thirty, 2026-12-02; where in the
process's life is not known: it printed nothing else). A process that aborts reports no row,
so the run is not half-counted: it is run again, once."""

_T = TypeVar("_T")


def once_more_if_torch_aborted(run: Callable[[], _T], what: str,
                               before_retry: Callable[[], None] | None = None) -> _T:
    """``run()``; if one of its processes aborted in torch's C++ (``C10D_ABORT``), say so and
    run it once more (``before_retry`` first). Any other failure, or a second abort, raises."""
    try:
        return run()
    except TestbedError as exc:
        if C10D_ABORT not in str(exc):
            raise
        log.warning("%s: a process aborted in torch's C++ (%s); running it again", what,
                    str(exc).splitlines()[-1])
    if before_retry is not None:
        before_retry()
    return run()


def _run_gloo(tb: Testbed, cfg: TestbedBenchConfig, common: dict[str, Any]
              ) -> list[dict[str, Any]]:
    """gloo's ring all-reduce over the workers' links: their rows."""
    return once_more_if_torch_aborted(lambda: _run_gloo_once(tb, cfg, common),
                                      "gloo's all-reduce")


def _run_gloo_once(tb: Testbed, cfg: TestbedBenchConfig, common: dict[str, Any]
                   ) -> list[dict[str, Any]]:
    n, port = cfg.workers // cfg.jobs, 29000 + secrets.randbelow(20000)
    # gloo binds to the address its host name resolves to; name the link instead.
    with _store_dir() as store:
        procs = _start_workers(tb, range(cfg.workers), lambda i: _nsproc("gloo", {
            **common, "rank": cfg.job_of(i)[1], "n": n,
            "master": tb.topology.worker_ip(cfg.job_of(i)[0]), "port": port + cfg.job_of(i)[0],
            "store_file": f"{store}/group{cfg.job_of(i)[0]}"}),
            lambda i: {**os.environ, "GLOO_SOCKET_IFNAME": tb.host_device(i)})
        return _wait_all(procs, cfg.timeout_s)


@contextlib.contextmanager
def _store_dir() -> Iterator[str]:
    """A temporary folder for a torch process group's FileStore (every namespace sees the
    file system; torch's TCP store aborted now and then in these namespaces: ``C10D_ABORT``),
    removed afterwards."""
    path = tempfile.mkdtemp(prefix="switchml-store-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run_ps(tb: Testbed, cfg: TestbedBenchConfig, common: dict[str, Any]
            ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The parameter server on its own host: the workers' rows, and the server's CPU."""
    n, port = cfg.workers, 31000 + secrets.randbelow(20000)
    server = _expect_ready(tb.popen(tb.ps_ns, _nsproc("ps-server", {
        "numel": common["numel"], "n": n, "port": port, "rounds": cfg.warmup + cfg.iters}),
        **_PIPE), "the parameter server did not start")
    procs = _start_workers(tb, range(n), lambda r: _nsproc("ps", {
        **common, "rank": r, "server": tb.topology.ps_ip, "port": port}))
    rows = _wait_all(procs, cfg.timeout_s)
    return rows, {"server_cpu_s": _wait_all([server], 60)[0]["cpu_s"]}


def _run_floor(tb: Testbed, cfg: TestbedBenchConfig, common: dict[str, Any]
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The floor (``bench/floor.py``): the same bytes echoed through a hub in the switch's
    place, in switchml's datagrams for the MTU, with switchml's bytes in flight."""
    hub = _start_server(tb, tb.switch_ns, "floor-hub", {"port": FLOOR_PORT},
                        "the floor's hub did not start in the switch namespace")
    datagram = 40 + 4 * cfg.elements_per_packet
    window = (cfg.window or default_window(cfg.elements_per_packet)) * datagram
    try:
        procs = _start_workers(tb, range(cfg.workers), lambda r: _nsproc("floor", {
            **common, "hub": tb.topology.switch_ip(r), "port": FLOOR_PORT,
            "datagram_bytes": datagram, "window_bytes": window}))
        rows = _wait_all(procs, cfg.timeout_s)
    finally:
        line = _stop_servers([hub])[0]
    hub_cpu = json.loads(line)["cpu_s"] if line else None
    return rows, {"hub_cpu_s": hub_cpu, "timeouts": sum(r.get("timeouts", 0) for r in rows)}


def _measure(tb: Testbed, cfg: TestbedBenchConfig, system: str, size: int,
             switch_pid: int, secret: bytes | None = None) -> dict[str, Any]:
    """One all-reduce measurement of ``system`` at ``size`` bytes: its result row."""
    common = {"numel": size // 4, "warmup": cfg.warmup, "iters": cfg.iters,
              "dtype": cfg.dtype}
    extra: dict[str, Any] = {}
    if system == "switchml":
        rows, extra = _run_switchml(tb, cfg, common, switch_pid, secret)
    elif system == "gloo":
        rows = _run_gloo(tb, cfg, common)
    elif system == "floor":
        rows, extra = _run_floor(tb, cfg, common)
    else:
        rows, extra = _run_ps(tb, cfg, common)
    return {**_ate_row(cfg, system, cfg.workers // cfg.jobs, size, rows, cfg.loss_rate),
            "jobs": cfg.jobs, "dtype": cfg.dtype, "through_torch": cfg.through_torch,
            "auth_data": cfg.auth_data and system == "switchml",
            # the wire width (through torch, the backend's choice for the dtype: "wire_bits")
            **({"bits": cfg.bits} if system == "switchml" and not cfg.through_torch else {}),
            **({"threads": cfg.threads} if system == "switchml" else {}),
            "cpu_percent": _cpu_percent(rows),
            **_cpu_figures(rows, common["numel"] * cfg.iters), **extra}


def _start_switch(tb: Testbed, nack_gap: int = 4, nice: int = 0,
                  secret: bytes | None = None) -> subprocess.Popen[str]:
    """Start the software switch in the switch namespace; it stops when its stdin closes.
    ``nice``: its scheduling niceness (negative: ahead of the workers for the CPU).
    ``secret``: the switch's (a throwaway of one run, on the command line of a process in the
    testbed's own namespace)."""
    return _start_server(tb, tb.switch_ns, "switch",
                         {"port": SWITCH_PORT, "nack_gap": nack_gap, "nice": nice,
                          "secret": secret.hex() if secret else None},
                         "the switch did not start in its namespace")


def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """One line of a child's stdout, or "" if none comes within ``timeout_s`` (never a hang;
    the main thread also gets back to signal handlers)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            return proc.stdout.readline()
        if proc.poll() is not None:
            return ""
    return ""


def _topology(workers: int, rate_bps: float, loss_rate: float, mtu: int) -> Topology:
    return Topology(workers=workers, link=LinkSpec(bandwidth_bps=rate_bps, loss_rate=loss_rate,
                                                   mtu=mtu))


def run_testbed_allreduce(cfg: TestbedBenchConfig, progress: Any = None
                          ) -> list[dict[str, Any]]:
    """Build the testbed, run every (size, system), tear it down; return the rows."""
    topo = _topology(cfg.workers, cfg.rate_bps, cfg.loss_rate, cfg.mtu)
    rows: list[dict[str, Any]] = []
    secret = secrets.token_bytes(32) if cfg.auth_data else None
    with Testbed(topo) as tb:
        switch = _start_switch(tb, cfg.nack_gap, secret=secret)
        for size in cfg.sizes_bytes:
            for system in cfg.systems:
                if progress is not None:
                    progress(f"{system}, n={cfg.workers}, {size} B, "
                             f"{cfg.rate_bps / 1e6:g} Mbit/s, loss {cfg.loss_rate:g}")
                rows.append(_measure(tb, cfg, system, size, switch.pid, secret))
        line = _stop_servers([switch])[0]
        if not line:
            raise TestbedError("the switch did not report its counters when stopped")
        stats = json.loads(line)
        for r in rows:
            r["testbed_losses"] = None
            if not tb.batching:
                r["degraded"] = DEGRADED_NO_ETHTOOL
        if rows:
            rows[-1]["switch_final"] = stats
            rows[-1]["testbed_losses"] = tb.loss_counter()
    return rows


DEGRADED_NO_ETHTOOL = ("no ethtool: UDP GSO/GRO off in the testbed, one system call per "
                       "datagram (apt-get install ethtool)")
"""What a row measured without ethtool says: not the batched data path users run."""


def write_outputs(rows: list[dict[str, Any]], json_path: str | None,
                  csv_path: str | None) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"benchmark": "allreduce-testbed", "machine": {
                "cpus": os.cpu_count(), "uname": " ".join(os.uname())}, "results": rows},
                f, indent=2)
    if csv_path:
        import csv
        keys = ["system", "workers", "size_bytes", "rate_bps", "loss_rate", "mtu", "ate_per_s",
                "bound_line_ate", "bound_ring_ate", "bound_ps_ate", "fraction_of_line_rate",
                "elapsed_s", "switch_cpu_percent", "worker_cpu_s_per_gelem",
                "machine_cpu_s_per_gelem", "degraded"]
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            for r in rows:
                w.writerow(r)
