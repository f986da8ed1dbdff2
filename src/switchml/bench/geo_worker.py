"""A worker of ``switchml bench geo`` (``bench.geo``), run inside its namespace as ``python -m
switchml.bench.geo_worker JSON``: it joins its mode's process group, trains, and prints its
figures as one line of JSON (data centre leaders: their Gaia or DiLoCo statistics)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from switchml.bench.geo import DC_BACKEND_MODES, LOCAL_MODES

__all__ = ["geo_worker"]


def _join_group(a: dict[str, Any]) -> None:
    """Join this mode's process group: the data centre's (Gaia, on ``dc_backend``) or every
    worker's (gloo)."""
    from switchml.bench.nsproc import init_group
    mode = a["mode"]
    backend = a.get("dc_backend", "gloo") if mode in DC_BACKEND_MODES else "gloo"
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
                  group=dist.group.WORLD, embedding_rows=a["embedding_rows"])


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
    if mode == "torchft":
        from switchml.bench.geo_torchft import TorchftDiLoCo
        diloco = TorchftDiLoCo(a, model, opt)
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
    if mode == "diloco" and diloco.outer is not None:
        out["diloco"] = {"outer_steps": diloco.outer_steps,
                         "bytes_reduced": diloco.bytes_reduced,
                         "parameters": sum(p.numel() for p in diloco.params)}
        diloco.outer.close()
    if mode == "torchft":
        if lead:
            out["diloco"] = diloco.stats()
        diloco.close()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m switchml.bench.geo_worker JSON")
    print(json.dumps(geo_worker(json.loads(sys.argv[1]))), flush=True)
