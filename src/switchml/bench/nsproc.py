"""Process bodies for testbed benchmarks, started inside namespaces as
``python -m switchml.bench.nsproc ROLE JSON``. Each prints one JSON line with its figures.

Roles: ``switch`` and ``rack`` (built by ``service.build_server``, as ``switchml switch``
builds one; they print the command's listening line, ``control.announce``, serve until stdin
closes, then print their counters and CPU), ``switchml`` / ``gloo`` / ``ps`` (a worker:
warm-up, then timed all-reduces), and ``ps-server`` (a TensorFlow-style parameter server:
workers push their vector over TCP, it sums and every worker pulls the sum).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import signal
import socket
import sys
import time
from typing import Any

import numpy as np

from switchml import env
from switchml.bench.cpu import machine_busy_s, sample_processes


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _emit(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


def _timed(allreduce: Any, x: Any, warmup: int, iters: int, watch: int | None = None
           ) -> dict[str, Any]:
    """Time ``iters`` calls after ``warmup``: elapsed, this process's CPU, and the whole
    machine's busy seconds at the start and end (``busy``: the runner takes the span of all
    workers); with ``watch`` (the switch's pid), that process's CPU at the start and end too
    (``watched``: ``bench.cpu.sample_processes``, for ``span_cpu_percent``)."""
    for _ in range(warmup):
        allreduce(x)
    w0 = sample_processes([watch]) if watch else None
    b0, c0, t0 = machine_busy_s(), _cpu(), time.perf_counter()
    for _ in range(iters):
        allreduce(x)
    elapsed = time.perf_counter() - t0
    out = {"elapsed_s": elapsed, "cpu_s": _cpu() - c0, "busy": [b0, machine_busy_s()]}
    w1 = sample_processes([watch]) if w0 is not None else None
    if w0 is not None and w1 is not None:
        out["watched"] = w0 + w1
    return out


def init_group(backend: str, master: str, port: int, rank: int, world: int,
               timeout_s: float, store_file: str | None = None) -> None:
    """Join the torch.distributed process group that ``master:port`` rendezvouses, or, with
    ``store_file``, a file that every rank sees (a FileStore: no TCP store to connect to)."""
    import datetime

    import torch.distributed as dist
    init = f"file://{store_file}" if store_file else f"tcp://{master}:{port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _switch_spec(a: dict[str, Any]) -> Any:
    """The ``switchml switch`` options of a testbed switch: every address of its namespace (no
    secret: the testbed's namespaces are its own), no metrics endpoint."""
    from switchml.service import SwitchSpec
    return SwitchSpec(host="0.0.0.0", port=a["port"], nack_gap=a.get("nack_gap", 4),
                      batching=env.batching(), insecure=True, metrics_port=0)


def switch(a: dict[str, Any]) -> None:
    """A switch, built as ``switchml switch`` builds one (``service.build_server``), that
    announces itself with the command's listening line and serves until stdin closes."""
    from switchml.control.announce import announce
    from switchml.service import build_server
    if a.get("nice"):  # before any thread starts: every thread inherits it
        os.nice(a["nice"])
    secret = bytes.fromhex(a["secret"]) if a.get("secret") else None  # (authenticated jobs)
    server = build_server(_switch_spec(a), secret=secret)
    server.start()
    c0 = _cpu()
    announce(server.address)
    sys.stdin.read()
    stats = server.stats()
    server.stop()
    _emit({"cpu_s": _cpu() - c0, "drops": stats["drops"], "nacks_sent": stats["nacks_sent"],
           "nacks_needless": stats["nacks_needless"],
           "results_resent": stats["results_resent"], "packets_in": stats["packets_in"],
           "packets_out": stats["packets_out"], "recv_calls": stats["recv_calls"],
           "send_calls": stats["send_calls"]})


def rack(a: dict[str, Any]) -> None:
    """A rack switch of a hierarchical job (``switchml switch --upstream``) for one job."""
    from switchml.control import decode_job_spec
    from switchml.control.announce import announce
    from switchml.protocol.tree import RackAggregator, tree_specs
    from switchml.service import build_server
    parent, child = tree_specs(decode_job_spec(a["spec"]), a["racks"])
    agg = RackAggregator(parent_spec=parent, child_spec=child, rack=a["rack"],
                         parent_address=(a["upstream"], a["upstream_port"]))
    server = build_server(_switch_spec(a), secret=None, rack=agg)
    server.start()
    server.run_command(agg.join)
    c0 = _cpu()
    announce(server.address)
    sys.stdin.read()
    stats = server.stats()
    server.stop()
    _emit({"cpu_s": _cpu() - c0, "tree": stats.get("tree", {}), "error": agg.error})


def switchml(a: dict[str, Any]) -> None:
    from switchml.control import decode_job_spec
    from switchml.protocol.config import WorkerConfig
    from switchml.protocol.worker import RECOVERY_COUNTERS
    from switchml.transport.parallel import open_worker
    spec = decode_job_spec(a["spec"])
    offset = a.get("offset", 0)  # per job, where jobs share the switch: a mix-up shows
    x = np.full(a["numel"], a["rank"] + 1.0 + offset, dtype=np.float32)
    out = np.empty_like(x)
    cfg = WorkerConfig(op_timeout_s=60.0, fast_retransmit=a.get("fast_retransmit", False),
                       secret=bytes.fromhex(a["secret"]) if a.get("secret") else None)
    with open_worker((a["switch"], a["port"]), spec, a["rank"], cfg,
                     threads=a.get("threads", 1), batching=env.batching()) as w:
        bits = a.get("bits", 32)
        # the 16-bit DDP hook's error feedback: a float32 residual per bucket
        res = np.zeros(x.size, np.float32) if a.get("residual") else None
        r = _timed(lambda v: w.allreduce(v, out, bits=bits, residual=res), x, a["warmup"],
                   a["iters"], a.get("switch_pid"))
        n = spec.num_workers
        # (a tree's racks repeat the local ranks: it says what to expect)
        expect = a.get("expect", n * (n + 1) / 2 + n * offset)
        r["max_abs_error"] = float(np.max(np.abs(out - expect)))
        r["retransmissions"] = w.counters.get("retransmissions", 0)
        c = w.counters
        r["fast_retransmissions"] = c.get("fast_retransmissions", 0)
        r["system_calls"] = {k: c.get(k, 0) for k in ("packets_sent", "results_received",
                                                       "send_calls", "recv_calls")}
        r["recovery"] = {k: c.get(k, 0) for k in RECOVERY_COUNTERS}
    _emit(r)


def gloo(a: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    init_group("gloo", a["master"], a["port"], a["rank"], a["n"], 300, a.get("store_file"))
    x = torch.full((a["numel"],), float(a["rank"] + 1),
                   dtype=getattr(torch, a.get("dtype", "float32")))
    r = _timed(lambda v: dist.all_reduce(v), x, a["warmup"], a["iters"])
    dist.destroy_process_group()
    _emit(r)


def switchml_torch(a: dict[str, Any]) -> None:
    """``dist.all_reduce`` of a ``dtype`` tensor on a "switchml" group (the switch from
    ``SWITCHML_SWITCH``), as a training job issues it: the backend stages the tensor and picks
    the wire width. Reports the worker's counters and the result's error: every rank starts
    from rank + 1 and all-reduces in place, as gloo's role does, so after k operations every
    element is ``n (n + 1) / 2 * n**(k - 1)``, exact in each of the types while it fits."""
    import torch
    import torch.distributed as dist

    import switchml.torch as stt
    torch.set_num_threads(1)
    init_group("switchml", a["master"], a["port"], a["rank"], a["n"], 300, a.get("store_file"))
    x = torch.full((a["numel"],), float(a["rank"] + 1), dtype=getattr(torch, a["dtype"]))
    r = _timed(lambda v: dist.all_reduce(v), x, a["warmup"], a["iters"], a.get("switch_pid"))
    n = a["n"]
    expect = n * (n + 1) / 2 * n ** (a["warmup"] + a["iters"] - 1)
    r["max_abs_error"] = float((x.double() - expect).abs().max())
    group = dist.distributed_c10d._get_default_group()
    r["wire_bits"] = group.wire_bits(x.dtype)
    c = stt.stats()["worker"]
    r["retransmissions"] = c.get("retransmissions", 0)
    r["payload_bytes_sent"] = c.get("payload_bytes_sent", 0)
    r["system_calls"] = {k: c.get(k, 0) for k in ("packets_sent", "results_received",
                                                   "send_calls", "recv_calls")}
    dist.destroy_process_group()
    _emit(r)


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def ps_server(a: dict[str, Any]) -> None:
    """A parameter server (switchml.ps, optimizer ``sum``): each step sums one vector from
    each of n workers; every worker pulls the sum."""
    from switchml.ps.allreduce import sum_server
    # The baseline of the aggregation design, inside the testbed's own namespaces: plain TCP
    # (the links' TLS cost was measured on its own: docs/decisions/0011-ps-tls-cost.md).
    server = sum_server(port=a["port"], workers=a["n"], insecure=True)
    print("ready", flush=True)
    c0 = _cpu()
    server.wait_finished(24 * 3600.0)
    server.stop()
    _emit({"cpu_s": _cpu() - c0, "bytes_per_round": a["numel"] * 4,
           "steps_applied": server.counters["steps_applied"]})


def ps(a: dict[str, Any]) -> None:
    """A worker of the parameter-server baseline (switchml.ps.allreduce)."""
    from switchml.ps.allreduce import PSAllreduce
    x = np.full(a["numel"], a["rank"] + 1.0, dtype=np.float32)
    out = np.empty_like(x)
    ar = PSAllreduce([(a["server"], a["port"])], worker=a["rank"], numel=a["numel"])
    _emit(_timed(lambda v: ar(v, out), x, a["warmup"], a["iters"]))
    ar.close()


def floor_hub(a: dict[str, Any]) -> None:
    """The floor's hub (``bench/floor.py``): echoes until stdin closes."""
    from switchml.bench.floor import hub
    c0 = _cpu()
    echoed = hub(a["port"])
    _emit({"cpu_s": _cpu() - c0, "bytes_echoed": echoed})


def floor(a: dict[str, Any]) -> None:
    """A worker of the floor: each "operation" moves the all-reduce's bytes through the hub
    and back in switchml-sized datagrams (``bench/floor.py``)."""
    from switchml.bench.floor import worker
    timeouts = []

    def move(_: Any) -> None:
        timeouts.append(worker((a["hub"], a["port"]), a["numel"] * 4,
                               datagram_bytes=a["datagram_bytes"],
                               window_bytes=a["window_bytes"])["timeouts"])
    r = _timed(move, None, a["warmup"], a["iters"])
    r["timeouts"] = sum(timeouts)
    _emit(r)


ROLES = {"rack": rack, "switch": switch, "switchml": switchml, "gloo": gloo,
         "switchml-torch": switchml_torch, "ps-server": ps_server,
         "ps": ps, "floor-hub": floor_hub, "floor": floor}


def _steps(a: dict[str, Any], ddp: Any, opt: Any, task: Any, model: Any,
           recorder: Any, live: Any = None, start: int = 0) -> dict[str, Any]:
    """The training steps: losses, training time at each step (evaluation excluded), the
    metric every ``eval_every`` steps and at the end, and where the measured second half
    (after warm-up and bucket rebuilding) starts in time and in link bytes, and the whole
    machine's busy CPU-seconds over that half (``machine_busy_s``; None without /proc/stat),
    less what the machine spent while this rank evaluated (the ranks evaluate at the same
    steps; time another rank spent evaluating outside this rank's window stays counted).
    ``live`` (``switchml-live``): the replica's ``LiveQuorum``, which serves a replacement the
    state after every step, takes the sums of a step the others are past without computing
    (``skip_step``, with ``skip_behind``) and, with ``catch_up_steps``, a live
    rank's state when that far behind; ``start``: the first step (a replacement's, from that
    state); the rank exits abruptly as step ``die_at`` begins."""
    from switchml.bench import hybridtrain
    dev = a.get("dev")
    losses, times, evals, walls, mine = [], [], [], [], []
    t0 = time.perf_counter()
    c0 = _cpu()
    paused = 0.0  # seconds spent evaluating, left out of the training time
    half = a["steps"] // 2
    half_s, bytes_half, busy_evals = t0, 0, 0.0
    busy_half: float | None = None
    every = a.get("eval_every") or 0
    straggler = _straggler(a)
    straggled = 0
    on_gloo: list[bool] = []
    step, skipped, no_compute = start - 1, 0, 0
    while step + 1 < a["steps"]:
        step += 1
        if step == a.get("die_at"):
            os._exit(0)  # a worker dies (no LEAVE, nothing flushed)
        if step == half:
            half_s, bytes_half = time.perf_counter(), hybridtrain.link_bytes(dev) if dev else 0
            busy_half = machine_busy_s() or None  # (0.0: no /proc/stat)
        if step == a.get("kill_switch_at"):
            os.kill(a["kill_switch_pid"], signal.SIGKILL)  # the switch dies, not restarted
        timed: tuple[float, ...] | None = None
        if live is not None and a.get("skip_behind", True) and live.skip_step():
            opt.step()  # the others are past this step: its sums, without computing
            losses.append(float("nan"))
            end, no_compute = time.perf_counter(), no_compute + 1
        else:
            if straggler(step) == a["rank"]:
                time.sleep(a["straggle_s"])  # slower compute on this rank at this step
                straggled += 1
            loss, timed = task.timed_step(ddp, opt, step)
            losses.append(loss.item())
            end = timed[3]
        if a.get("track_failover"):  # whether the step's all-reduces ended on gloo
            from switchml.torch import stats as switchml_stats
            fo = (live.stats() if live is not None else switchml_stats()).get("failover")
            on_gloo.append(bool((fo or {}).get("active")))
        times.append(end - t0 - paused)
        walls.append(time.time())
        if live is not None:
            c = live.client.counters  # (whether this step's sums held this rank's data)
            mine.append(c.get("results_received", 0) - c.get("results_left_out", 0))
            live.serve(lambda step=step: {"model": model.state_dict(), "opt": opt.state_dict(),
                                          "step": step + 1})
            caught = (live.catch_up(a["catch_up_steps"]) if a.get("catch_up_steps")
                      else None)
            if caught is not None:  # a straggler skips to a live rank's state and step
                model.load_state_dict(caught["model"])
                opt.load_state_dict(caught["opt"])
                skipped += caught["step"] - step - 1
                step = caught["step"] - 1
        if recorder is not None and timed is not None:
            f0, b0, o0, _ = timed
            recorder.forward(f0, b0)
            recorder.backward_done(b0, o0)
            recorder.optimizer(o0, end)
        if every and ((step + 1) % every == 0 or step + 1 == a["steps"]):
            e0, u0 = time.perf_counter(), machine_busy_s()
            model.eval()
            evals.append((step + 1, times[-1], task.evaluate(model)))
            model.train()
            paused += time.perf_counter() - e0
            if step >= half:
                busy_evals += machine_busy_s() - u0
    elapsed, busy_end = time.perf_counter() - t0, machine_busy_s()
    return {"losses": losses, "times": times, "walls": walls, "mine": mine, "evals": evals,
            "elapsed_s": elapsed,
            "train_s": elapsed - paused, "c0": c0, "half": half, "half_s": half_s,
            "bytes_half": bytes_half, "straggled_steps": straggled, "on_gloo": on_gloo,
            "skipped_steps": skipped, "steps_not_computed": no_compute,
            "machine_busy_s": None if busy_half is None else busy_end - busy_half - busy_evals}


def _straggler(a: dict[str, Any]) -> Any:
    """``step -> the rank that straggles at it`` (-1: none): with ``straggle_s`` > 0, the
    last rank at every step (``straggle_every`` 0), or at one step in ``straggle_every`` on
    average a rank drawn at random, the same draw on every rank (a seeded generator)."""
    import random
    n, every = a["n"], a.get("straggle_every", 0)
    if not a.get("straggle_s"):
        return lambda step: -1
    if not every:
        return lambda step: n - 1
    rng = random.Random(12345)
    draws = [rng.randrange(n) if rng.random() < 1 / every else -1 for _ in range(a["steps"])]
    return draws.__getitem__


def _hsdp(model: Any, n: int, shard: int, replica: dict[str, Any]) -> Any:
    """``model`` under FSDP2 on a 2-D mesh (replicate x shard): HSDP. Every all-reduce FSDP
    makes on the replicate dimension is timed into ``replica["calls"]`` as (start, seconds)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if n % shard:
        raise ValueError(f"{n} workers do not split into shards of {shard}")
    mesh = init_device_mesh("cpu", (n // shard, shard), mesh_dim_names=("replicate", "shard"))
    group = mesh.get_group("replicate")
    calls: list[tuple[float, float]] = []
    replica["calls"] = calls
    inner = dist.all_reduce

    def timed(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("group") is not group:
            return inner(tensor, *args, **kwargs)
        t0 = time.perf_counter()
        work = inner(tensor, *args, **kwargs)
        if work is not None:
            work.wait()
        calls.append((t0, time.perf_counter() - t0))
        return work

    dist.all_reduce = timed  # FSDP2 calls dist.all_reduce through the module
    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _live(a: dict[str, Any]) -> Any:
    """``switchml-live``: this replica's own one-process gloo group, and its part in the quorum
    job replicas join while it runs (``switchml.torch.live``; its store a file every namespace
    sees, as the other systems' process groups use)."""
    import datetime

    import torch.distributed as dist

    from switchml.torch.live import LiveQuorum
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    store = dist.FileStore(f"{a['store_file']}-live", -1)
    store.set_timeout(datetime.timedelta(seconds=a.get("timeout_s", 120)))
    return LiveQuorum(store, a["rank"], a["n"], a["quorum"],
                      replacement=bool(a.get("replacement")), timeout_s=a.get("timeout_s", 120),
                      window=a.get("window"), elements_per_packet=a.get("k"),
                      state_secret=bytes.fromhex(a["state_secret"]),
                      failover=a.get("failover", "off"))


def train(a: dict[str, Any]) -> None:
    """DDP (or, with ``mode`` "hybrid", HybridDataParallel) training of one workload
    (``switchml.workloads``) on one backend, with ``hook`` (a DDP communication hook by name:
    ``switchml16``, ``noop``) if given; every rank reports per-step losses and training times,
    the workload's metric every ``eval_every`` steps, the bytes its link carried per step
    (second half; ``dev`` names the link), the cost model's prediction and, with ``trace``, its
    timeline; the fraction of communication hidden behind backward compute always."""
    import torch
    import torch.distributed as dist

    from switchml import workloads
    from switchml.bench import hybridtrain
    from switchml.torch.timeline import Timeline
    torch.set_num_threads(1)
    if a["backend"] == "switchml":
        import switchml.torch  # noqa: F401
    rank, n = a["rank"], a["n"]
    live = _live(a) if a["backend"] == "switchml-live" else None
    if live is None and a["backend"] != "torchft":
        init_group(a["backend"], a["master"], a["port"], rank, n, a.get("timeout_s", 120),
                   a.get("store_file"))
    work = workloads.get(a["model"])
    torch.manual_seed(0)
    task = work.build(a.get("batch"), seed=1000 + rank)
    model = task.model
    if a["backend"] == "torchft":  # (its own loop: steps are committed, or retried)
        from switchml.bench import train_torchft
        c0 = _cpu()
        _emit({**train_torchft.train(a, task, model, work), "cpu_s": _cpu() - c0})
        return
    mode = a.get("mode", "ddp")
    replica: dict[str, Any] = {}
    if mode == "hsdp":
        ddp, recorder = _hsdp(model, n, a.get("shard", 2), replica), None
    elif live is not None:  # DDP over this replica's own group, averaged through the job
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model)
        live.register(ddp)
        recorder = hybridtrain.StepRecorder(model, Timeline())
    else:
        timeline = Timeline()
        ddp = hybridtrain.wrap(model, mode, timeline, hook=a.get("hook"))
        recorder = hybridtrain.StepRecorder(model, timeline)
    if a.get("lr"):
        work = dataclasses.replace(work, lr=a["lr"])
    opt = work.optimizer(ddp.parameters())
    start = 0
    if live is not None and live.state is not None:  # a replacement: the live state
        model.load_state_dict(live.state["model"])
        opt.load_state_dict(live.state["opt"])
        start = live.state["step"]
        x, y = task.batch_of(start)
        live.warm_up(lambda: task.loss_fn(ddp(x), y))
    dist.barrier()
    run = _steps(a, ddp, opt, task, model, recorder, live, start)
    extra = _train_report(a, ddp, model, run, recorder, replica)
    if live is not None:
        extra.update(live=live.stats(), start_step=start, walls=run["walls"], mine=run["mine"],
                     params_digest=hashlib.sha256(b"".join(
                         p.detach().numpy().tobytes() for p in model.parameters())).hexdigest())
        live.close()
    dist.destroy_process_group()
    _emit({"losses": run["losses"], "times": run["times"], "evals": run["evals"],
           "elapsed_s": run["elapsed_s"], "train_s": run["train_s"],
           "straggled_steps": run["straggled_steps"], "on_gloo": run["on_gloo"],
           "skipped_steps": run["skipped_steps"],
           "steps_not_computed": run["steps_not_computed"],
           "cpu_s": _cpu() - run["c0"], **extra})


def _train_report(a: dict[str, Any], ddp: Any, model: Any, run: dict[str, Any],
                  recorder: Any, replica: dict[str, Any]) -> dict[str, Any]:
    """What :func:`train` reports beside its losses and times, measured over the run's second
    half: the parameters, the bytes predicted and carried per step, the machine's CPU per
    step, the recorder's timeline summary, HSDP's replica all-reduces and the failover."""
    from switchml.bench import hybridtrain
    mode, steps = a.get("mode", "ddp"), a["steps"] - run["half"]
    params = sum(p.numel() for p in model.parameters())
    if mode == "hsdp":  # (full sizes: the parameters are shards)
        params = sum(p.full_tensor().numel() if hasattr(p, "full_tensor") else p.numel()
                     for p in model.parameters())
    extra: dict[str, Any] = {"mode": mode, "params": params}
    if mode != "hsdp":
        extra["predicted_bytes_per_step"] = hybridtrain.predicted_bytes(
            ddp, model, world=a["n"], mtu=a.get("mtu", 1500), hook=a.get("hook"))
    if a.get("dev"):
        extra["link_bytes_per_step"] = (hybridtrain.link_bytes(a["dev"])
                                        - run["bytes_half"]) / steps
    if run["machine_busy_s"] is not None:  # (the whole machine: every rank sees the same)
        extra["machine_cpu_s_per_step"] = run["machine_busy_s"] / steps
    if recorder is not None:
        summary = recorder.summary(since_s=run["half_s"], rank=a["rank"])
        if not a.get("trace"):
            summary.pop("events")
        extra.update(summary)
    if replica:
        spans = [d for t, d in replica["calls"] if t >= run["half_s"]]
        extra["replica_allreduce_s_per_step"] = sum(spans) / steps
        extra["replica_allreduce_calls"] = len(spans)
    if a["backend"] == "switchml":
        from switchml.torch import stats as switchml_stats
        extra["failover"] = switchml_stats().get("failover")
    return extra  # (switchml-live's failover: in ``live``, its stats)


ROLES["train"] = train


if __name__ == "__main__":
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))
