"""Data-parallel training of the workloads over the emulated testbed, one row per workload and
system, and what is derived from the rows: time to the target metric, the ideal step (compute
plus the exposed part of the wire time), the Chrome trace and the plots.

The testbed, its switch and the worker processes are those of the all-reduce benchmark
(:mod:`switchml.bench.testbed`); each worker runs ``bench/nsproc.py``'s ``train`` role.
"""

from __future__ import annotations

import functools
import os
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from switchml.bench import testbed_live, train_torchft
from switchml.bench.testbed import (
    DEFAULT_MTU,
    SWITCH_PORT,
    _cpu_percent,
    _nsproc,
    _start_switch,
    _start_workers,
    _store_dir,
    _topology,
    _wait_all,
    once_more_if_torch_aborted,
)
from switchml.protocol.config import default_window
from switchml.protocol.wire import elements_for_mtu
from switchml.testbed import Testbed
from switchml.testbed.netns import TestbedError

__all__ = ["TRAIN_SYSTEMS", "TrainBenchConfig", "add_ideal", "add_time_to_target", "plot_bytes",
           "plot_timeline", "plot_training", "run_testbed_train", "write_trace"]


@dataclass(frozen=True)
class TrainBenchConfig:
    """Data-parallel training over the testbed: each workload on each system, same links."""

    __test__ = False

    workers: int = 4
    models: tuple[str, ...] = ("ncf", "cnn")
    """Workloads (``switchml.workloads``)."""
    steps: int = 60
    batch: int | None = None
    """Per-worker batch; None: each workload's default."""
    systems: tuple[str, ...] = ("noop", "gloo", "switchml")
    """``TRAIN_SYSTEMS``: ``gloo`` and ``switchml``: DDP on that backend; ``switchml16``:
    DDP with the 16-bit switchml hook; ``hybrid``: HybridDataParallel on switchml (per layer
    aggregation or sufficient-factor broadcasting); ``noop``: DDP with no communication at all
    (the step's compute, for the ideal); ``lockstep``: no gradient moves, but the ranks wait
    for each other at every bucket (the slowest rank's compute, for the lockstep ideal);
    ``hsdp`` and ``hsdp-gloo``: FSDP2 on a 2-D mesh of (workers / 2) replicas x 2 shards, on
    switchml (the replicas' all-reduce through the switch) and on gloo; their rows report the
    replica all-reduce's seconds per step."""
    eval_every: int = 10
    """Evaluate the workload's metric every this many steps (left out of the step times)."""
    trace: bool = False
    """Keep every rank's timeline (Chrome trace events); the hidden-communication fraction is
    measured either way."""
    rate_bps: float = 1e9
    loss_rate: float = 0.0
    mtu: int = DEFAULT_MTU
    window: int | None = None
    """Slots per job; default from the chunk size (``protocol.config.default_window``)."""
    switch_nice: int = -10
    """The software switch's niceness. It stands for a device with silicon of its own; on a
    machine whose cores the workers' training also needs, it goes first for the CPU, as a
    real switch would not wait for the hosts' compute (0: share the CPU equally)."""
    timeout_s: float = 900.0
    straggle_s: float = 0.0
    """A straggler: this many seconds of extra compute (a sleep before the step's forward) on
    the straggling rank; 0: none."""
    straggle_every: int = 0
    """0: the last rank straggles at every step (persistent); N: at one step in N on average,
    a rank drawn at random (the same draw on every rank) straggles (transient)."""
    quorum: int | None = None
    """``switchml-quorum``'s quorum; None: ``workers - 1``."""
    kill_worker_at: int = 0
    """``switchml-live``: the last rank exits abruptly as this step begins, and a replacement
    starts ``replace_after_s`` later, joins the running job and takes a live rank's state;
    0: never."""
    replace_after_s: float = 3.0
    skip_behind: bool = True
    """``switchml-live``: a rank whose peers are past its next step takes that step's sums
    without computing it (``LiveQuorum.skip_step``; it sends nothing for them: every result
    is at hand). Without it, a replacement of ncf never caught up in 30
    steps (docs/torch.md)."""
    catch_up_steps: int = 0
    """``switchml-live``: a rank whose peers are more than this many steps ahead takes a live
    rank's state and skips the steps between (``LiveQuorum.catch_up``); 0: never."""
    kill_switch_at: int = 0
    """Kill the switch (SIGKILL) as rank 0 starts this step of each run on a switchml system;
    0: never. The switch is started again for the next run."""
    switch_back_after_s: float = 0.0
    """With ``kill_switch_at``: start a new switch at the same address this long after the
    kill, during the run (the failover probes every 2 s and goes back to it); 0: not."""

    def __post_init__(self) -> None:
        from switchml import workloads
        for m in self.models:
            workloads.get(m)  # raises, naming the known ones
        bad = set(self.systems) - set(TRAIN_SYSTEMS)
        if bad or not self.systems:
            raise ValueError(f"unknown system(s) {sorted(bad)}; known: "
                             f"{', '.join(TRAIN_SYSTEMS)}")
        if self.batch is not None and self.batch < 1:
            raise ValueError(f"TrainBenchConfig.batch must be >= 1, got {self.batch}")
        if self.steps < 2:
            raise ValueError(f"TrainBenchConfig.steps must be >= 2, got {self.steps}")
        if self.eval_every < 0:
            raise ValueError(f"TrainBenchConfig.eval_every must be >= 0, got {self.eval_every}")
        if self.straggle_s < 0 or self.straggle_every < 0:
            raise ValueError("TrainBenchConfig.straggle_s and TrainBenchConfig.straggle_every "
                             "must be >= 0")
        if self.quorum is not None and not 1 <= self.quorum <= self.workers:
            raise ValueError(f"TrainBenchConfig.quorum must be in 1..{self.workers}, got "
                             f"{self.quorum}")
        if self.switch_back_after_s < 0 or (self.switch_back_after_s and not self.kill_switch_at):
            raise ValueError("TrainBenchConfig.switch_back_after_s needs "
                             "TrainBenchConfig.kill_switch_at, "
                             "and seconds >= 0")
        if not 0 <= self.kill_switch_at < self.steps:
            raise ValueError("TrainBenchConfig.kill_switch_at must be a step in "
                             f"1..{self.steps - 1} (or 0: "
                             f"never), got {self.kill_switch_at}")
        if not 0 <= self.kill_worker_at < self.steps or self.replace_after_s < 0:
            raise ValueError(f"TrainBenchConfig.kill_worker_at must be a step in 1.."
                             f"{self.steps - 1} (or 0: never), and "
                             f"TrainBenchConfig.replace_after_s >= 0; got "
                             f"{self.kill_worker_at} and {self.replace_after_s}")
        if self.catch_up_steps < 0:
            raise ValueError(f"TrainBenchConfig.catch_up_steps must be >= 0 (0: never), got "
                             f"{self.catch_up_steps}")
        if self.kill_worker_at and not any(TRAIN_SYSTEMS[s][2] == "live" for s in self.systems):
            raise ValueError("TrainBenchConfig.kill_worker_at kills a worker of the systems "
                             "whose replicas come and go: switchml-live and torchft (the others "
                             "would stop, waiting for it)")
        doomed = [s for s in self.systems
                  if TRAIN_SYSTEMS[s][0] == "switchml" and s != "switchml-failover"]
        if self.kill_switch_at and doomed:
            raise ValueError(f"TrainBenchConfig.kill_switch_at: {', '.join(doomed)} would fail "
                             f"once the switch "
                             "is gone (after the group's timeout); run gloo, "
                             "switchml-failover and switchml-live")

    @property
    def quorum_k(self) -> int:
        """The quorum ``switchml-quorum`` runs with."""
        return self.quorum if self.quorum is not None else max(1, self.workers - 1)


