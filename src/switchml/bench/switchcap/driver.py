"""The parent side of the switch capacity benchmark: start the shards and the generators, pin
them to cores, run the phases (join, first result, warm-up, interval, drain) and stop them all.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from switchml.bench.cpu import machine_busy_s, proc_cpu_s
from switchml.bench.switchcap.config import SwitchCapConfig, SwitchCapResult
from switchml.bench.switchcap.generator import generator_main
from switchml.bench.switchcap.report import result_of
from switchml.bench.switchproc import SwitchProcess
from switchml.protocol.address import format_address

__all__ = ["run_switchcap"]


def _pin_process(pid: int, cpu: int) -> None:
    """Pin every thread of ``pid`` (affinity is per thread on Linux) to ``cpu``."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {cpu})
        except OSError:  # a thread that just ended
            pass


@dataclass
class _Generators:
    """The generator processes and the parent's ends of their pipes."""

    procs: list[Any] = field(default_factory=list)
    conns: list[Any] = field(default_factory=list)

    def recv_all(self, timeout_s: float, what: str) -> list[Any]:
        """Every generator's next message body (all of the same kind)."""
        return [_recv(c, p, timeout_s, what)[1] for c, p in zip(self.conns, self.procs)]

    def send_all(self, msg: Any) -> None:
        for c in self.conns:
            c.send(msg)

    def cpu_s(self) -> list[float]:
        return [proc_cpu_s(p.pid) for p in self.procs]


