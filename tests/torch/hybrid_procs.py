"""Process bodies for the HybridDataParallel tests (spawned through torch_procs.Procs)."""

from __future__ import annotations

from typing import Any

# Each case: (name, layer widths, rows per rank as a function of rank, 3-D input positions).
CASES = [
    ("wide", [32, 256, 8], [4, 4, 4], 0),           # a wide first layer: sfb, then aggregate
    ("uneven", [48, 192, 64, 5], [2, 6, 3], 0),     # ranks feed different K: padded factors
    ("seq", [16, 128, 4], [2, 2, 2], 5),            # 3-D input (batch, positions, features)
]


def _model(widths: list[int]) -> Any:
    import torch
    layers: list[Any] = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def _batch(widths: list[int], rows: int, positions: int, gen: Any,
           dtype: Any = None) -> tuple[Any, Any]:
    import torch
    shape = (rows, positions) if positions else (rows,)
    return (torch.randn(*shape, widths[0], generator=gen, dtype=dtype),
            torch.randn(*shape, widths[-1], generator=gen, dtype=dtype))


def _run(wrapped: Any, model: Any, widths: list[int], rows: int, positions: int, rank: int,
         steps: int, dtype: Any = None) -> dict[str, Any]:
    """One backward (gradients) then ``steps`` SGD steps (losses) on rank-specific data."""
    import torch
    gen = torch.Generator().manual_seed(500 + rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    grads, losses = None, []
    x, y = _batch(widths, rows, positions, gen, dtype)  # one batch per rank: the loss must fall
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().float().numpy().copy()
                     for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return {"grads": grads, "losses": losses}


def hybrid_vs_ddp_body(rank: int, world: int, q: Any, backend: str, steps: int,
                       dtype: str = "float32") -> dict[str, Any]:
    """Per case: DDP on gloo and HybridDataParallel on ``backend`` from the same weights, with
    parameters and data in ``dtype``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_procs import _init

    import switchml.torch as stt

    torch.set_num_threads(1)
    _init(backend, timeout_s=30)
    gloo = dist.new_group(backend="gloo") if backend != "gloo" else None
    out: dict[str, Any] = {}
    for name, widths, rows_by_rank, positions in CASES:
        rows = rows_by_rank[rank % len(rows_by_rank)]
        dt = getattr(torch, dtype)
        torch.manual_seed(7)
        ref_model = _model(widths).to(dt)
        torch.manual_seed(7)
        hyb_model = _model(widths).to(dt)
        ref = _run(DDP(ref_model, process_group=gloo), ref_model, widths, rows, positions, rank,
                   steps, dt)
        hdp = stt.HybridDataParallel(hyb_model, bucket_cap_mb=0.01)
        hyb = _run(hdp, hyb_model, widths, rows, positions, rank, steps, dt)
        out[name] = {"ref": ref, "hybrid": hyb,
                     "decisions": [(d.name, d.path, d.rows) for d in hdp.decisions]}
    if backend == "switchml":
        out["stats"] = stt.stats()
    dist.destroy_process_group()
    return out


def trace_body(rank: int, world: int, q: Any, mode: str, steps: int) -> dict[str, Any]:
    """Train with the bench's wrapper (DDP with the tracing hook, or hybrid) and a timeline;
    return the spans and the backward compute intervals."""
    import torch
    import torch.distributed as dist
    from torch_procs import _init

    from switchml.bench.hybridtrain import StepRecorder, wrap
    from switchml.torch.timeline import Timeline

    torch.set_num_threads(1)
    _init("gloo", timeout_s=30)
    torch.manual_seed(3)
    model = _model([64, 512, 512, 512, 10])
    timeline = Timeline()
    wrapped = wrap(model, mode, timeline)
    rec = StepRecorder(model, timeline)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        opt.zero_grad()
        f0 = Timeline.now()
        loss = torch.nn.functional.cross_entropy(wrapped(x), y)
        b0 = Timeline.now()
        loss.backward()
        o0 = Timeline.now()
        opt.step()
        rec.forward(f0, b0)
        rec.backward_done(b0, o0)
        rec.optimizer(o0, Timeline.now())
    summary = rec.summary(since_s=0.0, rank=rank)
    dist.destroy_process_group()
    return {"spans": [(s.name, s.tid, s.start_s, s.end_s) for s in timeline.snapshot()],
            "backward": rec.backward, "hidden_fraction": summary["hidden_fraction"],
            "decisions": [d.path for d in getattr(wrapped, "decisions", [])]}


def errors_body(rank: int, world: int, q: Any) -> dict[str, str]:
    """Misuse, one case each; returns the error messages by case."""
    import torch
    import torch.distributed as dist
    from torch_procs import _init

    import switchml.torch as stt

    _init("gloo", timeout_s=30)
    out: dict[str, str] = {}

    def catch(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "no error"
        except (ValueError, RuntimeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    catch("exclude", lambda: stt.HybridDataParallel(_model([4, 3]), exclude=["nope"]))
    catch("bucket", lambda: stt.HybridDataParallel(_model([4, 3]), bucket_cap_mb=0))

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: Any) -> Any:
            return self.fc(self.fc(x))

    twice = stt.HybridDataParallel(Twice())
    catch("twice", lambda: twice(torch.randn(2, 4)).sum().backward())

    class Unused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.spare = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x: Any) -> Any:
            return self.used(x)

    unused = stt.HybridDataParallel(Unused())
    catch("unused", lambda: unused(torch.randn(2, 4)).sum().backward())
    # after a failed backward the wrapper still trains
    net = _model([4, 3])
    ok = stt.HybridDataParallel(net)
    catch("ok", lambda: ok(torch.randn(2, 4)).sum().backward())
    dist.destroy_process_group()
    return out
