"""A timeline of compute and communication spans, written as Chrome trace JSON (Perfetto).

Spans are wall-clock intervals (``time.perf_counter`` seconds) recorded by whoever does the work:
the training loop (forward, backward, optimizer), :class:`switchml.torch.HybridDataParallel`
(each bucket's all-reduce and each layer's sufficient-factor all-gather, from launch to
completion) or :func:`traced_allreduce_hook` for torch's DDP. :func:`chrome_events` turns them
into ``"X"`` (complete) events with ``ts``/``dur`` in microseconds, ``pid`` = the rank and
``tid`` = ``compute`` or ``comm``; :func:`hidden_fraction` says how much of the communication
time overlapped backward computation (Poseidon's wait-free backpropagation, made visible).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Span", "Timeline", "chrome_events", "hidden_fraction", "traced_allreduce_hook",
           "traced_hook", "write_chrome_trace"]

COMPUTE = "compute"
COMM = "comm"


@dataclass(frozen=True, slots=True)
class Span:
    """One interval of work on one thread of activity."""

    name: str
    tid: str
    """``compute`` or ``comm``."""
    start_s: float
    end_s: float
    args: dict[str, Any] = field(default_factory=dict)


class Timeline:
    """Spans recorded from any thread (communication completes on backend threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[Span] = []

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def record(self, name: str, tid: str, start_s: float, end_s: float,
               **args: Any) -> None:
        """Add the span ``[start_s, end_s]`` (``time.perf_counter`` seconds)."""
        if tid not in (COMPUTE, COMM):
            raise ValueError(f"tid must be {COMPUTE!r} or {COMM!r}, got {tid!r}")
        with self._lock:
            self.spans.append(Span(name, tid, start_s, max(end_s, start_s), args))

    def record_work(self, name: str, work: Any, **args: Any) -> None:
        """Record a communication span from now until ``work`` (a ``dist.Work``) completes."""
        start = self.now()
        work.get_future().add_done_callback(
            lambda _f: self.record(name, COMM, start, self.now(), **args))

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)


def chrome_events(spans: list[Span], *, pid: int, origin_s: float,
                  process_name: str | None = None) -> list[dict[str, Any]]:
    """Chrome trace events for ``spans``: ``X`` events, ts/dur in microseconds from
    ``origin_s``, plus metadata naming the process and its two threads."""
    tids = {COMPUTE: 0, COMM: 1}
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[t], "args": {"name": t}}
        for t in tids]
    if process_name is not None:
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": process_name}})
    for s in spans:
        events.append({"ph": "X", "name": s.name, "cat": s.tid, "pid": pid, "tid": tids[s.tid],
                       "ts": round((s.start_s - origin_s) * 1e6, 1),
                       "dur": round((s.end_s - s.start_s) * 1e6, 1), "args": s.args})
    return events


def write_chrome_trace(path: str, events: list[dict[str, Any]]) -> None:
    """Write ``{"traceEvents": events}`` (open it in https://ui.perfetto.dev)."""
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def hidden_fraction(comm: list[tuple[float, float]],
                    compute: list[tuple[float, float]]) -> float | None:
    """The fraction of communication time (union of ``comm`` intervals) that overlaps
    computation (union of ``compute`` intervals); None when there is no communication."""
    c, k = _union(comm), _union(compute)
    total = _length(c)
    if total <= 0:
        return None
    overlap, j = 0.0, 0
    for s, e in c:
        while j < len(k) and k[j][1] <= s:
            j += 1
        i = j
        while i < len(k) and k[i][0] < e:
            overlap += min(e, k[i][1]) - max(s, k[i][0])
            i += 1
    return overlap / total


def traced_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """A DDP communication hook: average the bucket with ``dist.all_reduce`` (as DDP's
    default does) and record the all-reduce as a ``comm`` span on the timeline.

    ``state`` is ``(process_group or None, timeline)``. Usage:
    ``ddp.register_comm_hook((None, timeline), traced_allreduce_hook)``. (No annotations: DDP
    rejects any but the real ``dist.GradBucket``, and this module does not import torch.)
    """
    import torch.distributed as dist

    # 1. launch the sum over the group, timed from launch to completion
    group, timeline = state
    buf = bucket.buffer()
    work = dist.all_reduce(buf, group=group, async_op=True)
    timeline.record_work(f"allreduce bucket {bucket.index()}", work, bytes=buf.numel() * 4,
                         params=len(bucket.parameters()))
    world = dist.get_world_size(group)

    # 2. divide by the world size, as DDP's default hook does
    def average(fut: Any) -> Any:
        return fut.value()[0].div_(world)

    return work.get_future().then(average)


def traced_hook(state, bucket):  # type: ignore[no-untyped-def]
    """A DDP communication hook that runs another hook and records its work, from the call to
    the future's completion, as a ``comm`` span.

    ``state`` is ``(inner_state, inner_hook, timeline)``. Usage:
    ``ddp.register_comm_hook((hook_state, switchml_hook, timeline), traced_hook)``."""
    inner_state, inner_hook, timeline = state
    start = timeline.now()
    name = f"allreduce bucket {bucket.index()}"
    numel = bucket.buffer().numel()

    def done(fut: Any) -> Any:
        timeline.record(name, COMM, start, timeline.now(), elements=numel)
        return fut.value()

    return inner_hook(inner_state, bucket).then(done)