TRAIN_SYSTEMS = {"noop": ("gloo", "ddp", "noop"), "lockstep": ("gloo", "ddp", "lockstep"),
                 "gloo": ("gloo", "ddp", None),
                 "switchml": ("switchml", "ddp", None),
                 "switchml16": ("switchml", "ddp", "switchml16"),
                 "hybrid": ("switchml", "hybrid", None),
                 "hsdp-gloo": ("gloo", "hsdp", None), "hsdp": ("switchml", "hsdp", None),
                 "switchml-quorum": ("switchml", "ddp", "quorum"),
                 "switchml-failover": ("switchml", "ddp", None),
                 "switchml-live": ("switchml-live", "ddp", "live"),
                 "torchft": ("torchft", "ddp", "live")}
"""system -> (backend, mode, DDP communication hook)."""
SILENT = frozenset({"noop", "lockstep"})
FAILOVER_TIMEOUT_S = 10.0
"""``switchml-failover``'s process-group timeout: how long an all-reduce waits for a silent
switch before the group goes on over gloo (the other systems': 120 s)."""
"""The systems that move no gradient: references for the ideal, not trained models."""


def _switchml_env(tb: Testbed, host: int, switch: str, window: int, k: int,
                  quorum: int | None = None, failover: bool = False,
                  probe_s: float = 0.0) -> dict[str, str]:
    """A worker's environment: gloo on its link, switchml's backend at ``switch`` (no secret),
    with ``quorum`` (``SWITCHML_QUORUM``) if given, and ``SWITCHML_FAILOVER=gloo`` with
    ``failover``."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": tb.host_device(host),
           "SWITCHML_SWITCH": switch, "SWITCHML_WINDOW": str(window),
           "SWITCHML_ELEMENTS_PER_PACKET": str(k)}
    for name in ("SWITCHML_SECRET", "SWITCHML_QUORUM", "SWITCHML_FAILOVER",
                 "SWITCHML_FAILOVER_PROBE_S"):
        env.pop(name, None)
    if probe_s:
        env["SWITCHML_FAILOVER_PROBE_S"] = str(probe_s)
    if quorum is not None:
        env["SWITCHML_QUORUM"] = str(quorum)
    if failover:
        env["SWITCHML_FAILOVER"] = "gloo"
    return env


def _train_once(tb: Testbed, cfg: TrainBenchConfig, model: str, system: str,
                switch_pid: int = 0) -> dict[str, Any]:
    """Train ``model`` on ``system`` over the testbed: the run's row (rank 0's losses).
    ``switch_pid``: the switch, which rank 0 kills at ``cfg.kill_switch_at``."""
    from switchml import workloads
    backend, mode, hook = TRAIN_SYSTEMS[system]
    live = hook == "live"  # (switchml-live, and torchft: replicas that come and go)
    quorum = cfg.quorum_k if hook in ("quorum", "live") else None
    kill = bool(cfg.kill_switch_at and backend in ("switchml", "switchml-live") and switch_pid)
    # (switchml-live goes on over gloo too where its switch is killed: LiveQuorum(failover=))
    failover = system == "switchml-failover" or (kill and system == "switchml-live")
    # (a quorum job's results carry a bitmap of the ranks: chunks leave room for it)
    topo = tb.topology
    k = elements_for_mtu(cfg.mtu, trailer=(cfg.workers + 7) // 8 if quorum else 0)
    work = workloads.get(model)
    batch = cfg.batch or work.batch
    port = 33000 + secrets.randbelow(20000)
    state_secret = secrets.token_hex(16)  # (switchml-live: the replicas' state streams)
    with _store_dir() as store:
        def argv_of(r: int, replacement: bool = False) -> list[str]:
            return _nsproc("train", {
            "backend": backend, "model": model, "rank": r, "n": cfg.workers,
            "master": topo.worker_ip(0), "port": port, "steps": cfg.steps,
            "batch": batch, "mode": mode, "hook": hook, "trace": cfg.trace,
            "eval_every": cfg.eval_every, "dev": tb.host_device(r), "mtu": cfg.mtu,
            "store_file": f"{store}/group", "straggle_s": cfg.straggle_s,
            "straggle_every": cfg.straggle_every,
            "timeout_s": FAILOVER_TIMEOUT_S if failover else 120.0, "track_failover": failover,
            **({"kill_switch_at": cfg.kill_switch_at, "kill_switch_pid": switch_pid}
               if kill and r == 0 else {}),
            **({"quorum": quorum, "window": cfg.window or default_window(k), "k": k,
                "replacement": replacement, "catch_up_steps": cfg.catch_up_steps,
                "skip_behind": cfg.skip_behind, "state_secret": state_secret,
                "failover": "gloo" if failover else "off"}
               if live else {}),
            **({"host_ip": topo.worker_ip(r), "lighthouse": f"http://{topo.switch_ip(r)}:"
                f"{train_torchft.LIGHTHOUSE_PORT}"} if backend == "torchft" else {}),
            **({"die_at": cfg.kill_worker_at} if live and cfg.kill_worker_at
               and r == cfg.workers - 1 and not replacement else {})})

        def env_of(r: int) -> dict[str, str]:
            return _switchml_env(tb, r, f"{topo.switch_ip(r)}:{SWITCH_PORT}",
                                 cfg.window or default_window(k), k,
                                 quorum if not live else None, failover and not live,
                                 2.0 if failover and cfg.switch_back_after_s else 0.0)
        lighthouse = (train_torchft.start_lighthouse(tb, cfg.workers - 1)
                      if backend == "torchft" else None)
        procs = _start_workers(tb, range(cfg.workers), argv_of, env_of)
        replaced: dict[str, Any] = {}
        if live and cfg.kill_worker_at:
            procs = procs[:-1] + [_replace_when_dead(tb, cfg, procs[-1], argv_of, env_of,
                                                     replaced)]
        try:
            out = _wait_all(procs, cfg.timeout_s)
        finally:
            if lighthouse is not None:
                lighthouse.kill()
                lighthouse.wait()
    lead = out[0]
    # Step time from the second half (after warm-up and bucket rebuilding); the times leave
    # evaluation out.
    times = lead["times"]
    half = len(times) // 2
    step_s = (times[-1] - times[half - 1]) / (len(times) - half)
    evals = lead.get("evals") or []
    killed = _around_the_kill(cfg, times, lead.get("on_gloo") or []) if kill else {}
    if kill and live:  # (every replica's model, after its last step over gloo)
        killed["replicas_identical"] = len({o.get("params_digest") for o in out}) == 1
    if replaced:
        killed = testbed_live.around_the_replacement(cfg, out, replaced)
    return {
        "model": model, "backend": backend, "system": system, "mode": mode, "hook": hook,
        "quorum": quorum, "straggle_s": cfg.straggle_s, "straggle_every": cfg.straggle_every,
        "straggled_steps": lead.get("straggled_steps", 0),
        "skipped_steps": sum(o.get("skipped_steps", 0) for o in out),
        "steps_not_computed": sum(o.get("steps_not_computed", 0) for o in out),
        "caught_up": sum((o.get("live") or {}).get("caught_up", 0) for o in out),
        "kill_switch_at": cfg.kill_switch_at if kill else 0,
        "failover": lead.get("failover") or (lead.get("live") or {}).get("failover"),
        **killed,
        "workers": cfg.workers, "rate_bps": cfg.rate_bps, "loss_rate": cfg.loss_rate,
        "mtu": cfg.mtu, "params": lead["params"], "steps": cfg.steps, "batch": batch,
        "step_s": step_s, "samples_per_s": batch * cfg.workers / step_s,
        "final_loss": sum(lead["losses"][-5:]) / 5, "losses": lead["losses"],
        "times": times, "metric": work.metric, "evals": evals,
        "final_metric": evals[-1][2] if evals else None,
        "cpu_percent": _cpu_percent(out),
        **_machine_cpu(lead, step_s),
        **_bytes_and_trace(out),
        **({"replica_allreduce_s": sum(o["replica_allreduce_s_per_step"] for o in out)
            / len(out)} if "replica_allreduce_s_per_step" in lead else {}),
    }


def _replace_when_dead(tb: Testbed, cfg: TrainBenchConfig, dying: subprocess.Popen[str],
                       argv_of: Any, env_of: Any, replaced: dict[str, Any]
                       ) -> subprocess.Popen[str]:
    """Wait for the last rank to die (``kill_worker_at``), then ``replace_after_s``, and start
    its replacement; ``replaced`` gets the wall-clock times of both."""
    r = cfg.workers - 1
    try:
        _, err = dying.communicate(timeout=cfg.timeout_s)
    except subprocess.TimeoutExpired:
        dying.kill()
        raise TestbedError(f"rank {r} did not die at step {cfg.kill_worker_at}") from None
    if dying.returncode != 0:
        raise TestbedError(f"rank {r} failed before step {cfg.kill_worker_at} "
                           f"(exit {dying.returncode}): {(err or '').strip()[-600:]}")
    replaced["died_wall"] = time.time()
    time.sleep(cfg.replace_after_s)
    replaced["started_wall"] = time.time()
    return _start_workers(tb, [r], lambda _: argv_of(r, True), env_of)[0]


def _around_the_kill(cfg: TrainBenchConfig, times: list[float], on_gloo: list[bool]
                     ) -> dict[str, Any]:
    """The steps around the switch's death (training time, evaluation left out): the median
    step before, the worst stall after, the median step after that; with a way back, the
    steps that ended on gloo and the steps after the group went back to the switch."""
    durations = np.diff([0.0, *times])
    before, after = durations[2:cfg.kill_switch_at], durations[cfg.kill_switch_at:]
    worst = int(after.argmax())
    killed: dict[str, Any] = {
        "before_kill_step_s": float(np.median(before)) if before.size else None,
        "kill_stall_s": float(after[worst]),
        "after_kill_step_s": (float(np.median(after[worst + 1:]))
                              if worst + 1 < after.size else None)}
    if cfg.switch_back_after_s and on_gloo:
        gloo_steps = [s for s, g in enumerate(on_gloo) if g]
        last = gloo_steps[-1] if gloo_steps else None
        back = durations[last + 2:] if last is not None else np.array([])
        killed.update(steps_on_gloo=len(gloo_steps), back_at_step=(
            last + 1 if last is not None and last + 1 < len(on_gloo) else None),
            back_step_s=float(np.median(back)) if back.size else None)
    return killed


def _machine_cpu(lead: dict[str, Any], step_s: float) -> dict[str, float]:
    """The whole machine's busy CPU-seconds per step (``/proc/stat``: the ranks, the switch,
    the links' softirq) and ``machine_busy``, that over the machine's CPU-seconds per step:
    near 1, the step is as short as the machine's cores allow, whatever the wire does."""
    cpu = lead.get("machine_cpu_s_per_step")
    if cpu is None:
        return {}
    return {"machine_cpu_s_per_step": cpu, "machine_busy": cpu / ((os.cpu_count() or 1) * step_s)}


