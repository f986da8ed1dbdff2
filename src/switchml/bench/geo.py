"""``switchml bench geo``: Gaia's comparison on the geo testbed (Hsieh et al., NSDI'17, fig. 7).

The same model (by default ``switchml.workloads``' matrix factorisation, Gaia's kind of
workload; or the digits CNN or MLP) is trained four ways, each worker in its own namespace:

- ``lan``: all workers in one data centre (one star of LAN links): synchronous DDP over gloo,
  the speed Gaia wants to approach;
- ``wan``: the workers split over data centres joined by the WAN, synchronous DDP over gloo
  spanning it (what a user would run without Gaia);
- ``gaia``: the same split; synchronous DDP over gloo inside each data centre, Gaia's
  significance filter, selective barrier and mirror clock across (switchml.gaia);
- ``diloco``: the same split; synchronous DDP inside each data centre, and every
  ``inner_steps`` steps DiLoCo's outer Nesterov step on the pseudo-gradients, all-reduced by
  the data centres' leaders through the switch in data centre 0's router, 16-bit on the wire
  (``switchml.gaia.diloco``).

Rank 0 (in data centre 0) evaluates test accuracy every ``eval_every`` steps (evaluation time is
not counted). Reported per mode: time to the target accuracy (first evaluation at or above it),
final accuracy (mean of the last ``FINAL_EVALS`` evaluations; the last one alone is
``last_accuracy``), WAN bytes (the data-centre routers' WAN interface transmit counters, before
and after), accuracy against time.
Run as root. Worker processes run ``python -m switchml.bench.geo worker JSON``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["GeoBenchConfig", "MODES", "geo_worker", "run_geo_bench", "write_outputs"]

MODES = ("lan", "wan", "gaia", "diloco")
LOCAL_MODES = ("gaia", "diloco")
"""Modes whose process groups are a data centre's, not every worker's."""
GAIA_PORT = 47100


MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    # Gaia's kind of workload (matrix factorisation, plain SGD): a step changes only its
    # batch's rows, and the run is long enough (800 clocks) for S / sqrt(t) to matter.
    "mf": {"steps": 800, "batch": 64, "lr": 50.0, "momentum": 0.0, "eval_every": 20,
           "target_accuracy": 0.88},
    # A small CNN trained fast: dense updates, each entry moves by more than 1% / sqrt(t)
    # per step (docs/geo.md: the library's default threshold sends half the entries).
    "cnn": {"steps": 150, "batch": 32, "lr": 0.05, "momentum": 0.9, "eval_every": 5,
            "target_accuracy": 0.95},
    "mlp": {"steps": 150, "batch": 32, "lr": 0.05, "momentum": 0.9, "eval_every": 5,
            "target_accuracy": 0.95},
}
"""Each model's training settings where the command line leaves them out."""


