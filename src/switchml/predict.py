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
   compute is (``colocated``). When the job's processes outnumber the cores they share (the
   testbed's four ranks on two cores: ``Resources.cores``), backward keeps every core busy
   and no all-reduce overlaps it: they run one after another from backward's end (measured:
   the overlapped composition predicted the CNN's switchml step 35% short, the serial one
   17-21%; docs/benchmarks.md).
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

import os
from dataclasses import dataclass, field
from typing import Any

from switchml.costs import Costs
from switchml.costs import load as load_costs
from switchml.protocol.wire import HEADER_SIZE, elements_for_mtu
from switchml.stepprofile import (  # noqa: F401  (step 1, named here for predict's users)
    Bucket,
    Layer,
    Param,
    Profile,
    _profile_here,
    profile,
    profile_dict,
)

__all__ = ["Bucket", "Prediction", "Profile", "Resources", "SYSTEMS", "predict", "profile",
           "validate"]

SYSTEMS = ("gloo", "switchml", "switchml16", "hybrid")
TCP_IPV4 = 52  # 20 IP + 20 TCP + 12 timestamp option
ETHERNET = 14 + 24  # header and FCS, preamble, inter-frame gap: what a frame costs the wire
GLOO_HOP_S = 100e-6
"""Per ring step: one TCP round of a chunk through two hosts' stacks (measured order on this
machine's testbed: tens to a hundred microseconds)."""


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
    return _cache[key] + c.worker_op_s  # (a testbed run's: ``Costs.on_emulated_links``)


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
            "worker CPU": c.worker_s(datagrams, numel, res.threads) + c.worker_op_s,
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


def compose(prof: Profile, times: list[float], system: str, *, overlap: bool = True
            ) -> Prediction:
    """DDP's overlap: bucket ``i`` starts when it is ready and the one before it is done;
    compute and ready times are the slowest rank's (``prof.slowdown`` times the profile's).
    The hook's work on each bucket (``local_ns``) runs on backward's thread when the bucket
    is ready: it delays the later buckets and backward's end. Without ``overlap`` (the job's
    processes outnumber the cores they share: backward keeps every core busy, and a bucket's
    all-reduce, which needs a core for its I/O thread, the switch and the kernel's network
    stack, makes no progress beside it), the all-reduces run one after another from the end
    of backward."""
    per = local_ns(prof, system) * 1e-9
    slow = prof.slowdown  # the slowest rank's compute sets every rank's pace
    backward = slow * prof.backward_s + per * sum(b.numel for b in prof.buckets)
    end = delay = 0.0
    for b, t in zip(prof.buckets, times):
        delay += per * b.numel
        end = max(end, slow * b.ready_s + delay if overlap else backward) + t
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
    # The job's processes (its ranks, their I/O threads, the switch's shards) share
    # ``res.cores`` and outnumber them (the testbed): no all-reduce overlaps backward
    # (``compose``). Measured: docs/benchmarks.md, "Composed without overlap on shared cores".
    overlap = res.cores is None or workers * res.threads + res.shards <= res.cores

    def gloo_prediction() -> Prediction:
        costs = res.for_gloo(workers)
        p = compose(prof, [gloo_allreduce_s(b.numel, costs=costs, **link)
                           for b in prof.buckets], "gloo", overlap=overlap)
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
        p = compose(prof, times, system, overlap=overlap)
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


PROFILE_S = 2.0
"""How long ``validate`` profiles a model, about: as many steps as the measured row's step
time fits (``PROFILE_STEPS_MAX`` at most, 8 at least)."""
PROFILE_STEPS_MAX = 100


def validate(rows: list[dict[str, Any]], *, colocated: bool = True,
             progress: Any = None, costs: Costs | None = None) -> list[dict[str, Any]]:
    """Predict every row of a ``switchml bench train`` run (its workload, batch, workers,
    rate, MTU) and set the prediction against the measured step: one dict per row, with the
    relative error. ``colocated``: profile with as many processes as the run had workers,
    and charge their CPU on this machine's cores, which they and the switch shared. The
    runs are the testbed's: its emulated links' kernel work is charged too, where ``switchml
    calibrate --links`` measured it (``Costs.on_emulated_links``)."""
    costs = costs or load_costs()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    profiles: dict[tuple, Profile] = {}
    out = []
    for r in rows:
        if r["system"] not in SYSTEMS:
            continue
        key = (r["model"], r["batch"], r["workers"] if colocated else 1)
        if key not in profiles:
            # About two seconds of steps (at least 8): a model of 25 ms steps profiled in 8,
            # four processes on two cores, measured its lockstep anywhere from 14 to 28 ms.
            steps = min(PROFILE_STEPS_MAX, max(8, round(PROFILE_S / max(r["step_s"], 1e-3))))
            if progress is not None:
                progress(f"profiling {r['model']} (batch {r['batch']}, {key[2]} at once, "
                         f"{steps} steps)")
            profiles[key] = profile(r["model"], r["batch"], colocated=key[2], steps=steps)
        prof = profiles[key]
        mtu = r.get("mtu", 1500)
        pred = predict(prof, workers=r["workers"], rate_bps=r["rate_bps"], mtu=mtu,
                       systems=(r["system"],),
                       res=Resources(costs.on_emulated_links(mtu),
                                     cores=cores if colocated else None))[0]
        out.append({"model": r["model"], "system": r["system"], "workers": r["workers"],
                    "rate_bps": r["rate_bps"], "measured_step_s": r["step_s"],
                    "predicted_step_s": pred.step_s, "error": pred.step_s / r["step_s"] - 1,
                    "predicted_exposed_s": pred.exposed_s, "compute_s": prof.compute_s,
                    "period_s": prof.period_s, "lockstep_s": prof.lockstep_s,
                    "measured_compute_s": r.get("compute_step_s"),
                    "link_byte_s": costs.link_byte_s, "link_op_s": costs.link_op_s})
    return out