def _revive(tb: Testbed, cfg: TrainBenchConfig, box: dict[str, Any],
            stop: threading.Event) -> None:
    """Once the run killed the switch, start a new one at the same address
    ``cfg.switch_back_after_s`` later (unless the run ended first)."""
    while box["switch"].poll() is None:
        if stop.wait(0.05):
            return
    if not stop.wait(cfg.switch_back_after_s):
        box["switch"] = _start_switch(tb, nice=cfg.switch_nice)


def run_testbed_train(cfg: TrainBenchConfig, progress: Any = None) -> list[dict[str, Any]]:
    """Train every workload on every system over one testbed; return one row each, with the
    time to the target metric, the speedup against gloo and the ideal step time."""
    topo = _topology(cfg.workers, cfg.rate_bps, cfg.loss_rate, cfg.mtu)
    rows: list[dict[str, Any]] = []
    with Testbed(topo) as tb:
        switch = _start_switch(tb, nice=cfg.switch_nice)
        box = {"switch": switch}
        for model in cfg.models:
            for system in cfg.systems:
                if progress is not None:
                    progress(f"training {model} on {system}, n={cfg.workers}")
                retried: list[bool] = []
                switch = box["switch"]
                if switch.poll() is not None:  # killed by the run before (kill_switch_at)
                    switch = box["switch"] = _start_switch(tb, nice=cfg.switch_nice)
                stop = threading.Event()
                revive = threading.Thread(target=_revive, args=(tb, cfg, box, stop),
                                          daemon=True)
                if cfg.switch_back_after_s:
                    revive.start()
                row = once_more_if_torch_aborted(
                    functools.partial(_train_once, tb, cfg, model, system, switch.pid),
                    f"training {model} on {system}", functools.partial(retried.append, True))
                if retried:  # (the row says so, not only the log)
                    row["retried"] = "a process aborted in torch's C++ on the first try"
                stop.set()
                if revive.is_alive():
                    revive.join(60)
                rows.append(row)
        switch = box["switch"]
        assert switch.stdin is not None
        if switch.poll() is None:
            switch.stdin.close()
    add_time_to_target(rows)
    add_ideal(rows)
    return rows


