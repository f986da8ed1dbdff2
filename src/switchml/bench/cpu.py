"""CPU per unit of work: the figure every throughput figure is reported with.

Two views, both in CPU-seconds per 10^9 aggregated elements (per worker: a worker that
all-reduces N elements k times aggregated k N): the **worker processes** (their user and
system time over the timed operations, summed: what a training host pays) and the **whole
machine** (busy time of every CPU from ``/proc/stat`` over the same span: the switch, softirq
and everything else on the box included). Compare them only with figures of the same run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["GIGA", "cpu_per_gelem", "machine_busy_s", "proc_cpu_s", "ratio_text",
           "sample_processes", "span_cpu_percent"]

GIGA = 1e9
_CPUCLOCK_SCHED = 2  # a process-wide CPU-time clock (the kernel's MAKE_PROCESS_CPUCLOCK)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (not idle, iowait)


def machine_busy_s() -> float:
    """Busy CPU-seconds of the whole machine since boot (all CPUs, ``/proc/stat``); 0.0 where
    there is no ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    return sum(int(fields[i]) for i in _BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """CPU-seconds (user + system, all threads, ended ones included) of process ``pid`` so
    far: its CPU-time clock (Linux numbers a process's clock from its pid as glibc's
    ``clock_getcpuclockid`` does; to the nanosecond for a process that sleeps, to the
    scheduler's tick for one that runs), else ``/proc/<pid>/stat`` (whole clock ticks).

    Raises:
        OSError: no such process (``FileNotFoundError``), or no ``/proc``."""
    try:
        return time.clock_gettime(((~pid) << 3) | _CPUCLOCK_SCHED)
    except OSError:
        pass
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sample_processes(pids: Sequence[int]) -> list[float] | None:
    """``[now, CPU-seconds]``: the time (``time.monotonic``, one clock for every process of
    the machine) and the CPU of the processes ``pids`` (summed; ``proc_cpu_s``): what a worker
    takes at the start and at the end of its timed loop, so that a process it talks to (the
    switch) is measured over that loop and not over the benchmark's start-up and checks. None
    where a process's CPU cannot be read (no such process, or no ``/proc``). A running
    process's clock moves at the scheduler's ticks: trust spans of tens of milliseconds."""
    try:
        return [time.monotonic(), sum(proc_cpu_s(p) for p in pids)]
    except OSError:
        return None


def span_cpu_percent(spans: Sequence[Sequence[float]]) -> float | None:
    """The processes' CPU, in percent of one core, from the first worker's start to the last
    worker's end: ``spans`` holds each worker's ``sample_processes`` at its start and at its
    end, ``[t0, cpu0, t1, cpu1]``. None without a span (no sample, or no time between)."""
    if not spans:
        return None
    start = min(spans, key=lambda s: s[0])
    end = max(spans, key=lambda s: s[2])
    if end[2] <= start[0]:
        return None
    return 100.0 * (end[3] - start[1]) / (end[2] - start[0])


def cpu_per_gelem(*, worker_cpu_s: Sequence[float], machine_busy: tuple[float, float] | None,
                  elements: float) -> dict[str, Any]:
    """The figures of one measurement: ``worker_cpu_s_per_gelem`` (the worker processes' CPU
    summed) and ``machine_cpu_s_per_gelem`` (``machine_busy`` = busy seconds at the start and
    end of the timed span), per 10^9 elements aggregated per worker (``elements``)."""
    g = elements / GIGA
    out: dict[str, Any] = {"worker_cpu_s_per_gelem": sum(worker_cpu_s) / g}
    if machine_busy is not None and machine_busy[1] > machine_busy[0]:
        out["machine_cpu_s_per_gelem"] = (machine_busy[1] - machine_busy[0]) / g
    return out


def ratio_text(value: float | None, baseline: float | None) -> str:
    """``"12.3 (0.56x)"``: a figure and its ratio to the baseline's, or what there is."""
    if value is None:
        return "-"
    if not baseline:
        return f"{value:.1f}"
    return f"{value:.1f} ({value / baseline:.2f}x)"
