"""Soak and fuzz runs against a switch process: the promise is exact results or errors, never
a wrong sum, a crash, a hang or unbounded memory.

``run_soak``: several jobs of worker processes all-reduce int32 data (exact, so every result is
checked bit for bit) with seeded loss injected in every worker, while jobs are stopped and
started and workers are killed (SIGKILL) at random. Reports operations completed, errors raised
(expected after a kill), wrong results (must be 0), and the switch's memory over time.

``run_fuzz``: a legitimate job runs while sender processes throw hostile datagrams at the switch
(random bytes, truncated and oversized datagrams, valid headers with wrong fields, forged
requests for the live job, floods). Reports the switch's drop counters, the legitimate job's
results (must stay exact) and the switch's memory before, during and after.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from switchml.bench.switchproc import SwitchProcess
from switchml.protocol.wire import (
    COOKIE_SIZE,
    HEADER_SIZE,
    PROOF_SIZE,
    ControlInfo,
    ElementType,
    Flags,
    Header,
    MessageType,
    pack_control_info,
    pack_header,
    pack_join,
)

__all__ = ["FuzzConfig", "SoakConfig", "run_fuzz", "run_soak"]


def _expected(job_seed: int, op: int, n: int, numel: int) -> np.ndarray:
    total = np.zeros(numel, dtype=np.int64)
    for r in range(n):
        total += _input(job_seed, op, r, numel)
    return total.astype(np.int32)


def _input(job_seed: int, op: int, rank: int, numel: int) -> np.ndarray:
    rng = np.random.default_rng([job_seed, op, rank])
    return rng.integers(-2**24, 2**24, numel, dtype=np.int32)


def _soak_worker(switch: tuple[str, int], spec_text: str, rank: int, job_seed: int,
                 numel: int, loss_rate: float, op_timeout_s: float, results: Any) -> None:
    from switchml.control import decode_job_spec
    from switchml.protocol.config import WorkerConfig
    from switchml.protocol.errors import SwitchMLError
    from switchml.transport.faults import LossyEndpoint
    from switchml.transport.udp import WorkerClient
    spec = decode_job_spec(spec_text)
    done = wrong = 0
    error = None
    try:
        cfg = WorkerConfig(op_timeout_s=op_timeout_s, max_rto_s=0.5, keepalive_s=1.0)
        seed = job_seed * 1000 + rank
        with WorkerClient(switch, spec, rank, cfg, wrap=lambda session: LossyEndpoint(
                session, loss_rate, seed)) as w:
            op = 0
            while True:
                out = w.allreduce(_input(job_seed, op, rank, numel))
                if not np.array_equal(out, _expected(job_seed, op, spec.num_workers, numel)):
                    wrong += 1
                done += 1
                op += 1
                if op % 5 == 0:
                    results.put(("progress", job_seed, rank, done, wrong))
                    done = wrong = 0
    except SwitchMLError as exc:
        error = f"{type(exc).__name__}: {exc}"
    except BaseException as exc:  # noqa: BLE001 - reported
        error = f"unexpected {type(exc).__name__}: {exc}"
    results.put(("end", job_seed, rank, done, wrong, error))


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 60.0
    jobs: int = 3
    workers: int = 2
    numel: int = 50_000
    loss_rate: float = 0.01
    churn_interval_s: float = 5.0
    """Every this often, one random job is stopped cleanly or has a worker killed."""
    kill_fraction: float = 0.5
    lease_timeout_s: float = 5.0
    op_timeout_s: float = 5.0
    seed: int = 0


@dataclass
class SoakReport:
    config: dict[str, Any]
    operations: int = 0
    wrong_results: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    jobs_started: int = 0
    jobs_stopped: int = 0
    workers_killed: int = 0
    memory: list[tuple[float, int]] = field(default_factory=list)  # (seconds, switch RSS)
    switch_stats: dict[str, Any] = field(default_factory=dict)


def _rss_sample(switch: SwitchProcess, start: float) -> tuple[float, int]:
    """(seconds since ``start``, the switch's RSS): one point of a memory series."""
    return (round(time.monotonic() - start, 1), switch.rss())


class _Soak:
    """The jobs of one soak run: starting them, stopping them, killing their workers."""

    def __init__(self, cfg: SoakConfig, ctx: Any, rng: random.Random,
                 switch: SwitchProcess) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.rng = rng
        self.switch = switch
        self.results = ctx.Queue()
        self.report = SoakReport(config=cfg.__dict__.copy())
        self.jobs: dict[int, list[Any]] = {}
        self.next_seed = 1

    def start_job(self) -> None:
        """Start a job of ``cfg.workers`` worker processes under the next seed."""
        from switchml.control import encode_job_spec, new_job_spec
        cfg = self.cfg
        seed, self.next_seed = self.next_seed, self.next_seed + 1
        spec = encode_job_spec(new_job_spec(cfg.workers, window=8, elements_per_packet=4096))
        procs = [self.ctx.Process(target=_soak_worker, args=(
            self.switch.address, spec, r, seed, cfg.numel, cfg.loss_rate, cfg.op_timeout_s,
            self.results), daemon=True) for r in range(cfg.workers)]
        for p in procs:
            p.start()
        self.jobs[seed] = procs
        self.report.jobs_started += 1

    def stop_job(self, seed: int, kill_one: bool) -> None:
        """Stop job ``seed``; with ``kill_one``, SIGKILL one worker first and let the others
        fail on their own."""
        procs = self.jobs.pop(seed)
        if kill_one:
            victim = self.rng.choice(procs)
            os.kill(victim.pid, signal.SIGKILL)  # a crash: no LEAVE
            self.report.workers_killed += 1
            # Its peers must fail on their own within op_timeout_s; give them that long.
            for p in procs:
                p.join(timeout=self.cfg.op_timeout_s + 10)
        for p in procs:
            if p.is_alive():
                p.terminate()  # the rest stop at once (SIGTERM, no LEAVE: the lease frees them)
            p.join(timeout=5)
        self.report.jobs_stopped += 1

    def churn(self, start: float, progress: Any) -> None:
        """Until ``cfg.duration_s``: sample memory, replace a job every churn interval."""
        cfg, rng, report = self.cfg, self.rng, self.report
        next_churn = start + cfg.churn_interval_s
        next_sample = start
        while time.monotonic() - start < cfg.duration_s:
            now = time.monotonic()
            if now >= next_sample:
                report.memory.append((round(now - start, 1), self.switch.rss()))
                next_sample = now + 1.0
                if progress is not None:
                    progress(report)
            if now >= next_churn:
                seed = rng.choice(sorted(self.jobs))
                self.stop_job(seed, kill_one=rng.random() < cfg.kill_fraction)
                self.start_job()
                next_churn = time.monotonic() + cfg.churn_interval_s
            _drain(self.results, report, timeout=0.2)

    def finish(self, start: float) -> None:
        """Stop every job, then wait for the leases to give their slots back."""
        for seed in list(self.jobs):
            self.stop_job(seed, kill_one=False)
        _drain(self.results, self.report, timeout=1.0)
        # Stopped workers never sent LEAVE: their leases must give every slot back.
        time.sleep(self.cfg.lease_timeout_s + 1.5)
        self.report.memory.append(_rss_sample(self.switch, start))
        self.report.switch_stats = self.switch.stats()

    def kill_all(self) -> None:
        """SIGKILL whatever worker is left."""
        for procs in self.jobs.values():
            for p in procs:
                p.kill()


def run_soak(cfg: SoakConfig, progress: Any = None) -> SoakReport:
    """Run the soak; ``progress(report)`` is called about once a second."""
    ctx = mp.get_context("spawn")
    rng = random.Random(cfg.seed)
    switch = SwitchProcess(ctx, cfg.lease_timeout_s)
    soak = _Soak(cfg, ctx, rng, switch)
    start = time.monotonic()
    try:
        for _ in range(cfg.jobs):
            soak.start_job()
        soak.churn(start, progress)
        soak.finish(start)
    finally:
        soak.kill_all()
        switch.stop()
    return soak.report


def _drain(results: Any, report: SoakReport, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = results.get(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:
            return
        report.operations += msg[3]
        report.wrong_results += msg[4]
        if msg[0] == "end" and msg[5]:
            report.errors += 1
            if len(report.error_samples) < 5:
                report.error_samples.append(msg[5])


# -- fuzz ---------------------------------------------------------------------------------------

_T = MessageType
_TYPES = [_T.REQUEST, _T.RESULT, _T.WAITING, _T.UNKNOWN_JOB, _T.JOIN, _T.LEAVE, _T.KEEPALIVE,
          _T.REFUSED]


def _header(**fields: int) -> bytes:
    """A header from ``wire``'s table (fields as ``wire.Header`` names them; the type may be
    any byte, known or not)."""
    return pack_header(Header(**{"type": _T.REQUEST, "elem": ElementType.INT32, **fields}))


def _fuzz_sender(address: tuple[str, int], count: int, seed: int, live_job: int,
                 rate: float, done: Any, joins: bool = False) -> None:
    """Send ``count`` hostile datagrams of every kind at about ``rate`` per second (paced so
    that the switch reads them rather than the kernel dropping them at its socket); with
    ``joins``, only well-formed JOINs of random new jobs, by turns asking for a challenge and
    answering one with a forged cookie (what a flood that means to cost the switch sends)."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(4)]
    kinds = 0
    data_flag = int(Flags.HAS_DATA)
    info = ControlInfo(num_workers=4, window=64, elements_per_packet=358)
    for i in range(count):
        kind = i % 7
        if joins:
            data = pack_join(job=rng.getrandbits(32), token=rng.getrandbits(64), rank=0,
                             info=info, **({} if i % 2 else {
                                 "cookie": rng.randbytes(COOKIE_SIZE),
                                 "proof": rng.randbytes(PROOF_SIZE)}))
        elif kind == 0:  # random bytes
            data = rng.randbytes(rng.randrange(0, 1500))
        elif kind == 1:  # truncated header
            data = _header(job=live_job)[:rng.randrange(HEADER_SIZE)]
        elif kind == 2:  # oversized / length mismatch
            data = (_header(flags=data_flag, job=live_job, count=10)
                    + bytes(rng.randrange(HEADER_SIZE + 1, 60000)))
        elif kind == 3:  # valid header, random fields (types, jobs, ranks, slots, sets)
            count_ = rng.randrange(0, 64)
            data = _header(type=rng.choice(_TYPES), flags=rng.randrange(16),
                           set_bit=rng.randrange(2), rank=rng.randrange(65536),
                           job=rng.choice([live_job, rng.getrandbits(32)]),
                           token=rng.getrandbits(64), seq=rng.getrandbits(32),
                           chunk=rng.getrandbits(32), slot=rng.getrandbits(32), count=count_,
                           exp_data=rng.randrange(-2000, 2000)) + bytes(4 * count_)
        elif kind == 4:  # JOIN floods for new jobs (each would take slots if accepted)
            data = _header(type=_T.JOIN, job=rng.getrandbits(32), token=rng.getrandbits(64),
                           count=28, elem=ElementType.BYTES) + pack_control_info(ControlInfo(
                               num_workers=rng.randrange(1, 5000),
                               window=rng.randrange(1, 100000), elements_per_packet=16000,
                               slot_base=0))
        elif kind == 5:  # forged requests for the live job (wrong token, wrong source)
            data = _header(flags=data_flag, set_bit=rng.randrange(2), rank=rng.randrange(4),
                           job=live_job, token=rng.getrandbits(64), seq=rng.randrange(100),
                           chunk=rng.randrange(100), slot=rng.randrange(64),
                           count=256) + bytes(1024)
        else:  # keep-alives and leaves with wrong tokens
            data = _header(type=rng.choice([_T.LEAVE, _T.KEEPALIVE]), rank=rng.randrange(4),
                           job=live_job, token=rng.getrandbits(64), elem=ElementType.BYTES)
        try:
            socks[i % 4].sendto(data, address)
        except OSError:
            pass
        kinds += 1
        if i % 500 == 499:
            ahead = (i + 1) / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    for s in socks:
        s.close()
    done.put((kinds, t0, time.monotonic()))  # (CLOCK_MONOTONIC: one clock for every process)


def _legit_worker(switch: tuple[str, int], spec_text: str, rank: int, secret: bytes | None,
                  stop: Any, results: Any) -> None:
    from switchml.control import decode_job_spec
    from switchml.protocol.config import WorkerConfig
    from switchml.transport.udp import WorkerClient
    spec = decode_job_spec(spec_text)
    done = wrong = 0
    error = None
    try:
        with WorkerClient(switch, spec, rank, WorkerConfig(op_timeout_s=30, secret=secret)) as w:
            op, stopping = 0, False
            while not stopping:
                # The last element carries "stop" through the sum: every rank stops after the
                # same operation (a rank that stopped alone left the other waiting for it).
                x = np.append(_input(7, op, rank, 20_000), np.int32(stop.is_set()))
                out = w.allreduce(x)
                wrong += not np.array_equal(out[:-1],
                                            _expected(7, op, spec.num_workers, 20_000))
                done += 1
                op += 1
                stopping = bool(out[-1])
    except BaseException as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    results.put((rank, done, wrong, error))


@dataclass(frozen=True)
class FuzzConfig:
    datagrams: int = 1_000_000
    senders: int = 2
    rate_per_sender: float = 20_000.0
    """Datagrams per second per sender; 0 for as fast as possible (the kernel then drops
    much of the flood at the switch's socket before the switch sees it)."""
    seed: int = 0
    secret: bool = True
    """Run the switch with a job-creation secret (as it must be when exposed). Without it, the
    JOIN flood creates jobs until the pool is full: memory stays bounded by the pool."""
    joins: bool = False
    """Send only well-formed JOINs of new jobs (half asking for a challenge, half with a
    forged cookie) instead of the seven hostile kinds: the flood issue 36 measures against
    the job's rate."""


def run_fuzz(cfg: FuzzConfig, progress: Any = None) -> dict[str, Any]:
    """Fuzz a fresh switch while a 2-rank job runs; return the figures."""
    from switchml.control import encode_job_spec, new_job_spec
    ctx = mp.get_context("spawn")
    secret = os.urandom(32) if cfg.secret else None
    switch = SwitchProcess(ctx, lease_timeout_s=30.0, secret=secret)
    spec = new_job_spec(2, window=8, elements_per_packet=4096)
    results, done, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    workers = [ctx.Process(target=_legit_worker, args=(
        switch.address, encode_job_spec(spec), r, secret, stop, results), daemon=True)
        for r in range(2)]
    memory: list[tuple[float, int]] = []
    start = time.monotonic()
    try:
        for p in workers:
            p.start()
        time.sleep(1.0)
        quiet = _job_elements(switch, spec.job_id)  # the job alone, for 2 s
        time.sleep(2.0)
        flood = _job_elements(switch, spec.job_id)
        memory.append(_rss_sample(switch, start))
        samples, reports = _flood(cfg, ctx, switch, spec.job_id, done, flood, memory, start,
                                  progress)
        sent = sum(r[0] for r in reports)
        # The job's rate while every sender was sending (not while they were starting).
        lo, hi = max(r[1] for r in reports), min(r[2] for r in reports)
        during = [x for x in samples if lo <= x[0] <= hi] or samples[-2:]
        time.sleep(1.0)
        stop.set()
        legit = [results.get(timeout=60) for _ in workers]
        memory.append(_rss_sample(switch, start))
        stats = switch.stats()
    finally:
        stop.set()
        for p in workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        switch.stop()
    return {
        "datagrams_sent": sent,
        "switch_packets_in": stats["packets_in"],
        "drops": stats["drops"],
        "internal_errors": stats["internal_errors"],
        "legit_operations": sum(r[1] for r in legit),
        "legit_wrong_results": sum(r[2] for r in legit),
        "legit_errors": [r[3] for r in legit if r[3]],
        "memory": memory,
        "jobs_at_end": stats["jobs"],
        "seconds": round(time.monotonic() - start, 1),
        "legit_elements_per_s_alone": _rate(quiet, flood),
        "legit_elements_per_s_during": _rate(during[0], during[-1]),
        "flood_datagrams_per_s": sent / max(max(r[2] for r in reports)
                                           - min(r[1] for r in reports), 1e-9),
    }


def _flood(cfg: FuzzConfig, ctx: Any, switch: SwitchProcess, job_id: int, done: Any,
           first: tuple[float, int], memory: list[tuple[float, int]], start: float,
           progress: Any) -> tuple[list[tuple[float, int]], list[tuple]]:
    """Run ``cfg.senders`` fuzzing processes against ``switch`` until they are done, sampling
    the job's elements (from ``first``) and the switch's memory every 0.5 s; return the
    samples and each sender's report (datagrams sent, start, end)."""
    per_sender = cfg.datagrams // cfg.senders
    senders = [ctx.Process(target=_fuzz_sender, args=(
        switch.address, per_sender, cfg.seed + i, job_id,
        cfg.rate_per_sender or float("inf"), done, cfg.joins), daemon=True)
        for i in range(cfg.senders)]
    for p in senders:
        p.start()
    samples = [first]
    while any(p.is_alive() for p in senders):
        time.sleep(0.5)
        samples.append(_job_elements(switch, job_id))
        memory.append(_rss_sample(switch, start))
        if progress is not None:
            progress(switch.stats())
    return samples, [done.get(timeout=10) for _ in senders]


def _job_elements(switch: SwitchProcess, job_id: int) -> tuple[float, int]:
    """(now, the elements the switch has aggregated for the job so far)."""
    counts = switch.stats()["elements_aggregated"]
    return time.monotonic(), int(counts.get(job_id, counts.get(str(job_id), 0)))


def _rate(a: tuple[float, int], b: tuple[float, int]) -> float:
    return (b[1] - a[1]) / max(b[0] - a[0], 1e-9)