def add_ideal(rows: list[dict[str, Any]]) -> None:
    """The ideal step time of every row, from measured quantities: C, the step with no
    communication (the ``noop`` row of the same workload), plus the part of the row's wire
    time that its measured overlap leaves exposed, ``(1 - hidden) x T``, where ``T`` is the
    bytes the row's links carried per step, each way, at the link rate. ``achieved_over_ideal``
    (ideal / measured step time) says how much is left on the table.

    With a ``lockstep`` row, the same again from its step (``ideal_lockstep_step_s``,
    ``achieved_over_lockstep_ideal``): the ranks of a synchronous system wait for the slowest
    one at every all-reduce, which ``noop``'s ranks never do; where ranks share cores (the
    testbed's), the slowest rank's step is above the mean's, and that difference is the
    machine's, not the communication's."""
    def step_of(model: str, system: str) -> float | None:
        return next((x["step_s"] for x in rows if x["model"] == model
                     and x["system"] == system), None)

    for r in rows:
        c, lock = step_of(r["model"], "noop"), step_of(r["model"], "lockstep")
        measured = r.get("bytes_per_step_measured")
        if r["system"] in SILENT or not measured or (c is None and lock is None):
            continue
        wire_s = measured / 2 * 8 / r["rate_bps"]  # sent + received: half each way
        exposed = (1 - (r.get("hidden_fraction") or 0.0)) * wire_s
        r["wire_s"] = wire_s
        if c is not None:
            r["compute_step_s"] = c
            r["ideal_step_s"] = c + exposed
            r["achieved_over_ideal"] = r["ideal_step_s"] / r["step_s"]
        if lock is not None:
            r["lockstep_step_s"] = lock
            r["ideal_lockstep_step_s"] = lock + exposed
            r["achieved_over_lockstep_ideal"] = r["ideal_lockstep_step_s"] / r["step_s"]


