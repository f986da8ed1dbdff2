"""``switchml predict``: will in-network aggregation speed up this training job?

Method:

1. **Profile** a few local steps of the model under DDP on a one-rank gloo group, with a
   communication hook that records, for every gradient bucket, its size and when backward
   made it ready, and sends nothing. From the steps after DDP rebuilt its buckets: forward
   ``F``, backward ``B``, optimizer ``O``, and the buckets in the order they become ready.
   ``colocated`` runs that many profiling processes at once, for jobs whose workers share a
   machine (the testbed's, on this 2-core machine: compute slows as workers share cores).
   After the profiled steps they run as many again waiting for each other after every step
   (a barrier), as the ranks of a synchronous job wait at every all-reduce: the step of that
   lockstep is the slowest rank's, which on shared cores is above the free-running one
   (``Profile.lockstep_s`` over ``Profile.period_s``: ``Profile.slowdown``).
2. **Time each bucket's all-reduce** on each system: switchml (32-bit and the 16-bit hook) with
   the simulator's timing mode (``sim.timing``: the protocol's self-clocked window over the
   links at the given rate and MTU, each worker's CPU over its I/O threads and the switch's
   over its shards charged per datagram and per element); gloo as a ring, ``2 (n - 1) / n``
   of the bucket's bytes each way, in TCP segments of the MTU, or its CPU per element if
   that is slower, plus a per-hop latency. The CPU costs are this machine's, measured by
   ``switchml calibrate`` (``costs.py``; the reference machine's where it was never run).
   Each prediction names the resource that binds its all-reduces: the wire, a worker's CPU
   or the switch's.
3. **Compose** as DDP does: buckets all-reduce one after another, each once it is ready, while
   backward goes on. The step is ``F + max(B, end of the last all-reduce) + O``; the exposed
   communication is what ends after backward. Forward, backward, the buckets' ready times
   and the optimizer are those of the slowest rank: the profile's, stretched by its
   ``slowdown``. What a hook does to a bucket before it sends
   it runs on backward's thread and delays every later bucket and backward's end: dividing
   by the world size (every system: DDP's reducer, switchml's hook), and adding the rounding
   residual (the 16-bit hook). Their cost per element is measured while profiling, as the
   compute is (``colocated``).
4. **Hybrid** (``HybridDataParallel``, Poseidon's per-layer choice on a switchml group): the
   profile also notes each ``nn.Linear``'s rows K and when its output's gradient is known,
   and when each parameter's gradient is ready. Each layer's path is ``hybrid.choose``'s;
   the factors' all-gathers (gloo's ring) and the remaining parameters' buckets (the switch)
   share each worker's link in the order they start; after backward each factor layer's
   gradient is rebuilt, at a cost per gradient element and per multiply-add timed at two
   depths in every profiling process at once.

The prediction assumes the links are the bottleneck's only shared resource besides the
profiled compute, no loss, and a switch that keeps up (a real one, or the software switch on
its own cores). ``validate`` sets predictions against the rows of ``switchml bench train``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from switchml.costs import Costs
from switchml.costs import load as load_costs
from switchml.protocol.wire import HEADER_SIZE, elements_for_mtu

__all__ = ["Bucket", "Prediction", "Profile", "Resources", "SYSTEMS", "predict", "profile",
           "validate"]

SYSTEMS = ("gloo", "switchml", "switchml16", "hybrid")
TCP_IPV4 = 52  # 20 IP + 20 TCP + 12 timestamp option
ETHERNET = 14 + 24  # header and FCS, preamble, inter-frame gap: what a frame costs the wire
GLOO_HOP_S = 100e-6
"""Per ring step: one TCP round of a chunk through two hosts' stacks (measured order on this
machine's testbed: tens to a hundred microseconds)."""


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


