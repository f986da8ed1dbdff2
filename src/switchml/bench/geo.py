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
  ``inner_steps`` steps DiLoCo's outer step on the pseudo-gradients, all-reduced by
  the data centres' leaders through the switch in data centre 0's router, 16-bit on the wire
  (``switchml.gaia.diloco``);
- ``torchft``: the same, with torchft's DiLoCo across (its ``Manager`` over gloo and a
  lighthouse: ``bench.geo_torchft``), the independent implementation ours is held against.

Rank 0 (in data centre 0) evaluates test accuracy every ``eval_every`` steps (evaluation time is
not counted). Reported per mode: time to the target accuracy (first evaluation at or above it),
final accuracy (mean of the last ``FINAL_EVALS`` evaluations; the last one alone is
``last_accuracy``), WAN bytes (the data-centre routers' WAN interface transmit counters, before
and after), accuracy against time.
Run as root. Worker processes run ``python -m switchml.bench.geo_worker JSON``
(``bench.geo_worker``); the outputs are written by ``bench.geo_report``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["GeoBenchConfig", "MODES", "run_geo_bench"]

MODES = ("lan", "wan", "gaia", "diloco")
"""The modes run by default; ``torchft`` is asked for by name (it needs the package)."""
ALL_MODES = (*MODES, "torchft")
LOCAL_MODES = ("gaia", "diloco", "torchft")
"""Modes whose process groups are a data centre's, not every worker's."""
DC_BACKEND_MODES = ("gaia", "diloco")
"""Modes whose data-centre groups run on ``dc_backend`` (torchft's always on gloo)."""
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
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    """DiLoCo's outer step (the library's defaults: the mean of the models; the paper's
    Nesterov step is 0.7 and 0.9)."""
    outer_bits: int = 16
    """DiLoCo's outer all-reduce on the wire: 16 (fixed point, error feedback) or 32."""
    embedding_rows: bool = False
    """DiLoCo (ours): an embedding row's mean over the data centres that moved it; False: the
    plain mean over all of them (the library's default, torchft's, and the paper's)."""
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
        unknown = set(self.modes) - set(ALL_MODES)
        if unknown:
            raise ValueError(f"unknown mode(s) {sorted(unknown)}; known: "
                             f"{', '.join(ALL_MODES)}")
        if len(self.dcs) < 2:
            raise ValueError(f"GeoBenchConfig.dcs needs at least two data centres, got {self.dcs}")
        if self.steps < 2 or self.eval_every < 1 or self.batch < 1 or self.seeds < 1:
            raise ValueError("GeoBenchConfig.steps must be >= 2, GeoBenchConfig.eval_every, "
                             "GeoBenchConfig.batch and GeoBenchConfig.seeds >= 1")
        if not 0 < self.target_accuracy <= 1:
            raise ValueError("GeoBenchConfig.target_accuracy must be an accuracy in (0, 1]")
        if self.inner_steps < 1 or self.outer_bits not in (16, 32):
            raise ValueError("GeoBenchConfig.inner_steps must be >= 1 and "
                             "GeoBenchConfig.outer_bits "
                             "16 or 32")
        if any(not 0 <= t <= 1 for t in (self.threshold, *self.thresholds)):
            raise ValueError("Gaia's thresholds are fractions in [0, 1]")
        if self.thresholds and "gaia" not in self.modes:
            raise ValueError("GeoBenchConfig.thresholds are Gaia's: add gaia to "
                             "GeoBenchConfig.modes")
        if not 0 <= self.wan_rtt_s <= 10:
            raise ValueError(f"GeoBenchConfig.wan_rtt_s must be 0 to 10 s (10000 ms), got "
                             f"{self.wan_rtt_s * 1000:g} ms")
        if self.momentum < 0 or self.lr <= 0:
            raise ValueError("GeoBenchConfig.lr must be > 0 and GeoBenchConfig.momentum >= 0")

# -- the driver --------------------------------------------------------------------------------

def _argv(args: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "switchml.bench.geo_worker", json.dumps(args)]


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
            "outer_bits": cfg.outer_bits, "embedding_rows": cfg.embedding_rows,
            **_outer_job(geo)}


def _outer_job(geo: Any) -> dict[str, Any]:
    """DiLoCo's outer all-reduce: a job of the data centres' leaders at the switch in data
    centre 0's router, sized for the smaller of the LAN's and the WAN's MTU."""
    from switchml.control import new_job_id
    from switchml.protocol.config import default_window
    from switchml.protocol.wire import elements_for_mtu
    k = elements_for_mtu(min(geo.lan.mtu, geo.wan.mtu))
    return {"outer_job": new_job_id(), "outer_token": secrets.randbits(64),
            "outer_k": k, "outer_window": default_window(k)}


def _worker_args(common: dict[str, Any], geo: Any, r: int) -> dict[str, Any]:
    """Worker r's arguments: ``common`` and its place in its data centre."""
    j = geo.dc_of(r)
    members = geo.workers_of(j)
    from switchml.bench.testbed import SWITCH_PORT
    # The switch in data centre 0's router answers from the address a datagram's route
    # leaves by: its LAN address inside data centre 0, its WAN address to the others.
    outer = geo.gateway_ip(r) if j == 0 else geo.wan_router_ip(0)
    if common["mode"] == "torchft":
        from switchml.bench.geo_torchft import worker_args
        common = {**common, **worker_args(geo, r)}
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
    from switchml.bench.testbed import SWITCH_PORT, start_switch
    for j in range(len(tb.geo.dcs)):
        switches.append(start_switch(tb, tb.dc_ns(j), SWITCH_PORT,
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
    switched = mode in DC_BACKEND_MODES and cfg.dc_backend == "switchml"
    lighthouse = None
    try:
        if switched or mode == "diloco":
            _start_dc_switches(tb, switches)
        if mode == "torchft":
            from switchml.bench.geo_torchft import start_lighthouse
            lighthouse = start_lighthouse(tb, len(geo.dcs))
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
        if lighthouse is not None:
            from switchml.bench.geo_torchft import stop_lighthouse
            stop_lighthouse(lighthouse)
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
    if mode in ("diloco", "torchft"):
        leaders = [o for o in outs if "diloco" in o]
        row["diloco"] = [o["diloco"] for o in leaders]
        row["final_accuracy_per_dc"] = [_final(o["accuracy"]) for o in leaders]
        row["inner_steps"] = cfg.inner_steps
        row["outer_bits"] = cfg.outer_bits if mode == "diloco" else 32
        row["outer_lr"], row["outer_momentum"] = cfg.outer_lr, cfg.outer_momentum
        row["embedding_rows"] = cfg.embedding_rows and mode == "diloco"
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
    if "torchft" in cfg.modes:
        from switchml.bench.geo_torchft import available
        if (missing := available()) is not None:
            raise ValueError(f"mode torchft: {missing}")
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
    row["runs"] = [{k: r[k] for k in ("seed", "time_to_target_s", *MEAN_KEYS, "loss",
                                      "eval_steps") if k in r} for r in runs]
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
