"""Start P parameter servers and N workers on this machine and train a model on digits.

This is what ``switchml ps train`` runs: one process per server and per worker (or, with
``in_process=True``, threads in this process: same code, used by the tests). The parent
watches every child: one that dies makes the run fail with an error naming it, within
``timeout_s``; the survivors are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from switchml.links import LinkSecurity
from switchml.protocol.errors import ConfigError
from switchml.ps.server import ParameterServer, ServerConfig
from switchml.ps.wire import PSError

__all__ = ["PSRunConfig", "build", "run_ps_training", "train_worker"]


@dataclass(frozen=True)
class PSRunConfig:
    servers: int = 2
    workers: int = 4
    backup: int = 0
    """Backup workers: each step takes the first ``workers - backup`` gradients."""
    mode: str = "sync"
    steps: int = 200
    batch: int = 32
    """Per worker."""
    lr: float = 0.05
    momentum: float = 0.9
    optimizer: str = "sgd"
    seed: int = 0
    model: str = "mlp"
    """``mlp`` (64-256-10, 19k parameters) or ``cnn`` (``workloads.cnn_model``, 560k)."""
    max_shard_elements: int = 1 << 17
    slow_worker: int | None = None
    """A worker that sleeps ``slow_s`` every step (a straggler, to see backup workers act)."""
    slow_s: float = 0.0
    in_process: bool = False
    timeout_s: float = 60.0
    host: str = "127.0.0.1"
    tls_dir: str | None = None
    """Mutual TLS on every server link, with the credentials in this directory (links.py)."""

    def security(self) -> LinkSecurity | None:
        return LinkSecurity.from_dir(self.tls_dir) if self.tls_dir else None

    def __post_init__(self) -> None:
        ServerConfig(self.workers, self.backup, self.mode, self.optimizer, self.lr,
                     self.momentum, self.timeout_s)  # validates
        if self.servers < 1 or self.steps < 1 or self.batch < 1:
            raise ConfigError("PSRunConfig.servers, PSRunConfig.steps and PSRunConfig.batch "
                              "must be >= 1")
        if self.model not in ("mlp", "cnn"):
            raise ConfigError(f"unknown model {self.model!r}; known: mlp, cnn")
        if self.slow_worker is not None and not 0 <= self.slow_worker < self.workers:
            raise ConfigError(f"PSRunConfig.slow_worker must be in 0..{self.workers - 1}")

    def server_config(self) -> ServerConfig:
        return ServerConfig(self.workers, self.backup, self.mode, self.optimizer, self.lr,
                            self.momentum, self.timeout_s)


def build(cfg: PSRunConfig) -> Any:
    """The run's model, initialised from ``cfg.seed`` (torch's global generator)."""
    import torch

    from switchml.workloads import cnn_model, mlp_model
    torch.manual_seed(cfg.seed)
    return mlp_model((256,)) if cfg.model == "mlp" else cnn_model()


def train_worker(cfg: PSRunConfig, rank: int, servers: list[tuple[str, int]],
                 model: Any = None) -> dict[str, Any]:
    """One worker's whole run; returns its figures (rank 0 adds test accuracy and digest).
    ``model``: built by the caller (threads share torch's global generator, so a model built
    inside one would depend on the others' timing); default :func:`build`."""
    import torch
    from torch import nn

    from switchml.ps.trainer import PSTrainer, model_digest
    from switchml.workloads import digits_split
    if model is None:
        model = build(cfg)
    xtr, ytr, xte, yte = digits_split(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    trainer = PSTrainer(model, servers=servers, worker=rank, workers=cfg.workers, mode=cfg.mode,
                        max_shard_elements=cfg.max_shard_elements, timeout_s=cfg.timeout_s,
                        print_placement=False,  # the launcher prints it
                        security=cfg.security())
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    t0 = time.perf_counter()
    while not trainer.done(cfg.steps):
        idx = torch.randint(0, len(ytr), (cfg.batch,), generator=gen)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(xtr[idx]), ytr[idx])
        loss.backward()
        if rank == cfg.slow_worker:
            time.sleep(cfg.slow_s)
        trainer.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - t0
    out: dict[str, Any] = {"rank": rank, "iterations": trainer.iterations,
                           "version": trainer.step_count, "elapsed_s": elapsed,
                           "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
                           "bytes_sent": trainer.client.bytes_sent,
                           "bytes_received": trainer.client.bytes_received}
    if rank == 0:
        with torch.no_grad():
            out["test_accuracy"] = float((model(xte).argmax(1) == yte).float().mean())
        out["digest"] = model_digest(model)
        from switchml.ps.placement import format_placement
        out["placement"] = format_placement(trainer.shards, len(servers))
    trainer.close()
    return out


def _server_proc(index: int, cfg: PSRunConfig, q: Any) -> None:
    try:
        ps = ParameterServer(index, cfg.server_config(), host=cfg.host,
                             security=cfg.security()).start()
        q.put(("address", index, ps.address))
        ps.wait_finished(cfg.timeout_s * 10)
        q.put(("server", index, ps.stats()))
        ps.stop()
    except BaseException as exc:
        q.put(("error", f"parameter server ps{index}", f"{type(exc).__name__}: {exc}"))


def _worker_proc(rank: int, cfg: PSRunConfig, servers: list[tuple[str, int]], q: Any) -> None:
    try:
        import torch
        torch.set_num_threads(1)
        q.put(("worker", rank, train_worker(cfg, rank, servers)))
    except BaseException as exc:
        q.put(("error", f"worker {rank}", f"{type(exc).__name__}: {exc}"))


def run_ps_training(cfg: PSRunConfig, progress: Any = None) -> dict[str, Any]:
    """Run the servers and workers; return ``{"config", "workers", "servers",
    "dropped_late", ...}``. Raises PSError naming a failed or dead server or worker."""
    if cfg.in_process:
        return _run_threads(cfg)
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    procs: dict[str, Any] = {}
    for i in range(cfg.servers):
        procs[f"parameter server ps{i}"] = ctx.Process(target=_server_proc, args=(i, cfg, q))
        procs[f"parameter server ps{i}"].start()
    addresses: dict[int, tuple[str, int]] = {}
    workers: dict[int, dict[str, Any]] = {}
    servers: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + cfg.timeout_s
        while len(addresses) < cfg.servers:
            kind, who, what = _get(q, procs, deadline, cfg.timeout_s)
            addresses[who] = what
        servers_list = [addresses[i] for i in range(cfg.servers)]
        for r in range(cfg.workers):
            procs[f"worker {r}"] = ctx.Process(target=_worker_proc,
                                               args=(r, cfg, servers_list, q))
            procs[f"worker {r}"].start()
        if progress is not None:
            progress(f"{cfg.servers} servers at {servers_list}, {cfg.workers} workers started")
        deadline = time.monotonic() + cfg.timeout_s * max(1.0, cfg.steps / 50)
        while len(workers) < cfg.workers or len(servers) < cfg.servers:
            kind, who, what = _get(q, procs, deadline, cfg.timeout_s)
            (workers if kind == "worker" else servers)[who] = what
            if kind == "worker" and progress is not None:
                progress(f"worker {who} finished after {what['iterations']} iterations")
    finally:
        for p in procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return _summary(cfg, workers, servers)


def _get(q: Any, procs: dict[str, Any], deadline: float, timeout_s: float) -> tuple[Any, ...]:
    while True:
        try:
            item = q.get(timeout=0.5)
        except queue.Empty:
            dead = [name for name, p in procs.items() if p.exitcode not in (None, 0)]
            if dead:
                raise PSError(f"{dead[0]} died (exit code {procs[dead[0]].exitcode})") from None
            if time.monotonic() > deadline:
                raise PSError(f"the run did not finish in time (timeout {timeout_s:g} s)"
                              ) from None
            continue
        if item[0] == "error":
            raise PSError(f"{item[1]} failed: {item[2]}")
        return tuple(item)


def _run_threads(cfg: PSRunConfig) -> dict[str, Any]:
    import torch

    # One intra-op thread, as each worker process has (_worker_proc): with more, torch may
    # split a matmul's sums differently, and the runs would not be bit-identical.
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_threads_body(cfg)
    finally:
        torch.set_num_threads(threads_before)


def _run_threads_body(cfg: PSRunConfig) -> dict[str, Any]:
    servers = [ParameterServer(i, cfg.server_config(), host=cfg.host,
                               security=cfg.security()).start()
               for i in range(cfg.servers)]
    addrs = [s.address for s in servers]
    results: dict[int, dict[str, Any]] = {}
    errors: list[str] = []

    models = [build(cfg) for _ in range(cfg.workers)]  # here: see train_worker

    def body(r: int) -> None:
        try:
            results[r] = train_worker(cfg, r, addrs, models[r])
        except BaseException as exc:
            errors.append(f"worker {r}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(cfg.workers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(cfg.timeout_s * max(1.0, cfg.steps / 50))
        if errors:
            raise PSError(errors[0])
        if any(t.is_alive() for t in threads):
            raise PSError("workers did not finish in time")
        for s in servers:
            s.wait_finished(cfg.timeout_s)
        stats = {s.index: s.stats() for s in servers}
    finally:
        for s in servers:
            s.stop()
    return _summary(cfg, results, stats)


def _summary(cfg: PSRunConfig, workers: dict[int, dict[str, Any]],
             servers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    lead = workers[0]
    return {
        "config": asdict(cfg),
        "test_accuracy": lead["test_accuracy"],
        "digest": lead["digest"],
        "placement": lead["placement"],
        "elapsed_s": max(w["elapsed_s"] for w in workers.values()),
        "dropped_late": sum(s["dropped_late"] for s in servers.values()),
        "steps_applied": sum(s["steps_applied"] for s in servers.values()),
        "iterations": {r: workers[r]["iterations"] for r in sorted(workers)},
        "workers": [workers[r] for r in sorted(workers)],
        "servers": [servers[i] for i in sorted(servers)],
    }
