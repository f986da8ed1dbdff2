"""A training step's profile for ``switchml predict`` (``predict.py``, step 1 of its method):
forward, backward and optimizer time, the gradient buckets in the order DDP makes them ready,
each parameter's ready time and the ``nn.Linear`` layers ``HybridDataParallel`` may factor,
measured by a few local steps under DDP on a one-rank gloo group whose communication hook
records each bucket and sends nothing (``profile``; ``colocated`` processes at once for
workers that share a machine)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Bucket", "Layer", "Param", "Profile", "profile", "profile_dict"]


@dataclass(frozen=True)
class Bucket:
    numel: int
    ready_s: float
    """Seconds after backward started when DDP handed the bucket to communication."""


@dataclass(frozen=True)
class Param:
    """A trainable parameter, in reverse registration order (the order DDP and
    HybridDataParallel bucket them)."""

    numel: int
    ready_s: float
    """Seconds after backward started when its gradient was accumulated."""
    layer: int | None = None
    """The index in ``Profile.layers`` of the ``nn.Linear`` whose weight it is, if any."""


@dataclass(frozen=True)
class Layer:
    """An ``nn.Linear`` that HybridDataParallel may send by sufficient factors."""

    name: str
    in_features: int
    out_features: int
    rows: int
    """K: rows (samples x positions) it saw per step."""
    grad_s: float
    """Seconds after backward started when the gradient of its output was known (its
    factors' all-gather starts then)."""


@dataclass
class Profile:
    """One training step's compute, and its gradient buckets in the order they are ready."""

    model: str
    batch: int
    params: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    buckets: list[Bucket]
    colocated: int = 1
    div_ns: float = 0.0
    """A bucket's division by the world size, in ns per element (measured in profiling)."""
    add_ns: float = 0.0
    """Adding a bucket's rounding residual (the 16-bit hook), in ns per element."""
    period_s: float | None = None
    """A profiled step from start to start (the batch's preparation included), the
    processes running free."""
    lockstep_s: float | None = None
    """The same when the ``colocated`` processes wait for each other after every step: the
    slowest one's (None: not measured)."""
    params_ready: list[Param] = field(default_factory=list)
    layers: list[Layer] = field(default_factory=list)
    rebuild_out_ns: float = 0.0
    """Rebuilding a weight gradient from factors (a matrix product): ns per element of the
    gradient ..."""
    mac_ns: float = 0.0
    """... and ns per multiply-add."""

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def slowdown(self) -> float:
        """The step in lockstep over the free-running one (at least 1): how much the
        slowest rank's pace stretches a synchronous job's compute."""
        if not self.lockstep_s or not self.period_s:
            return 1.0
        return max(1.0, self.lockstep_s / self.period_s)


def _profile_here(model: str, batch: int | None, steps: int, seed: int,
                  barrier: Any = None) -> dict[str, Any]:
    """Profile in this process (a one-rank gloo group of its own); with a ``barrier``, then
    run steps that wait on it after every step (the lockstep of a synchronous job)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from switchml import workloads
    torch.set_num_threads(1)
    work = workloads.get(model)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1),
                                rank=0, world_size=1)
        try:
            torch.manual_seed(seed)
            task = work.build(batch, seed=seed)
            calls: list[tuple[int, float]] = []

            def record(_state, bucket):  # type: ignore[no-untyped-def]  (DDP checks them)
                calls.append((bucket.buffer().numel(), time.perf_counter()))
                fut: Any = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut

            hybrid = _HybridRecorder(task.model)
            ddp = DDP(task.model)
            ddp.register_comm_hook(None, record)
            opt = work.optimizer(ddp.parameters())
            if barrier is not None:
                barrier.wait()  # every process starts once all are ready: they share cores
            samples, passed, locked = [], [time.perf_counter()], []
            for step in range(steps):
                calls.clear()
                hybrid.clear()
                _, (t0, t1, t2, t3) = task.timed_step(ddp, opt, step)
                samples.append((t1 - t0, t2 - t1, t3 - t2,
                                [(n, t - t1) for n, t in calls], hybrid.sample(t1)))
                passed.append(time.perf_counter())
            if barrier is not None:
                barrier.wait()  # the lockstep starts together
                locked.append(time.perf_counter())
                for step in range(steps, 2 * steps):
                    task.timed_step(ddp, opt, step)
                    barrier.wait()
                    locked.append(time.perf_counter())
            hybrid.remove()
        finally:
            dist.destroy_process_group()
    return _profile_doc(model, batch or work.batch, task.model, hybrid, samples, passed,
                        locked, barrier)


def _profile_doc(model: str, batch: int, net: Any, hybrid: _HybridRecorder,
                 samples: list[tuple], passed: list[float], locked: list[float],
                 barrier: Any) -> dict[str, Any]:
    """:func:`_profile_here`'s report from its steps' samples (the steps after the bucket
    rebuild), the hooks' and the rebuild's work per element timed in every process at once
    (as the ranks of a job do it, after the ``barrier``), and the step periods alone and in
    lockstep."""
    kept = samples[2:] if len(samples) > 3 else samples[-1:]  # after the bucket rebuild
    hybrid_doc = hybrid.summary([s[4] for s in kept])
    if barrier is not None:
        barrier.wait()
    div_ns, add_ns = _local_work_ns(max(n for n, _ in samples[-1][3]) if samples[-1][3] else 0)
    hybrid_doc.update(hybrid.rebuild_costs(hybrid_doc.get("layers", [])))
    periods = [b - a for a, b in zip(passed[-len(kept) - 1:], passed[-len(kept):])]
    in_lockstep = [b - a for a, b in zip(locked[2:], locked[3:])]  # (after a warm-up)
    layout = kept[-1][3]
    ready = [statistics.median(s[3][i][1] for s in kept if len(s[3]) == len(layout))
             for i in range(len(layout))]
    return {"model": model, "batch": batch,
            "params": sum(p.numel() for p in net.parameters()),
            "forward_s": statistics.median(s[0] for s in kept),
            "backward_s": statistics.median(s[1] for s in kept),
            "optimizer_s": statistics.median(s[2] for s in kept),
            "buckets": [{"numel": n, "ready_s": r} for (n, _), r in zip(layout, ready)],
            "div_ns": div_ns, "add_ns": add_ns, **hybrid_doc,
            "period_s": statistics.median(periods),
            "lockstep_s": statistics.median(in_lockstep) if in_lockstep else None}


class _HybridRecorder:
    """What predicting HybridDataParallel needs from a profiled step: each ``nn.Linear``
    candidate's rows and when its output's gradient was known, each parameter's gradient's
    ready time, and the cost of rebuilding a gradient from factors."""

    def __init__(self, model: Any) -> None:
        from switchml.torch.hybrid import candidate_layers
        self.layers = candidate_layers(model)
        weight_of = {id(m.weight): i for i, (_, m) in enumerate(self.layers)}
        self.params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.layer_of = [weight_of.get(id(p)) for p in self.params]
        self.clear()
        self.handles: list[Any] = []
        clock = time.perf_counter
        for i, (_, m) in enumerate(self.layers):
            def on_forward(mod: Any, args: Any, out: Any, i: int = i) -> None:
                if not getattr(out, "requires_grad", False):
                    return
                self.rows[i] = args[0].reshape(-1, mod.in_features).shape[0]
                out.register_hook(lambda g, i=i: self.grad_at.__setitem__(i, clock()))
            self.handles.append(m.register_forward_hook(on_forward))
        for j, p in enumerate(self.params):
            self.handles.append(p.register_post_accumulate_grad_hook(
                lambda _p, j=j: self.ready_at.__setitem__(j, clock())))

    def clear(self) -> None:
        """Forget the last step (a hook that does not fire leaves NaN, not a stale time)."""
        nan = float("nan")
        self.rows = [0] * len(self.layers)
        self.grad_at = [nan] * len(self.layers)
        self.ready_at = [nan] * len(self.params)

    def sample(self, backward_start: float) -> tuple[list[int], list[float], list[float]]:
        return (list(self.rows), [t - backward_start for t in self.grad_at],
                [t - backward_start for t in self.ready_at])

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def summary(self, samples: list[tuple[list[int], list[float], list[float]]]
                ) -> dict[str, Any]:
        """Medians over ``samples``: the layers and the parameters."""
        if not samples:
            return {}
        def med(xs: Any) -> float:  # over the steps whose hook fired
            xs = [x for x in xs if x == x]
            return statistics.median(xs) if xs else 0.0

        layers = [{"name": name, "in_features": m.in_features, "out_features": m.out_features,
                   "rows": max(s[0][i] for s in samples),
                   "grad_s": med(s[1][i] for s in samples)}
                  for i, (name, m) in enumerate(self.layers)]
        params = [{"numel": p.numel(), "ready_s": med(s[2][j] for s in samples),
                   "layer": self.layer_of[j]} for j, p in enumerate(self.params)]
        return {"layers": layers, "params_ready": params}

    @staticmethod
    def rebuild_costs(layers: list[dict[str, Any]], repeats: int = 3) -> dict[str, float]:
        """Time ``G^T X`` (as HybridDataParallel rebuilds a gradient) for the largest layer
        at two depths, K and 8 K rows: ns per output element and per multiply-add."""
        import torch
        fed = [d for d in layers if d["rows"] > 0]
        if not fed:
            return {"rebuild_out_ns": 0.0, "mac_ns": 0.0}
        d = max(fed, key=lambda d: d["in_features"] * d["out_features"])
        size = d["in_features"] * d["out_features"]
        took = {}
        for depth in (d["rows"], 8 * d["rows"]):
            g = torch.randn(depth, d["out_features"])
            x = torch.randn(depth, d["in_features"])
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                g.t().mm(x)
                times.append(time.perf_counter() - t0)
            took[depth] = statistics.median(times)
        (d1, t1), (d2, t2) = sorted(took.items())
        mac = max(0.0, (t2 - t1) / ((d2 - d1) * size))
        return {"rebuild_out_ns": 1e9 * max(0.0, t1 / size - mac * d1), "mac_ns": 1e9 * mac}


def _local_work_ns(numel: int, repeats: int = 5) -> tuple[float, float]:
    """ns per element of what hooks do to a bucket of ``numel`` float32 on backward's
    thread: ``div_`` by the world size, and ``add_`` of a residual (medians)."""
    import torch
    if numel <= 0:
        return 0.0, 0.0
    buf, res = torch.ones(numel), torch.full((numel,), 1e-3)
    div, add = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.div_(4)
        t1 = time.perf_counter()
        buf.add_(res)
        t2 = time.perf_counter()
        div.append(t1 - t0)
        add.append(t2 - t1)
    return 1e9 * statistics.median(div) / numel, 1e9 * statistics.median(add) / numel


def _profile_child(index: int, args: tuple[str, int | None, int, int], barrier: Any,
                   out: Any) -> None:
    try:
        out.put({**_profile_here(*args, barrier=barrier), "index": index})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        if barrier is not None:
            barrier.abort()  # the others may be waiting for this one
        out.put({"error": f"{type(exc).__name__}: {exc}"})


def _collect_profiles(model: str, procs: list[Any], out: Any, barrier: Any,
                      timeout_s: float) -> list[dict[str, Any]]:
    """Every profiling process's report, in the order they came; a child that failed, died
    without a word or outlasted ``timeout_s`` fails the profile (releasing the others from
    the barrier). The children are joined (killed if they linger) either way."""
    docs: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s

    def fail(why: str) -> RuntimeError:
        if barrier is not None:
            barrier.abort()  # release the others
        return RuntimeError(f"profiling {model} failed: {why}")

    quiet = 0  # polls in a row with nothing to read
    try:
        while len(docs) < len(procs):
            try:
                doc = out.get(timeout=0.5)
            except queue.Empty:
                quiet += 1
                # a child that died without a word (killed, or failed to start); one that
                # reported and then exited may still have its report in the pipe: wait a
                # poll more before calling it dead
                reported = {d["index"] for d in docs}
                dead = [p.exitcode for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in reported]
                if dead and quiet > 1:
                    raise fail(f"a profiling process exited with code {dead[0]}") from None
                if time.monotonic() > deadline:
                    raise fail(f"it took over {timeout_s:g} s") from None
                continue
            quiet = 0
            if "error" in doc:
                raise fail(doc["error"])
            docs.append(doc)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return docs


def profile(model: str, batch: int | None = None, *, steps: int = 8, colocated: int = 1,
            seed: int = 0, timeout_s: float = 600.0) -> Profile:
    """Profile ``steps`` steps of workload ``model`` (``switchml.workloads``); with
    ``colocated`` > 1, that many processes profile at once and the medians across them are
    kept (compute as it runs when that many workers share this machine), and they wait for
    each other in as many steps again (``Profile.lockstep_s``)."""
    from switchml import workloads
    workloads.get(model)  # a wrong name fails here, not in a child
    if steps < 2 or colocated < 1:
        raise ValueError(f"steps must be >= 2 and colocated >= 1, got {steps}, {colocated}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    barrier = ctx.Barrier(colocated, timeout=timeout_s) if colocated > 1 else None
    procs = [ctx.Process(target=_profile_child,
                         args=(i, (model, batch, steps, seed + i), barrier, out), daemon=True)
             for i in range(colocated)]
    for p in procs:
        p.start()
    docs = _collect_profiles(model, procs, out, barrier, timeout_s)
    first = docs[0]
    buckets = [Bucket(b["numel"], statistics.median(d["buckets"][i]["ready_s"] for d in docs))
               for i, b in enumerate(first["buckets"])]
    return Profile(model=model, batch=first["batch"], params=first["params"],
                   forward_s=statistics.median(d["forward_s"] for d in docs),
                   backward_s=statistics.median(d["backward_s"] for d in docs),
                   optimizer_s=statistics.median(d["optimizer_s"] for d in docs),
                   buckets=buckets, colocated=colocated,
                   div_ns=statistics.median(d["div_ns"] for d in docs),
                   add_ns=statistics.median(d["add_ns"] for d in docs),
                   params_ready=[Param(p["numel"], statistics.median(
                       d["params_ready"][j]["ready_s"] for d in docs), p["layer"])
                       for j, p in enumerate(first.get("params_ready", []))],
                   layers=[Layer(x["name"], x["in_features"], x["out_features"], x["rows"],
                                 statistics.median(d["layers"][i]["grad_s"] for d in docs))
                           for i, x in enumerate(first.get("layers", []))],
                   rebuild_out_ns=statistics.median(d.get("rebuild_out_ns", 0.0) for d in docs),
                   mac_ns=statistics.median(d.get("mac_ns", 0.0) for d in docs),
                   period_s=statistics.median(d["period_s"] for d in docs),
                   lockstep_s=statistics.median(d["lockstep_s"] for d in docs)
                   if all(d.get("lockstep_s") for d in docs) else None)


def profile_dict(prof: Profile) -> dict[str, Any]:
    return asdict(prof)
