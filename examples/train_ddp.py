"""A torchrun training script written for gloo that runs on switchml by changing one string.

    torchrun --nproc-per-node 4 examples/train_ddp.py --backend gloo
    torchrun --nproc-per-node 4 examples/train_ddp.py --backend switchml

With --backend switchml and SWITCHML_SWITCH unset, rank 0 starts a software switch on this
machine; set SWITCHML_SWITCH=host:port to use a switch started with ``switchml switch``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import switchml.torch  # noqa: F401  registers the "switchml" backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", help="gloo or switchml (default gloo)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # torchrun provides rank, world size and the store
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    model = DDP(nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
                              nn.Linear(32 * 64, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    shard = torch.arange(rank, len(y), world)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        for i in range(0, len(shard) - args.batch_size + 1, args.batch_size):
            idx = shard[i:i + args.batch_size]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
        dist.all_reduce(loss)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item() / world:.4f} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