@dataclass
class Prediction:
    system: str
    step_s: float
    comm_s: float
    """The all-reduces' time, end to end, as if nothing else ran."""
    exposed_s: float
    """Communication that ends after backward: the step's cost of communicating."""
    speedup: float | None = None
    """gloo's predicted step / this one."""
    buckets_s: list[float] = field(default_factory=list)
    resources_s: dict[str, float] = field(default_factory=dict)
    """Each resource's busy time over the step's all-reduces, as if it alone limited them
    (``wire``, ``worker CPU``, ``switch CPU``; gloo: ``wire``, ``worker CPU``)."""

    @property
    def bound_by(self) -> str | None:
        """The resource that binds the all-reduces: the one busiest over them."""
        return max(self.resources_s, key=self.resources_s.__getitem__) if self.resources_s \
            else None

    @property
    def comm_share(self) -> float:
        return self.exposed_s / self.step_s if self.step_s else 0.0

    @property
    def hidden(self) -> float | None:
        return 1 - self.exposed_s / self.comm_s if self.comm_s else None


# -- 1. profile ---------------------------------------------------------------------------------

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
    # The hooks' and the rebuild's work per element, timed in every process at once (as the
    # ranks of a job do it).
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
    return {"model": model, "batch": batch or work.batch,
            "params": sum(p.numel() for p in task.model.parameters()),
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


# -- 2. each bucket's all-reduce ----------------------------------------------------------------

@dataclass(frozen=True)
class Resources:
    """What the switchml side runs on: the CPU costs (``costs.Costs``), each worker's I/O
    threads and the switch's shards."""

    costs: Costs = field(default_factory=lambda: load_costs())
    threads: int = 1
    shards: int = 1
    cores: int | None = None
    """The cores every process of the job shares (the testbed's: workers, switch shards and
    gloo ranks on one machine); None: each has cores of its own. Busy processes share them
    evenly: each gets ``min(1, cores / processes)`` of a core."""

    def for_switchml(self, workers: int) -> Costs:
        """The costs a switchml process pays, its workers' threads and the shards sharing the
        cores."""
        if self.cores is None:
            return self.costs
        return self.costs.slowed(max(1.0, (workers * self.threads + self.shards) / self.cores))

    def for_gloo(self, workers: int) -> Costs:
        """The costs a gloo rank pays, the ranks sharing the cores."""
        if self.cores is None:
            return self.costs
        return self.costs.slowed(max(1.0, workers / self.cores))


def switchml_allreduce_s(numel: int, *, workers: int, rate_bps: float, mtu: int,
                         bits: int = 32, res: Resources | None = None,
                         _cache: dict[tuple, float] = {}) -> float:  # noqa: B006
    """One all-reduce of ``numel`` elements through the switch, by the timing simulator
    (16 bits: as many elements in half the bytes), each worker and the switch charged their
    CPU (``res``)."""
    from switchml.sim.config import SimConfig, SimLink
    from switchml.sim.timing import run_timing
    res = res or Resources()
    c = res.for_switchml(workers)
    size = -(-numel * bits // 32) * 4  # (the simulator takes whole float32s)
    key = (size, workers, rate_bps, mtu, res)
    if key not in _cache:
        report = run_timing(SimConfig(
            workers=workers, size_bytes=max(size, 4), access=SimLink(rate_bps=rate_bps),
            mtu=mtu, host_cost_s=c.worker_datagram_s, host_element_cost_s=c.worker_element_s,
            threads=res.threads, switch_request_cost_s=c.switch_request_s,
            switch_element_cost_s=c.switch_element_s, shards=res.shards))
        if not report.ok:
            raise RuntimeError(f"the timing simulator failed: {report.error}")
        _cache[key] = report.elapsed_s
    return _cache[key]


def switchml_resources_s(numel: int, *, workers: int, rate_bps: float, mtu: int,
                         bits: int = 32, res: Resources | None = None) -> dict[str, float]:
    """Each resource's busy time for one all-reduce through the switch, alone: the wire (a
    worker's link, one way), a worker's CPU (over its threads), the switch's (over its
    shards)."""
    res = res or Resources()
    c = res.for_switchml(workers)
    k = elements_for_mtu(mtu) * (32 // bits)
    datagrams = -(-numel // k)
    return {"wire": switchml_wire_bytes(numel, mtu=mtu, bits=bits) * 8 / rate_bps,
            "worker CPU": c.worker_s(datagrams, numel, res.threads),
            "switch CPU": c.switch_s(workers * datagrams, workers * numel, res.shards)}


def gloo_resources_s(numel: int, *, workers: int, rate_bps: float, mtu: int,
                     costs: Costs | None = None) -> dict[str, float]:
    """A ring all-reduce's busy times: the wire (``2 (n - 1) / n`` of the bytes each way in
    TCP segments) and a rank's CPU (``costs.gloo_s``)."""
    if workers < 2:
        return {"wire": 0.0, "worker CPU": 0.0}
    mss = mtu - TCP_IPV4
    wire = numel * 4 * 2 * (workers - 1) / workers * (mss + TCP_IPV4 + ETHERNET) / mss
    return {"wire": wire * 8 / rate_bps,
            "worker CPU": (costs or load_costs()).gloo_s(numel, workers)}


def gloo_allreduce_s(numel: int, *, workers: int, rate_bps: float, mtu: int,
                     costs: Costs | None = None) -> float:
    """One ring all-reduce of ``numel`` float32: the wire or a rank's CPU, whichever is
    slower (TCP and the reduction pipeline with the transfer), plus a latency per ring step."""
    if workers < 2:
        return 0.0
    busy = gloo_resources_s(numel, workers=workers, rate_bps=rate_bps, mtu=mtu, costs=costs)
    return max(busy.values()) + 2 * (workers - 1) * GLOO_HOP_S


def switchml_wire_bytes(numel: int, *, mtu: int, bits: int = 32) -> float:
    """Bytes each way per worker for ``numel`` elements through the switch (frames
    included)."""
    k = elements_for_mtu(mtu) * (32 // bits)
    packets = -(-numel // k)
    return numel * bits / 8 + packets * (HEADER_SIZE + 28 + ETHERNET)


# -- 3. compose ---------------------------------------------------------------------------------

def local_ns(prof: Profile, system: str) -> float:
    """What ``system``'s hook does to a bucket on backward's thread, ns per element."""
    return prof.div_ns + (prof.add_ns if system == "switchml16" else 0.0)


def compose(prof: Profile, times: list[float], system: str) -> Prediction:
    """DDP's overlap: bucket ``i`` starts when it is ready and the one before it is done;
    compute and ready times are the slowest rank's (``prof.slowdown`` times the profile's).
    The hook's work on each bucket (``local_ns``) runs on backward's thread when the bucket
    is ready: it delays the later buckets and backward's end."""
    per = local_ns(prof, system) * 1e-9
    slow = prof.slowdown  # the slowest rank's compute sets every rank's pace
    end = delay = 0.0
    for b, t in zip(prof.buckets, times):
        delay += per * b.numel
        end = max(end, slow * b.ready_s + delay) + t
    backward = slow * prof.backward_s + delay
    exposed = max(0.0, end - backward) if times else 0.0
    return Prediction(system, slow * (prof.forward_s + prof.optimizer_s) + backward + exposed,
                      comm_s=sum(times), exposed_s=exposed, buckets_s=times)


def gloo_allgather_s(block_bytes: int, *, workers: int, rate_bps: float, mtu: int) -> float:
    """One ring all-gather of ``block_bytes`` per rank: each link carries the ``n - 1``
    other blocks each way in TCP segments, plus a latency per ring step."""
    if workers < 2:
        return 0.0
    mss = mtu - TCP_IPV4
    wire = block_bytes * (workers - 1) * (mss + TCP_IPV4 + ETHERNET) / mss
    return wire * 8 / rate_bps + (workers - 1) * GLOO_HOP_S


def hybrid_plan(prof: Profile, *, workers: int) -> tuple[list[Any], list[tuple[int, float]]]:
    """HybridDataParallel's plan for ``prof`` on a switchml group of ``workers``: each
    layer's decision (``switchml.torch.hybrid.choose``), and the aggregated buckets as
    ``(numel, launch_s)``: parameters in reverse registration order without the weights sent
    by sufficient factors, cut at 25 MiB, each launched once it and every bucket before it
    are ready."""
    from switchml.torch.hybrid import (
        DEFAULT_BUCKET_CAP_MB,
        SFB,
        Transport,
        choose,
        cut_buckets,
    )
    decisions = [choose(x.name, in_features=x.in_features, out_features=x.out_features,
                        rows=x.rows, world=workers, transport=Transport("switch", 4))
                 for x in prof.layers]
    kept = [p for p in prof.params_ready
            if p.layer is None or decisions[p.layer].path != SFB]
    groups = cut_buckets([(p.numel * 4, None) for p in kept],
                         int(DEFAULT_BUCKET_CAP_MB * 2**20))
    buckets, ready = [], 0.0
    for group in groups:  # launched in order: no earlier than the one before
        ready = max([ready] + [kept[i].ready_s for i in group])
        buckets.append((sum(kept[i].numel for i in group), ready))
    return decisions, buckets


def compose_hybrid(prof: Profile, *, workers: int, rate_bps: float, mtu: int,
                   res: Resources | None = None) -> Prediction:
    """HybridDataParallel's step: each sufficient-factor layer's all-gather (gloo, a ring)
    starts when its output's gradient is known, each bucket's all-reduce (the switch) when it
    is launched; both share each worker's link, served in the order they start (gloo's and
    the switch's threads run at once; on a bottleneck link they share its rate). At the end
    of backward every factor layer's gradient is rebuilt once its gather is in (``out x in``
    elements of ``n K`` multiply-adds each, at the profile's rates, then divided and copied
    into ``.grad``: two passes), then the buckets are divided and copied back.

    Passes over gradients, against the profile (DDP, which copies every gradient into its
    bucket during backward and back out at its end, both inside the profiled backward):
    hybrid's concatenation of a bucket stands for DDP's copy in, its copy back for DDP's copy
    out, and its division is one pass more; the weights sent by factors skip both of DDP's
    copies."""
    from switchml.torch.hybrid import SFB
    slow = prof.slowdown
    decisions, buckets = hybrid_plan(prof, workers=workers)
    per = prof.div_ns * 1e-9  # one pass over a gradient, per element
    # (start, duration, the work after it: a rebuild, or a bucket's division); gathers first,
    # in the order their gradients arrive, then buckets: the order of the waits at the end
    # of backward
    gathers, sent = [], []
    skipped = 0
    for x, d in zip(prof.layers, decisions):
        if d.path == SFB:
            block = x.rows * (x.in_features + x.out_features) * 4
            size = x.in_features * x.out_features
            skipped += size
            rebuild = 1e-9 * size * (prof.rebuild_out_ns + prof.mac_ns * workers * x.rows)
            gathers.append((slow * x.grad_s,
                            gloo_allgather_s(block, workers=workers, rate_bps=rate_bps,
                                             mtu=mtu), slow * rebuild + 2 * per * size))
    gathers.sort(key=lambda g: g[0])
    for numel, ready in buckets:
        t = switchml_allreduce_s(numel, workers=workers, rate_bps=rate_bps, mtu=mtu,
                                 res=res) if workers > 1 else 0.0
        sent.append((slow * ready, t, per * numel))
    transfers = gathers + sent
    ends = [0.0] * len(transfers)
    link = 0.0  # the worker's link, shared, served in the order transfers start
    for i in sorted(range(len(transfers)), key=lambda i: transfers[i][0]):
        link = max(link, transfers[i][0]) + transfers[i][1]
        ends[i] = link
    backward = max(0.0, slow * prof.backward_s - 2 * per * skipped)
    t = backward
    for end, (_, _, after) in zip(ends, transfers):  # each awaited in turn
        t = max(t, end) + after
    exposed = max(0.0, max(ends, default=0.0) - backward)
    return Prediction("hybrid", slow * (prof.forward_s + prof.optimizer_s) + t,
                      comm_s=sum(took for _, took, _ in transfers), exposed_s=exposed,
                      buckets_s=[took for _, took, _ in transfers])


def _summed(parts: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + v
    return total


def predict(prof: Profile, *, workers: int, rate_bps: float, mtu: int = 1500,
            systems: tuple[str, ...] = SYSTEMS, res: Resources | None = None
            ) -> list[Prediction]:
    """The predicted step of ``prof`` on each system, with speedups against gloo; switchml
    on ``res`` (default: this machine's calibration, one thread, one shard)."""
    if workers < 1 or rate_bps <= 0:
        raise ValueError(f"workers must be >= 1 and rate_bps > 0, got {workers}, {rate_bps}")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown system(s) {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    res = res or Resources()
    link = dict(workers=workers, rate_bps=rate_bps, mtu=mtu)
    out = []

    def gloo_prediction() -> Prediction:
        costs = res.for_gloo(workers)
        p = compose(prof, [gloo_allreduce_s(b.numel, costs=costs, **link)
                           for b in prof.buckets], "gloo")
        p.resources_s = _summed([gloo_resources_s(b.numel, costs=costs, **link)
                                 for b in prof.buckets])
        return p

    for system in systems:
        if system == "hybrid":
            out.append(compose_hybrid(prof, res=res, **link))
            continue
        if system == "gloo":
            out.append(gloo_prediction())
            continue
        bits = 16 if system == "switchml16" else 32
        times = [switchml_allreduce_s(b.numel, bits=bits, res=res, **link)
                 if workers > 1 else 0.0 for b in prof.buckets]
        p = compose(prof, times, system)
        if workers > 1:
            p.resources_s = _summed([switchml_resources_s(b.numel, bits=bits, res=res, **link)
                                     for b in prof.buckets])
        out.append(p)
    gloo = next((p for p in out if p.system == "gloo"), None)
    if gloo is None:
        gloo = gloo_prediction()
    for p in out:
        p.speedup = gloo.step_s / p.step_s
    return out


def validate(rows: list[dict[str, Any]], *, colocated: bool = True,
             progress: Any = None, costs: Costs | None = None) -> list[dict[str, Any]]:
    """Predict every row of a ``switchml bench train`` run (its workload, batch, workers,
    rate, MTU) and set the prediction against the measured step: one dict per row, with the
    relative error. ``colocated``: profile with as many processes as the run had workers,
    and charge their CPU on this machine's cores, which they and the switch shared."""
    costs = costs or load_costs()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    profiles: dict[tuple, Profile] = {}
    out = []
    for r in rows:
        if r["system"] not in SYSTEMS:
            continue
        key = (r["model"], r["batch"], r["workers"] if colocated else 1)
        if key not in profiles:
            if progress is not None:
                progress(f"profiling {r['model']} (batch {r['batch']}, {key[2]} at once)")
            profiles[key] = profile(r["model"], r["batch"], colocated=key[2])
        prof = profiles[key]
        pred = predict(prof, workers=r["workers"], rate_bps=r["rate_bps"],
                       mtu=r.get("mtu", 1500), systems=(r["system"],),
                       res=Resources(costs, cores=cores if colocated else None))[0]
        out.append({"model": r["model"], "system": r["system"], "workers": r["workers"],
                    "rate_bps": r["rate_bps"], "measured_step_s": r["step_s"],
                    "predicted_step_s": pred.step_s, "error": pred.step_s / r["step_s"] - 1,
                    "predicted_exposed_s": pred.exposed_s, "compute_s": prof.compute_s,
                    "period_s": prof.period_s, "lockstep_s": prof.lockstep_s,
                    "measured_compute_s": r.get("compute_step_s")})
    return out


def profile_dict(prof: Profile) -> dict[str, Any]:
    return asdict(prof)