@dataclass(frozen=True)
class GeoBenchConfig:
    __test__ = False

    dcs: tuple[int, ...] = (2, 2)
    wan_bps: float = 50e6
    lan_bps: float = 1e9
    wan_rtt_s: float = 0.0
    """Round trip added between data centres (the geo testbed's delay line)."""
    modes: tuple[str, ...] = MODES
    model: str = "mf"
    steps: int = None  # type: ignore[assignment]
    """This and the next five: ``MODEL_DEFAULTS[model]``'s where None."""
    batch: int = None  # type: ignore[assignment]
    """Per worker."""
    lr: float = None  # type: ignore[assignment]
    momentum: float = None  # type: ignore[assignment]
    eval_every: int = None  # type: ignore[assignment]
    target_accuracy: float = None  # type: ignore[assignment]
    seed: int = 0
    seeds: int = 1
    """Runs per mode, with seeds ``seed .. seed + seeds - 1``; a mode's row is their mean."""
    threshold: float = 0.01
    """Gaia's significance threshold S (S_t = S / sqrt(t))."""
    thresholds: tuple[float, ...] = ()
    """Where given, Gaia runs once at each of these thresholds instead of ``threshold``
    (the trade-off of WAN bytes against accuracy: ``tradeoff.png``)."""
    decay: bool = True
    staleness: int = 2
    """Gaia's mirror-clock bound, in clocks."""
    gaia_lr_scale: float | None = None
    """Gaia's learning rate is ``lr * gaia_lr_scale``; default 1 / data centres: every data
    centre's update reaches every replica, so the global step is the sum of the data centres'
    steps, and this keeps it the size of synchronous training's (one step on the mean
    gradient)."""
    dc_backend: str = "gloo"
    """Gaia's synchronous training inside a data centre: DDP over ``gloo``, or over
    ``switchml`` (a software switch in each data centre's router)."""
    inner_steps: int = 50
    """DiLoCo: local steps between outer steps."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_bits: int = 16
    """DiLoCo's outer all-reduce on the wire: 16 (fixed point, error feedback) or 32."""
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if self.model not in MODEL_DEFAULTS:
            raise ValueError(f"unknown model {self.model!r}; known: {', '.join(MODEL_DEFAULTS)}")
        for key, value in MODEL_DEFAULTS[self.model].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.dc_backend not in ("gloo", "switchml"):
            raise ValueError(f"unknown data-centre backend {self.dc_backend!r}; known: gloo, "
                             "switchml")
        unknown = set(self.modes) - set(MODES)
        if unknown:
            raise ValueError(f"unknown mode(s) {sorted(unknown)}; known: {', '.join(MODES)}")
        if len(self.dcs) < 2:
            raise ValueError(f"--dcs needs at least two data centres, got {self.dcs}")
        if self.steps < 2 or self.eval_every < 1 or self.batch < 1 or self.seeds < 1:
            raise ValueError("--steps must be >= 2, --eval-every, --batch and --seeds >= 1")
        if not 0 < self.target_accuracy <= 1:
            raise ValueError("--target must be an accuracy in (0, 1]")
        if self.inner_steps < 1 or self.outer_bits not in (16, 32):
            raise ValueError("--inner-steps must be >= 1 and --outer-bits 16 or 32")
        if any(not 0 <= t <= 1 for t in (self.threshold, *self.thresholds)):
            raise ValueError("Gaia's thresholds are fractions in [0, 1]")
        if self.thresholds and "gaia" not in self.modes:
            raise ValueError("--thresholds are Gaia's: add gaia to --modes")
        if not 0 <= self.wan_rtt_s <= 10:
            raise ValueError(f"--wan-rtt-ms must be in 0..10000, got {self.wan_rtt_s * 1000:g}")
        if self.momentum < 0 or self.lr <= 0:
            raise ValueError("--lr must be > 0 and --momentum >= 0")


# -- the worker (runs inside a namespace) --------------------------------------------------------

def _join_group(a: dict[str, Any]) -> None:
    """Join this mode's process group: the data centre's (Gaia, on ``dc_backend``) or every
    worker's (gloo)."""
    from switchml.bench.nsproc import init_group
    mode = a["mode"]
    backend = a.get("dc_backend", "gloo") if mode in LOCAL_MODES else "gloo"
    if backend == "switchml":
        import switchml.torch  # noqa: F401  # registers the backend
    # Rendezvous through a file every namespace sees (the hosts share a file system): torch's
    # TCP store aborted now and then in these DNS-less namespaces
    # (``bench.testbed.C10D_ABORT``).
    store = a.get("store_dir")
    if mode in LOCAL_MODES:  # the data centre's own process group
        init_group(backend, a["dc_master"], a["port"], a["local_rank"], a["dc_size"],
                   a["timeout_s"], store and f"{store}/dc{a['dc']}")
    else:
        init_group("gloo", a["master"], a["port"], a["rank"], a["n"], a["timeout_s"],
                   store and f"{store}/all")


def _start_gaia(a: dict[str, Any], model: Any) -> tuple[Any, Any]:
    """Gaia's synchroniser for ``model`` and, on a data centre's leader, its mirror."""
    from switchml.gaia.mirror import Mirror
    from switchml.gaia.trainer import GaiaSync
    mirror = None
    if a["local_rank"] == 0:
        from switchml.links import LinkSecurity
        security = LinkSecurity.from_dir(a["tls_dir"]) if a.get("tls_dir") else None
        mirror = Mirror(dc=a["dc"], leaders=[tuple(x) for x in a["leaders"]],
                        staleness=a["staleness"], timeout_s=a["timeout_s"],
                        bind_host="0.0.0.0", security=security).start()
    gaia = GaiaSync(model, mirror=mirror, threshold=a["threshold"], decay=a["decay"])
    return gaia, mirror


