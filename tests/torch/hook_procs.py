"""Process body for the DDP hook tests (spawned; importable through sys.path)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def train_with_hooks(rank: int, world: int, port: int, steps: int, queue) -> None:
    try:
        import switchml.torch  # noqa: F401
        from switchml.torch.hooks import register_hook
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        out = {}
        for name in ("allreduce", "switchml", "switchml16", "noop"):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(),
                                      torch.nn.Linear(256, 1))
            ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.01)
            state = register_hook(ddp, name)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            g = torch.Generator().manual_seed(100 + rank)
            x = torch.randn(128, 32, generator=g)
            y = x[:, :1] * 2 - x[:, 1:2]
            losses = []
            for _ in range(steps):
                opt.zero_grad()
                loss = ((ddp(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            sent = None
            if state is not None and hasattr(state, "client"):
                sent = state.client.counters["payload_bytes_sent"]
                state.close()
            # numpy, not tensors: tensors cross a queue as shared memory that dies with us
            out[name] = ({k: v.numpy().copy() for k, v in net.state_dict().items()}, losses,
                         sent)
        dist.destroy_process_group()
        queue.put((rank, out, None))
    except BaseException as exc:  # noqa: BLE001
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))


def hook_geometry(rank: int, world: int, port: int, mtu: int, queue) -> None:
    """Create a hook state with ``SWITCHML_MTU=mtu`` on this rank; report the job's chunk size."""
    import os
    try:
        os.environ["SWITCHML_MTU"] = str(mtu)
        from switchml.torch.hooks import SwitchMLHookState
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        state = SwitchMLHookState()
        k = state.client.spec.elements_per_packet
        state.close()
        dist.destroy_process_group()
        queue.put((rank, k, None))
    except BaseException as exc:  # noqa: BLE001
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))


def lockstep_waits(rank: int, world: int, port: int, delay_s: float, queue) -> None:
    """Rank 1 sleeps ``delay_s`` before each backward; report, per hook, rank's backward
    times and final parameters (``noop`` and ``lockstep``)."""
    import time
    try:
        from switchml.torch.hooks import register_hook
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        out = {}
        for name in ("noop", "lockstep"):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                      torch.nn.Linear(16, 1))
            ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0001)
            register_hook(ddp, name)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(rank))
            backward_s = []
            for _ in range(3):
                opt.zero_grad()
                loss = (ddp(x) ** 2).mean()
                if rank == 1:
                    time.sleep(delay_s)
                t0 = time.perf_counter()
                loss.backward()
                backward_s.append(time.perf_counter() - t0)
                opt.step()
                dist.barrier()  # both ranks start the next step together
            out[name] = (backward_s, {k: v.numpy().copy() for k, v in net.state_dict().items()})
        dist.destroy_process_group()
        queue.put((rank, out, None))
    except BaseException as exc:  # noqa: BLE001
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))
