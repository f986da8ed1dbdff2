"""Training through TensorFlow-style parameter servers, all started by torchrun.

    torchrun --nproc-per-node 6 examples/train_ps.py --servers 2          # 4 workers, 2 servers
    torchrun --nproc-per-node 5 examples/train_ps.py --servers 1 --backup 1

The last --servers ranks become parameter servers (the optimizer step runs there); the others
compute gradients on scikit-learn's digits, push them and pull the new parameters.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from switchml.ps import PSTrainer, model_digest
from switchml.ps.roles import torchrun_role
from switchml.workloads import digits_split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=1, help="parameter servers (default 1)")
    parser.add_argument("--backup", type=int, default=0, help="backup workers (default 0)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    args = parser.parse_args()
    torch.set_num_threads(1)
    role = torchrun_role(servers=args.servers, backup=args.backup, lr=0.05, momentum=0.9)
    if role.is_server:
        print(f"server rank {role.rank}: {role.server_stats['steps_applied']} steps applied, "
              f"{role.server_stats['dropped_late']} late gradients dropped", flush=True)
        role.close()
        return
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    xtr, ytr, xte, yte = digits_split(0)
    gen = torch.Generator().manual_seed(role.worker)
    trainer = PSTrainer(model, servers=role.servers, worker=role.worker, workers=role.workers,
                        print_placement=role.worker == 0, security=role.security)
    while not trainer.done(args.steps):
        idx = torch.randint(0, len(ytr), (args.batch_size,), generator=gen)
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        trainer.step()
    if role.worker == 0:
        with torch.no_grad():
            acc = float((model(xte).argmax(1) == yte).float().mean())
        print(f"worker 0: test accuracy {acc:.4f}, parameter digest {model_digest(model)}",
              flush=True)
    trainer.close()
    role.close()


if __name__ == "__main__":
    main()