def _bytes_and_trace(out: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-worker bytes per step (measured on each worker's link, mean over workers, and
    predicted by the cost model), the hidden-communication fraction (mean over ranks) and the
    ranks' Chrome trace events."""
    row: dict[str, Any] = {}
    measured = [o["link_bytes_per_step"] for o in out if "link_bytes_per_step" in o]
    if measured:
        row["bytes_per_step_measured"] = sum(measured) / len(measured)
    if "predicted_bytes_per_step" in out[0]:
        pred = out[0]["predicted_bytes_per_step"]
        row["bytes_per_step_predicted"] = pred["wire"]
        row["bytes_per_step_predicted_payload"] = pred["payload"]
        row["decisions"] = pred["decisions"]
        if measured and pred["wire"]:
            row["measured_over_predicted"] = row["bytes_per_step_measured"] / pred["wire"]
    hidden = [o["hidden_fraction"] for o in out if o.get("hidden_fraction") is not None]
    if hidden:
        row["hidden_fraction"] = sum(hidden) / len(hidden)
    if any("events" in o for o in out):
        row["trace_events"] = [e for o in out for e in o.get("events", [])]
    return row


def write_trace(rows: list[dict[str, Any]], path: str) -> int:
    """Merge the rows' trace events into one Chrome trace: one process per (run, rank),
    named "model system rank r", timestamps from the earliest event. Returns the event count."""
    from switchml.torch.timeline import write_chrome_trace
    events: list[dict[str, Any]] = []
    for i, r in enumerate(rows):
        evs = r.get("trace_events") or []
        origin = min((e["ts"] for e in evs if e["ph"] == "X"), default=0.0)
        ranks = sorted({e["pid"] for e in evs})
        for e in evs:
            e = {**e, "pid": 100 * i + e["pid"]}
            if e["ph"] == "X":
                e["ts"] = round(e["ts"] - origin, 1)
            events.append(e)
        for rank in ranks:
            events.append({"ph": "M", "name": "process_name", "pid": 100 * i + rank, "tid": 0,
                           "args": {"name": f"{r['model']} {r['system']} rank {rank}"}})
    write_chrome_trace(path, events)
    return len(events)


def _smooth(xs: list[float], w: int = 5) -> list[float]:
    return [sum(xs[max(0, i - w + 1):i + 1]) / len(xs[max(0, i - w + 1):i + 1])
            for i in range(len(xs))]


def add_time_to_target(rows: list[dict[str, Any]]) -> None:
    """Per workload: the target metric is the worst final metric among the systems that
    aggregate (the level every one reached); each row's time to it is the training time at
    its first evaluation that reaches it. Likewise for the loss (5-step mean, + 5%). And each
    row's step-time speedup against gloo and against switchml."""
    from switchml import workloads
    for model in {r["model"] for r in rows}:
        group = [r for r in rows if r["model"] == model]
        trained = [r for r in group if r["system"] not in SILENT] or group
        target = 1.05 * max(_smooth(r["losses"])[-1] for r in trained)
        work = workloads.get(model)
        finals = [r["final_metric"] for r in trained if r.get("final_metric") is not None]
        metric_target = (min(finals) if work.higher_is_better else max(finals)) \
            if finals else None
        for r in group:
            sm = _smooth(r["losses"])
            hit = next((i for i, v in enumerate(sm) if v <= target), None)
            r["target_loss"] = target
            r["time_to_target_s"] = r["times"][hit] if hit is not None else None
            r["target_metric"] = metric_target
            r["time_to_metric_s"] = next(
                (t for _, t, v in r.get("evals") or [] if metric_target is not None
                 and work.better(v, metric_target)), None)
        gloo = next((r for r in group if r["system"] == "gloo"), None)
        sw = next((r for r in group if r["system"] == "switchml"), None)
        for r in group:
            r["speedup_step"] = gloo["step_s"] / r["step_s"] if gloo else None
            r["speedup_vs_switchml"] = sw["step_s"] / r["step_s"] if sw else None


def plot_training(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in rows:
            if r["model"] == model:
                ax.plot(r["times"], _smooth(r["losses"]), label=r.get("system", r["backend"]))
        ax.set_title(f"{model}: {rows[0]['workers']} workers, "
                     f"{rows[0]['rate_bps'] / 1e6:g} Mbit/s links")
        ax.set_xlabel("seconds since training start")
        ax.set_ylabel("training loss (rank 0, 5-step mean)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_bytes(rows: list[dict[str, Any]], path: str) -> None:
    """Bars per (model, system): bytes per worker per step (measured on the link, and as the
    cost model predicts) and step time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['model']}\n{r.get('system', r['backend'])}" for r in rows]
    xs = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(rows)), 4))
    a.bar([x - 0.2 for x in xs], [1e-6 * (r.get("bytes_per_step_measured") or 0) for r in rows],
          width=0.4, label="measured (link counters)")
    a.bar([x + 0.2 for x in xs], [1e-6 * (r.get("bytes_per_step_predicted") or 0) for r in rows],
          width=0.4, label="predicted (cost model + headers)")
    a.set_yscale("log")
    a.set_ylabel("MB per worker per step (sent + received)")
    a.legend()
    b.bar(list(xs), [1e3 * r["step_s"] for r in rows])
    b.set_ylabel("step time (ms)")
    for ax in (a, b):
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{rows[0]['workers']} workers, {rows[0]['rate_bps'] / 1e6:g} Mbit/s links")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_timeline(rows: list[dict[str, Any]], path: str, steps: int = 2) -> None:
    """Rank 0's last ``steps`` steps of every traced run, compute above communication."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    traced = [r for r in rows if r.get("trace_events")]
    if not traced:
        return
    colors = {"forward": "tab:blue", "backward": "tab:green", "optimizer": "tab:purple",
              "synchronize": "lightgray", "sfb rebuild": "tab:olive", "allreduce": "tab:red",
              "sfb all_gather": "tab:orange", "rows": "tab:pink"}
    fig, axes = plt.subplots(len(traced), 1, figsize=(12, 1.6 * len(traced) + 0.6),
                             squeeze=False)
    for ax, r in zip(axes[:, 0], traced):
        evs = [e for e in r["trace_events"] if e["ph"] == "X" and e["pid"] == 0]
        fwd = sorted(e["ts"] for e in evs if e["name"] == "forward")
        t0 = fwd[-steps] if len(fwd) >= steps else min(e["ts"] for e in evs)
        for e in evs:
            if e["ts"] + e["dur"] < t0:
                continue
            key = next((k for k in colors if e["name"].startswith(k)), None)
            y = 1 if e["tid"] == 0 else 0
            ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (y + 0.05, 0.9),
                           color=colors.get(key or "", "k"), label=key if key else None,
                           zorder=1 if key == "synchronize" else 2)
        ax.set_yticks([0.5, 1.5])
        ax.set_yticklabels(["comm", "compute"])
        hidden = r.get("hidden_fraction")
        ax.set_title(f"{r['model']} {r.get('system', r['backend'])}, rank 0"
                     + (f": {hidden:.0%} of communication hidden" if hidden is not None else ""),
                     fontsize=9)
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper left",
                  bbox_to_anchor=(1.01, 1.0))
    axes[-1, 0].set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