def _start_diloco(a: dict[str, Any], model: Any) -> Any:
    """DiLoCo's outer loop for ``model``; a data centre's leader all-reduces through the
    switch in data centre 0's router."""
    import torch.distributed as dist

    from switchml.gaia.diloco import DiLoCo, switch_outer
    outer = None
    if a["local_rank"] == 0:
        from switchml.protocol.config import WorkerConfig
        outer = switch_outer(tuple(a["outer_switch"]), dcs=len(a["leaders"]), dc=a["dc"],
                             job_id=a["outer_job"], token=a["outer_token"],
                             bits=a["outer_bits"], elements_per_packet=a["outer_k"],
                             window=a["outer_window"],
                             config=WorkerConfig(op_timeout_s=a["timeout_s"]))
    return DiLoCo(model, outer=outer, dcs=len(a["leaders"]), inner_steps=a["inner_steps"],
                  outer_lr=a["outer_lr"], outer_momentum=a["outer_momentum"],
                  group=dist.group.WORLD)


def _task(a: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """This worker's (model, batch_of(step) -> (x, y), loss_fn, evaluate(model) -> (accuracy,
    loss)): digits (cnn, mlp; split under the run's seed) or ``switchml.workloads``' mf. The
    model's initial values are the same on every rank (the run's seed); the batches are the
    rank's own."""
    import torch
    from torch import nn
    torch.manual_seed(a["seed"])
    seed = a["seed"] * 1000 + a["rank"]
    if a["model"] == "mf":
        from switchml.workloads import get
        task = get("mf").build(a["batch"], seed=seed)
        assert task.held_loss is not None
        held_loss = task.held_loss
        return (task.model, task.batch_of, task.loss_fn,
                lambda m: (task.evaluate(m), held_loss(m)))
    from switchml.workloads import cnn_model, digits_split, mlp_model
    model = cnn_model() if a["model"] == "cnn" else mlp_model((256,))
    xtr, ytr, xte, yte = digits_split(a["seed"])
    gen = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()

    def batch_of(step: int) -> tuple[Any, Any]:
        idx = torch.randint(0, len(ytr), (a["batch"],), generator=gen)
        return xtr[idx], ytr[idx]

    def evaluate(m: Any) -> tuple[float, float]:
        with torch.no_grad():
            logits = m(xte)
            return float((logits.argmax(1) == yte).float().mean()), float(loss_fn(logits, yte))

    return model, batch_of, loss_fn, evaluate


def _train(a: dict[str, Any], model: Any, ddp: Any, opt: Any, task: tuple[Any, ...],
           gaia: Any, evaluate: bool) -> dict[str, Any]:
    """The training steps, with an evaluation every ``eval_every`` steps when ``evaluate``:
    training time, and the evaluations' times, accuracies, losses and steps."""
    import torch.distributed as dist
    _, batch_of, loss_fn, metrics = task
    times, accs, losses, steps = [], [], [], []
    dist.barrier()
    t0 = time.perf_counter()
    paused = 0.0
    for step in range(1, a["steps"] + 1):
        x, y = batch_of(step)
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        opt.step()
        if gaia is not None:  # Gaia's last step ends with its final full exchange
            gaia.after_step() if step < a["steps"] or a["mode"] != "gaia" else gaia.finish()
        if evaluate and (step % a["eval_every"] == 0 or step == a["steps"]):
            e0 = time.perf_counter()
            acc, loss = metrics(model)
            times.append(e0 - t0 - paused)  # training time only
            paused += time.perf_counter() - e0
            accs.append(acc)
            losses.append(loss)
            steps.append(step)
    elapsed = time.perf_counter() - t0 - paused
    return {"elapsed_s": elapsed, "times": times, "accuracy": accs, "loss": losses,
            "steps": steps}


def geo_worker(a: dict[str, Any]) -> dict[str, Any]:
    """Train one worker of one mode; data centre leaders return their figures."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    mode, rank = a["mode"], a["rank"]
    _join_group(a)
    task = _task(a)
    model = task[0]
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=a["lr"], momentum=a["momentum"])
    gaia, mirror = _start_gaia(a, model) if mode == "gaia" else (None, None)
    diloco = _start_diloco(a, model) if mode == "diloco" else None
    lead = a["local_rank"] == 0
    evaluate = rank == 0 or (mode in LOCAL_MODES and lead)
    run = _train(a, model, ddp, opt, task, gaia or diloco, evaluate)
    out: dict[str, Any] = {"rank": rank, "dc": a["dc"], "elapsed_s": run["elapsed_s"]}
    if evaluate:
        out.update(times=run["times"], accuracy=run["accuracy"], loss=run["loss"],
                   steps=run["steps"])
    if gaia is not None and mirror is not None:
        assert gaia.filter is not None
        out["gaia"] = {**mirror.stats(), "entries_published": gaia.entries_published,
                       "entries_applied": gaia.entries_applied,
                       "parameters": int(gaia._prev.size)}
        mirror.close()
    if diloco is not None and diloco.outer is not None:
        out["diloco"] = {"outer_steps": diloco.outer_steps,
                         "bytes_reduced": diloco.bytes_reduced,
                         "parameters": sum(p.numel() for p in diloco.params)}
        diloco.outer.close()
    dist.destroy_process_group()
    return out


# -- the driver --------------------------------------------------------------------------------

def _argv(args: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "switchml.bench.geo", "worker", json.dumps(args)]


def _mode_args(cfg: GeoBenchConfig, geo: Any, mode: str, port: int) -> dict[str, Any]:
    """The arguments every worker of ``mode`` gets."""
    scale = cfg.gaia_lr_scale if cfg.gaia_lr_scale is not None else 1 / len(geo.dcs)
    return {"mode": mode, "n": geo.workers, "steps": cfg.steps, "batch": cfg.batch,
            "lr": cfg.lr * scale if mode == "gaia" else cfg.lr, "momentum": cfg.momentum,
            "seed": cfg.seed,
            "model": cfg.model, "eval_every": cfg.eval_every,
            "threshold": cfg.threshold, "decay": cfg.decay, "staleness": cfg.staleness,
            "timeout_s": min(cfg.timeout_s, 300.0), "master": geo.worker_ip(0), "port": port,
            "leaders": [(geo.worker_ip(geo.workers_of(j)[0]), GAIA_PORT)
                        for j in range(len(geo.dcs))],
            "dc_backend": cfg.dc_backend, "inner_steps": cfg.inner_steps,
            "outer_lr": cfg.outer_lr, "outer_momentum": cfg.outer_momentum,
            "outer_bits": cfg.outer_bits, **_outer_job(geo)}


def _outer_job(geo: Any) -> dict[str, Any]:
    """DiLoCo's outer all-reduce: a job of the data centres' leaders at the switch in data
    centre 0's router, sized for the smaller of the LAN's and the WAN's MTU."""
    from switchml.protocol.config import default_window
    from switchml.protocol.wire import elements_for_mtu
    k = elements_for_mtu(min(geo.lan.mtu, geo.wan.mtu))
    return {"outer_job": secrets.randbits(32), "outer_token": secrets.randbits(64),
            "outer_k": k, "outer_window": default_window(k)}


def _worker_args(common: dict[str, Any], geo: Any, r: int) -> dict[str, Any]:
    """Worker r's arguments: ``common`` and its place in its data centre."""
    j = geo.dc_of(r)
    members = geo.workers_of(j)
    from switchml.bench.testbed import SWITCH_PORT
    # The switch in data centre 0's router answers from the address a datagram's route
    # leaves by: its LAN address inside data centre 0, its WAN address to the others.
    outer = geo.gateway_ip(r) if j == 0 else geo.wan_router_ip(0)
    return {**common, "rank": r, "dc": j, "local_rank": members.index(r),
            "dc_size": len(members), "dc_master": geo.worker_ip(members[0]),
            "outer_switch": (outer, SWITCH_PORT)}


def _worker_env(tb: Any, r: int, switched: bool) -> dict[str, str]:
    """Worker r's environment: gloo on its link and, with ``switched``, switchml's backend at
    the switch in its data centre's router."""
    geo = tb.geo
    if switched:
        from switchml.bench.testbed import SWITCH_PORT
        from switchml.bench.testbed_train import _switchml_env
        from switchml.protocol.config import default_window
        from switchml.protocol.wire import elements_for_mtu
        k = elements_for_mtu(geo.lan.mtu)
        env = _switchml_env(tb, r, f"{geo.gateway_ip(r)}:{SWITCH_PORT}", default_window(k), k)
    else:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": tb.host_device(r)}
    env["SWITCHML_DC"] = str(geo.dc_of(r))
    return env


def _start_dc_switches(tb: Any, switches: list[Any]) -> None:
    """One software switch in every data centre's router, appended to ``switches`` as each
    starts (so that the caller stops those that did if a later one does not)."""
    from switchml.bench.testbed import SWITCH_PORT, _start_server
    for j in range(len(tb.geo.dcs)):
        switches.append(_start_server(tb, tb.dc_ns(j), "switch", {"port": SWITCH_PORT},
                                      f"the switch of data centre {j} did not start", 120,
                                      RuntimeError))


def _stop_switches(switches: list[Any]) -> None:
    """Stop the data centres' switches and wait until they exited (their port is free for
    the next run, a retry included)."""
    import subprocess
    for sw in switches:
        if sw.stdin is not None and not sw.stdin.closed:
            sw.stdin.close()  # a switch stops when its stdin closes
    for sw in switches:
        try:
            sw.wait(timeout=10)
        except subprocess.TimeoutExpired:
            sw.kill()
            sw.wait()
        if sw.stdout is not None:
            sw.stdout.close()


def _run_mode(tb: Any, cfg: GeoBenchConfig, mode: str, seed: int) -> dict[str, Any]:
    """Train ``mode`` on the testbed ``tb``: its row."""
    geo = tb.geo
    port = 34000 + secrets.randbelow(10000)
    store_dir = tempfile.mkdtemp(prefix="switchml-geo-")
    try:
        # The links between data centres are mutual TLS, as they must be across a WAN: the
        # CPU and bytes of encryption are in every Gaia row.
        from switchml.links import make_credentials
        make_credentials(f"{store_dir}/tls")
        return _run_mode_in(tb, cfg, mode, {**_mode_args(cfg, geo, mode, port), "seed": seed,
                                            "store_dir": store_dir,
                                            "tls_dir": f"{store_dir}/tls"})
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


def _run_mode_in(tb: Any, cfg: GeoBenchConfig, mode: str, common: dict[str, Any]
                 ) -> dict[str, Any]:
    """:func:`_run_mode` with the workers' arguments made."""
    from switchml.bench.testbed import _start_workers, _wait_all
    geo = tb.geo
    switches: list[Any] = []
    switched = mode in LOCAL_MODES and cfg.dc_backend == "switchml"
    try:
        if switched or mode == "diloco":
            _start_dc_switches(tb, switches)
        # The line's counters once it is empty: a packet in it now (the links' own chatter as
        # they come up, IPv6's neighbour discovery) would be given back during the run
        # without having been taken in it, and count as -1 lost (CI saw it twice).
        packets0 = (_settled_delay_line(tb) if geo.wan_rtt_s > 0
                    else tb.delay_line_packets())
        wan0, cpu0 = tb.wan_bytes(), tb.delay_line_cpu_s()
        procs = _start_workers(tb, range(geo.workers),
                               lambda r: _argv(_worker_args(common, geo, r)),
                               lambda r: _worker_env(tb, r, switched))
        try:
            outs = _wait_all(procs, cfg.timeout_s)
        except Exception:
            tb.check_delay_line()  # a dead delay line is the reason, if it died
            raise
        wan = tb.wan_bytes() - wan0
    finally:  # also when the run failed: a retry starts its switches on the same port
        _stop_switches(switches)
    row = _mode_row(cfg, geo, mode, outs, wan)
    row["wan_rtt_s"] = geo.wan_rtt_s
    if geo.wan_rtt_s > 0:  # what the emulation itself cost (CPU of the shared machine)
        row["delay_line_cpu_s"] = tb.delay_line_cpu_s() - cpu0
        packets = _settled_delay_line(tb)
        row["delay_line_packets"] = packets["given_back"] - packets0["given_back"]
        row["delay_line_lost"] = (packets["taken"] - packets0["taken"]
                                  - row["delay_line_packets"]
                                  + packets["queue_drops"] - packets0["queue_drops"])
    return row


def _mode_row(cfg: GeoBenchConfig, geo: Any, mode: str, outs: list[dict[str, Any]],
              wan: int) -> dict[str, Any]:
    """A mode's row from its workers' reports (rank 0's evaluations) and the WAN bytes."""
    lead = outs[0]
    row: dict[str, Any] = {
        "mode": mode, "dcs": list(geo.dcs), "wan_bps": cfg.wan_bps if len(geo.dcs) > 1 else None,
        "lan_bps": cfg.lan_bps, "steps": cfg.steps,
        "dc_backend": cfg.dc_backend if mode in LOCAL_MODES else "gloo",
        "elapsed_s": max(o["elapsed_s"] for o in outs),
        "times": lead["times"], "accuracy": lead["accuracy"], "eval_steps": lead["steps"],
        "final_accuracy": _final(lead["accuracy"]), "last_accuracy": lead["accuracy"][-1],
        "loss": lead["loss"], "final_loss": _final(lead["loss"]),
        "wan_bytes": wan,
    }
    if mode == "gaia":
        leaders = [o for o in outs if "gaia" in o]
        row["gaia"] = [o["gaia"] for o in leaders]
        row["final_accuracy_per_dc"] = [_final(o["accuracy"]) for o in leaders]
        row["gaia_wait_s"] = [o["gaia"]["wait_s"] for o in leaders]
        sent = sum(o["gaia"]["entries_published"] for o in leaders)
        row["fraction_entries_sent"] = sent / (leaders[0]["gaia"]["parameters"] * cfg.steps
                                               * len(leaders))
    if mode == "diloco":
        leaders = [o for o in outs if "diloco" in o]
        row["diloco"] = [o["diloco"] for o in leaders]
        row["final_accuracy_per_dc"] = [_final(o["accuracy"]) for o in leaders]
        row["inner_steps"], row["outer_bits"] = cfg.inner_steps, cfg.outer_bits
    return row


FINAL_EVALS = 5
"""Final accuracy: the mean of the last this-many evaluations (a single evaluation of 360 test
images moves by +-1 point from one to the next, as much as the differences compared)."""


def _final(accs: list[float]) -> float:
    tail = accs[-FINAL_EVALS:]
    return sum(tail) / len(tail)


def _run_mode_retrying(tb: Any, cfg: GeoBenchConfig, mode: str, seed: int
                       ) -> dict[str, Any]:
    """:func:`_run_mode`, again once if torch aborted (``bench.testbed.C10D_ABORT``)."""
    from switchml.bench.testbed import once_more_if_torch_aborted
    # The failed try's last packets may still be in the delay line: the retry's counters
    # start once they are out, or it would count one given back that it never gave.
    return once_more_if_torch_aborted(lambda: _run_mode(tb, cfg, mode, seed), mode,
                                      lambda: _settled_delay_line(tb))


def _settled_delay_line(tb: Any, limit_s: float = 5.0) -> dict[str, int]:
    """The delay line's counters once the packets in it are out: read every round trip
    (10 ms at least) until two reads agree, ``limit_s`` at most. A fixed wait of two round
    trips was not always enough on a busy machine (the line is a process sharing the cores
    with the workers), and a count read with a packet still in the line calls it lost."""
    step = max(2 * tb.geo.wan_rtt_s, 0.01)
    deadline = time.monotonic() + limit_s
    last = tb.delay_line_packets()
    while True:
        time.sleep(step)
        now = tb.delay_line_packets()
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def time_to_target(row: dict[str, Any], target: float) -> float | None:
    return next((t for t, a in zip(row["times"], row["accuracy"]) if a >= target), None)


def run_geo_bench(cfg: GeoBenchConfig, progress: Any = None) -> list[dict[str, Any]]:
    """Build the testbeds, run every mode (Gaia at each of ``cfg.thresholds``, where given),
    return one row per mode and threshold (with the comparison)."""
    from dataclasses import replace

    from switchml.testbed import GeoTestbed, GeoTopology, LinkSpec
    lan_link = LinkSpec(bandwidth_bps=cfg.lan_bps)
    rows = []
    for mode in cfg.modes:
        dcs = (sum(cfg.dcs),) if mode == "lan" else cfg.dcs
        variants = [replace(cfg, threshold=t) for t in cfg.thresholds or (cfg.threshold,)
                    ] if mode == "gaia" else [cfg]
        topo = GeoTopology(dcs=dcs, lan=lan_link, wan=LinkSpec(bandwidth_bps=cfg.wan_bps),
                           wan_rtt_s=cfg.wan_rtt_s if len(dcs) > 1 else 0.0)
        with GeoTestbed(topo) as tb:
            for run_cfg in variants:
                if progress is not None:
                    progress(f"{_label(mode, run_cfg)}: data centres {dcs}, WAN "
                             f"{cfg.wan_bps / 1e6:g} Mbit/s, round trip +"
                             f"{topo.wan_rtt_s * 1000:g} ms, {cfg.steps} steps, "
                             f"{cfg.seeds} seed(s)")
                runs = []
                for seed in range(cfg.seed, cfg.seed + cfg.seeds):
                    run = _run_mode_retrying(tb, run_cfg, mode, seed)
                    run["seed"] = seed
                    run["time_to_target_s"] = time_to_target(run, cfg.target_accuracy)
                    runs.append(run)
                row = _mean_row(runs)
                row["target_accuracy"] = cfg.target_accuracy
                if mode == "gaia":
                    row["threshold"], row["decay"] = run_cfg.threshold, run_cfg.decay
                rows.append(row)
                if progress is not None:
                    progress(f"{_label(mode, run_cfg)}: final accuracy "
                             f"{row['final_accuracy']:.4f}, time to {cfg.target_accuracy:g}: "
                             f"{row['time_to_target_s']}, WAN bytes {row['wan_bytes']}")
    _compare(rows)
    return rows


def gaia_label(threshold: float, decay: bool) -> str:
    """Gaia's threshold as the tables and plots name it: ``S=0.01/sqrt(t)``."""
    return f"S={threshold:g}{'/sqrt(t)' if decay else ''}"


def _label(mode: str, cfg: GeoBenchConfig) -> str:
    """``mode``, with Gaia's threshold."""
    return mode if mode != "gaia" else f"gaia {gaia_label(cfg.threshold, cfg.decay)}"


MEAN_KEYS = ("elapsed_s", "final_accuracy", "last_accuracy", "final_loss", "wan_bytes")


def _mean_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode's row from its runs (one per seed): the first run's curves, the mean of
    ``MEAN_KEYS`` and of the time to target (None unless every run reached it), and every
    run's figures under ``runs``."""
    row = dict(runs[0])
    if len(runs) == 1:
        return row
    for k in (*MEAN_KEYS, "fraction_entries_sent", "delay_line_cpu_s", "delay_line_packets",
              "delay_line_lost"):
        if all(k in r for r in runs):
            row[k] = sum(r[k] for r in runs) / len(runs)
    times = [r["time_to_target_s"] for r in runs]
    row["time_to_target_s"] = None if None in times else sum(times) / len(times)
    row["runs"] = [{k: r[k] for k in ("seed", "time_to_target_s", *MEAN_KEYS)} for r in runs]
    return row


def _compare(rows: list[dict[str, Any]]) -> None:
    by = {r["mode"]: r for r in rows}
    gaia, lan, wan = by.get("gaia"), by.get("lan"), by.get("wan")
    for r in rows:
        cmp: dict[str, Any] = {}
        t = r["time_to_target_s"]
        if lan and t and lan["time_to_target_s"]:
            cmp["time_to_target_vs_lan"] = t / lan["time_to_target_s"]
        if wan and t and wan["time_to_target_s"]:
            cmp["speedup_vs_wan"] = wan["time_to_target_s"] / t
        if wan and wan["wan_bytes"] and r["mode"] != "lan":
            cmp["wan_bytes_vs_wan"] = r["wan_bytes"] / wan["wan_bytes"]
        if wan:
            cmp["accuracy_minus_wan_points"] = 100 * (r["final_accuracy"] - wan["final_accuracy"])
            if wan.get("final_loss"):
                cmp["loss_vs_wan"] = r["final_loss"] / wan["final_loss"]
        r["comparison"] = cmp
    del gaia


def write_outputs(rows: list[dict[str, Any]], cfg: GeoBenchConfig, out_dir: str) -> list[str]:
    """JSON, CSV and PNG (accuracy against time) in ``out_dir``, and with Gaia at several
    thresholds ``tradeoff.png`` (final accuracy against WAN bytes); returns the paths."""
    import csv
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("geo.json", "geo.csv", "geo.png")]
    with open(paths[0], "w") as f:
        json.dump({"benchmark": "geo", "config": asdict(cfg), "machine": {
            "cpus": os.cpu_count(), "uname": " ".join(os.uname())}, "results": rows}, f,
            indent=2)
    keys = ["mode", "threshold", "decay", "dcs", "wan_bps", "wan_rtt_s", "steps", "elapsed_s",
            "time_to_target_s", "final_accuracy", "last_accuracy", "final_loss", "wan_bytes",
            "fraction_entries_sent", "delay_line_cpu_s", "delay_line_packets",
            "delay_line_lost"]
    with open(paths[1], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys + ["time_to_target_vs_lan", "speedup_vs_wan", "wan_bytes_vs_wan"])
        for r in rows:
            c = r.get("comparison", {})
            w.writerow([r.get(k) for k in keys] + [c.get("time_to_target_vs_lan"),
                                               c.get("speedup_vs_wan"),
                                               c.get("wan_bytes_vs_wan")])
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = {"lan": "one data centre (LAN)", "wan": "synchronous across the WAN",
              "gaia": "Gaia", "diloco": f"DiLoCo (H = {cfg.inner_steps}, {cfg.outer_bits}-bit)"}
    for r in rows:
        name = labels[r["mode"]] if r["mode"] != "gaia" else _row_label(r)
        ax.plot(r["times"], r["accuracy"], label=f"{name}: "
                f"{r['wan_bytes'] / 1e6:.1f} MB over the WAN")
    ax.axhline(cfg.target_accuracy, color="grey", ls="--", lw=0.8, label="target")
    ax.set_xlabel("seconds of training")
    ax.set_ylabel("held-out accuracy (data centre 0)")
    ax.set_title(f"{cfg.model}, data centres {cfg.dcs}, WAN {cfg.wan_bps / 1e6:g} Mbit/s + "
                 f"{cfg.wan_rtt_s * 1000:g} ms, LAN {cfg.lan_bps / 1e9:g} Gbit/s")
    ax.set_ylim(0.5 if cfg.model == "mf" else 0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(paths[2], dpi=100)
    plt.close(fig)
    if sum(r["mode"] == "gaia" for r in rows) > 1:
        paths.append(_plot_tradeoff(rows, cfg, os.path.join(out_dir, "tradeoff.png")))
    return paths


def _row_label(r: dict[str, Any]) -> str:
    """A Gaia row's name, with its threshold."""
    return f"Gaia {gaia_label(r.get('threshold', 0), bool(r.get('decay')))}"


def _plot_tradeoff(rows: list[dict[str, Any]], cfg: GeoBenchConfig, path: str) -> str:
    """Final accuracy, and time to target, against WAN bytes: Gaia at each threshold a line,
    the other modes across the WAN points. A point far below Gaia's and synchronous training's
    accuracies (a run that diverged) is drawn at the bottom edge with its value."""
    import matplotlib.pyplot as plt
    fig, (acc_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    gaia = sorted((r for r in rows if r["mode"] == "gaia"), key=lambda r: r["wan_bytes"])
    others = [r for r in rows if r["mode"] in ("wan", "diloco")]
    names = {"wan": "synchronous", "diloco": f"DiLoCo (H = {cfg.inner_steps})"}
    decay = "/sqrt(t)" if cfg.decay else ""
    scale = [100 * r["final_accuracy"] for r in gaia + [r for r in others if r["mode"] == "wan"]]
    low, high = min(scale) - 1.0, max(scale) + 1.0
    mb = [r["wan_bytes"] / 1e6 for r in gaia]
    acc_ax.plot(mb, [100 * r["final_accuracy"] for r in gaia], "o-",
                label=f"Gaia, threshold S{decay}")
    times = [(r["wan_bytes"] / 1e6, r["time_to_target_s"]) for r in gaia
             if r["time_to_target_s"] is not None]
    if times:
        time_ax.plot(*zip(*times), "o-", label=f"Gaia, threshold S{decay}")
    for k, r in enumerate(gaia):
        offset = (-10, 8 + 10 * (k % 3)) if k % 2 == 0 else (-10, -14 - 10 * (k % 3))
        acc_ax.annotate(f"S={r.get('threshold', 0):g}", (mb[k], 100 * r["final_accuracy"]),
                        textcoords="offset points", xytext=offset, fontsize=8)
    for r in others:
        x, acc = r["wan_bytes"] / 1e6, 100 * r["final_accuracy"]
        if acc < low:
            acc_ax.plot([x], [low + 0.1], "v", label=f"{names[r['mode']]}: {acc:.1f}% "
                        "(off the scale)")
        else:
            acc_ax.plot([x], [acc], "s", label=names[r["mode"]])
        if r["time_to_target_s"] is not None:
            time_ax.plot([x], [r["time_to_target_s"]], "s", label=names[r["mode"]])
    acc_ax.set_ylim(low, high)
    acc_ax.set_ylabel("final held-out accuracy (%)")
    time_ax.set_ylabel(f"seconds to {100 * cfg.target_accuracy:g}% (runs that reached it)")
    from matplotlib.ticker import NullFormatter
    for ax in (acc_ax, time_ax):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("WAN bytes (MB, log scale)")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"{cfg.model}: the significance threshold trades accuracy and time for WAN "
                 f"bytes (WAN {cfg.wan_bps / 1e6:g} Mbit/s, mean of {cfg.seeds} seed(s))",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "worker":
        sys.exit("usage: python -m switchml.bench.geo worker JSON")
    print(json.dumps(geo_worker(json.loads(sys.argv[2]))), flush=True)
