"""``switchml demo``: train the same model with gloo and with switchml, side by side.

N worker processes (default 4) on this machine train a small convolutional network on
scikit-learn's handwritten digits (1797 real 8x8 images shipped with the package) with
DistributedDataParallel: once on the gloo backend, once on the "switchml" backend (an embedded
software switch, no set-up, no root). The script is the same for both; only the backend string
differs. Prints a table (step time, samples/s, final loss, test accuracy) and saves a PNG of the
loss curves and a JSON of every figure.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["DemoConfig", "RunResult", "run_demo"]


WARMUP_STEPS = 3
"""Steps left out of the mean step time (when there are more than twice as many)."""


@dataclass(frozen=True)
class DemoConfig:
    workers: int = 4
    epochs: int = 8
    batch_size: int = 32
    """Per worker."""
    lr: float = 0.05
    seed: int = 0
    backends: tuple[str, ...] = ("gloo", "switchml")
    out_dir: str = "switchml-demo"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.workers < 1 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError("DemoConfig.workers, DemoConfig.epochs and DemoConfig.batch_size "
                             "must be >= 1")
        unknown = set(self.backends) - {"gloo", "switchml"}
        if unknown:
            raise ValueError(f"unknown backend(s) {sorted(unknown)}; known: gloo, switchml")


@dataclass
class RunResult:
    backend: str
    workers: int
    steps: int
    mean_step_s: float
    samples_per_s: float
    final_loss: float
    test_accuracy: float
    wall_s: float
    losses: list[float] = field(default_factory=list)  # mean over ranks, per step
    times: list[float] = field(default_factory=list)  # seconds since training start, per step
    backend_stats: dict[str, Any] = field(default_factory=dict)


def _train_worker(rank: int, cfg: DemoConfig, backend: str, port: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from switchml.workloads import cnn_model, digits_split
    try:
        torch.set_num_threads(1)
        if backend == "switchml":
            import switchml.torch  # noqa: F401  registers the backend
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=cfg.workers,
                                timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(cfg.seed)
        model = DDP(cnn_model())
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
        x_tr, y_tr, x_te, y_te = digits_split(cfg.seed)
        loss_fn = torch.nn.CrossEntropyLoss()
        shard = torch.arange(rank, len(y_tr), cfg.workers)
        steps_per_epoch = len(shard) // cfg.batch_size
        losses, times, step_times = [], [], []
        dist.barrier()
        start = time.perf_counter()
        for epoch in range(cfg.epochs):
            order = shard[torch.randperm(len(shard),
                                         generator=torch.Generator().manual_seed(epoch))]
            for s in range(steps_per_epoch):
                idx = order[s * cfg.batch_size:(s + 1) * cfg.batch_size]
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(x_tr[idx]), y_tr[idx])
                loss.backward()
                opt.step()
                step_times.append(time.perf_counter() - t0)
                mean_loss = loss.detach().clone()
                dist.all_reduce(mean_loss, op=dist.ReduceOp.SUM)
                losses.append(mean_loss.item() / cfg.workers)
                times.append(time.perf_counter() - start)
                if rank == 0:
                    queue.put(("progress", backend, len(losses),
                               cfg.epochs * steps_per_epoch, losses[-1]))
        wall = time.perf_counter() - start
        with torch.no_grad():
            acc = (model.module(x_te).argmax(1) == y_te).float().mean().item()
        stats: dict[str, Any] = {}
        if backend == "switchml":
            import switchml.torch as smt
            stats = smt.stats()
        steps = len(step_times)
        # The first steps build DDP's buckets, fill caches and (switchml) open the job: the
        # mean is over the steps after them.
        timed = step_times[WARMUP_STEPS:] if steps > 2 * WARMUP_STEPS else step_times
        mean_step = sum(timed) / len(timed)
        result = RunResult(backend, cfg.workers, steps, mean_step,
                           cfg.batch_size * cfg.workers / mean_step, losses[-1], acc, wall,
                           losses, times, stats)
        dist.destroy_process_group()
        queue.put(("done", rank, result, None))
    except BaseException as exc:  # report instead of hanging the parent
        queue.put(("done", rank, None, f"{type(exc).__name__}: {exc}"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_backend(cfg: DemoConfig, backend: str, on_progress: Any) -> RunResult:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_train_worker, args=(r, cfg, backend, port, queue))
             for r in range(cfg.workers)]
    for p in procs:
        p.start()
    results: dict[int, RunResult] = {}
    deadline = time.monotonic() + cfg.timeout_s
    try:
        while len(results) < cfg.workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{backend} training did not finish in {cfg.timeout_s:g} s")
            try:
                msg = queue.get(timeout=1.0)
            except Exception:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a {backend} worker died with exit code {dead[0]}") \
                        from None
                continue
            if msg[0] == "progress":
                on_progress(*msg[1:])
            else:
                _, rank, result, error = msg
                if error:
                    raise RuntimeError(f"{backend} rank {rank} failed: {error}")
                results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results[0]


def run_demo(cfg: DemoConfig, on_progress: Any = None) -> list[RunResult]:
    """Train once per backend; write JSON and PNG into ``cfg.out_dir``; return the results."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    progress = on_progress or (lambda *a: None)
    results = [_run_backend(cfg, b, progress) for b in cfg.backends]
    with open(os.path.join(cfg.out_dir, "demo.json"), "w") as f:
        json.dump({"config": asdict(cfg), "results": [asdict(r) for r in results]}, f, indent=2)
    plot_losses(results, os.path.join(cfg.out_dir, "loss.png"))
    return results


def plot_losses(results: list[RunResult], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        ax1.plot(range(1, len(r.losses) + 1), r.losses, label=r.backend)
        ax2.plot(r.times, r.losses, label=r.backend)
    ax1.set_xlabel("step")
    ax2.set_xlabel("seconds since training start")
    for ax in (ax1, ax2):
        ax.set_ylabel("training loss (mean over workers)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"DDP on digits, {results[0].workers} workers: gloo vs switchml")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