def _recv(conn: Any, proc: Any, timeout_s: float, what: str) -> tuple[str, Any]:
    """The generator's next message, or an error naming what did not happen in time."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(min(0.25, max(0.0, deadline - time.monotonic()))):
        if not proc.is_alive():
            raise RuntimeError(f"the generator process exited with {proc.exitcode} before "
                               f"{what}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the generator did not report {what} within {timeout_s:g} s")
    kind, body = conn.recv()
    if kind == "error":
        raise RuntimeError(f"the generator failed: {body}")
    return kind, body


def _switch_snapshot(sws: list[SwitchProcess]) -> dict[str, Any]:
    """Every shard's counters and CPU at one instant (CPU first: the stats call costs the
    switch)."""
    cpu = [proc_cpu_s(sw.proc.pid) for sw in sws]
    busy = machine_busy_s()
    t = time.monotonic()
    stats = []
    for i, sw in enumerate(sws):
        if not sw.proc.is_alive():
            raise RuntimeError(f"switch shard {i}/{len(sws)} at {format_address(sw.address)} "
                               f"exited with {sw.proc.exitcode}")
        stats.append(sw.stats())
    return {"t": t, "cpu_s": cpu, "busy_s": busy, "stats": stats}


@contextlib.contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Start processes with SIGINT ignored (the disposition survives exec, and Python keeps
    it): on Ctrl-C only this process gets KeyboardInterrupt, and its teardown stops them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _placement(cfg: SwitchCapConfig, cores: list[int]
               ) -> tuple[int, list[int | None], list[int | None]]:
    """How many generators, and the core each shard and each generator is pinned to (None:
    not pinned). Every process gets a core of its own where there are enough; otherwise the
    shards get one each (round robin) and the generators float."""
    s = cfg.shards
    g = cfg.generators or s
    if len(cores) >= s + g:
        return g, list(cores[:s]), list(cores[s:s + g])
    if len(cores) >= 2:
        return g, [cores[i % len(cores)] for i in range(s)], [None] * g
    return g, [None] * s, [None] * g


def run_switchcap(cfg: SwitchCapConfig,
                  progress: Callable[[str, float], None] | None = None) -> SwitchCapResult:
    """Run the benchmark; everything it started is stopped when it returns or raises.

    ``progress(text, fraction)``: optional, called about four times a second.
    """
    from switchml.control import new_job_spec

    def tell(text: str, fraction: float) -> None:
        if progress is not None:
            progress(text, fraction)

    cores = sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()[0]
    n_gen, switch_cpus, gen_cpus = _placement(cfg, cores)
    ctx = mp.get_context("spawn")
    spec = new_job_spec(cfg.workers, window=cfg.window,
                        elements_per_packet=cfg.elements_per_packet)
    tell("starting the switch" if cfg.shards == 1 else f"starting {cfg.shards} shards", 0.0)
    sws: list[SwitchProcess] = []
    gens = _Generators()
    ok = False
    try:
        with _children_ignore_sigint():  # Ctrl-C reaches this process only; it stops the others
            for i in range(cfg.shards):
                sws.append(SwitchProcess(ctx, batching=cfg.batching, shard=(i, cfg.shards)))
        for g in range(n_gen):
            mine = [(i, sws[i].address) for i in range(cfg.shards) if i % n_gen == g]
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=generator_main, daemon=True,
                               args=(child_conn, mine, asdict(cfg), spec.job_id, spec.token,
                                     gen_cpus[g]))
            with _children_ignore_sigint():
                proc.start()
            child_conn.close()
            gens.procs.append(proc)
            gens.conns.append(parent_conn)
        samples = _measure(cfg, sws, gens, switch_cpus, tell)
        ok = True
    finally:
        for proc in gens.procs:
            _stop_generator(proc, ok)
        for conn in gens.conns:
            conn.close()
        for sw in sws:
            sw.stop()
    pinned = {"switch_cpu": switch_cpus[0], "generator_cpu": gen_cpus[0], "cores": len(cores),
              "switch_cpus": switch_cpus, "generator_cpus": gen_cpus}
    return result_of(cfg, samples, pinned, load_before)


def _measure(cfg: SwitchCapConfig, sws: list[SwitchProcess], gens: _Generators,
             switch_cpus: list[int | None], tell: Callable[[str, float], None]
             ) -> dict[str, Any]:
    """Join, warm up, measure, drain: the generators' reports and the shards' snapshots.

    Every generator runs the same interval: it starts ``warmup_s`` after the last shard's
    first result (shards may compile their data plane first, each at its own pace)."""
    tell("joining", 0.0)
    gens.recv_all(60.0, "joining the job")
    for sw, cpu in zip(sws, switch_cpus):
        if cpu is not None:
            _pin_process(sw.proc.pid, cpu)  # all its threads exist by now
    first = _switch_snapshot(sws)
    gens.send_all("go")
    tell("waiting for the first result (the switch may be compiling)", 0.0)
    first_s = max(gens.recv_all(cfg.first_result_timeout_s + 30.0,
                                "the switch's first result"))
    gens.send_all(time.monotonic() + cfg.warmup_s)  # one interval for every generator
    tell("warming up", 0.0)
    g_mark = gens.recv_all(cfg.warmup_s + 30.0, "the start of the interval")
    s_mark = _switch_snapshot(sws)
    c_gen0 = gens.cpu_s()
    _wait_for_interval(cfg, gens, tell)
    s_end = _switch_snapshot(sws)
    c_gen1 = gens.cpu_s()
    g_end = gens.recv_all(5.0, "the end of the interval")
    tell("draining", 1.0)
    reports = gens.recv_all(cfg.drain_s + 30.0, "its final counters")
    final = _switch_snapshot(sws)
    return {"first": first, "first_s": first_s, "g_mark": g_mark, "s_mark": s_mark,
            "c_gen0": c_gen0, "s_end": s_end, "c_gen1": c_gen1, "g_end": g_end,
            "reports": reports, "final": final}


def _wait_for_interval(cfg: SwitchCapConfig, gens: _Generators,
                       tell: Callable[[str, float], None]) -> None:
    """Until every generator says the interval ended (their messages are left in the
    pipes)."""
    t_end = time.monotonic() + cfg.seconds
    pending = list(zip(gens.conns, gens.procs))
    while pending:
        pending = [(c, p) for c, p in pending if not c.poll(0.25 / len(pending))]
        left = t_end - time.monotonic()
        for _c, p in pending:
            if not p.is_alive():
                raise RuntimeError(f"the generator process exited with {p.exitcode}")
        if left < -30.0:
            raise TimeoutError("the generator did not end the interval in time")
        tell(f"measuring ({max(left, 0):.0f} s left)",
             min(1.0, 1.0 - max(left, 0.0) / cfg.seconds))


def _stop_generator(gen: Any, ok: bool) -> None:
    """Let the generator end (terminate it first after a failure); kill it if it lingers."""
    if not ok:
        gen.terminate()
    gen.join(timeout=5)
    if gen.is_alive():
        gen.terminate()
        gen.join(timeout=5)
    if gen.is_alive():
        gen.kill()
        gen.join()
