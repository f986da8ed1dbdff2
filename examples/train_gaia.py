"""Gaia across data centres: torchrun inside each one, significant updates between them.

Each data centre is an ordinary torchrun job (DDP on gloo or switchml inside it); its rank 0,
the leader, links to the other data centres' leaders. Two data centres on this machine:

    export SWITCHML_DC_LEADERS=127.0.0.1:7100,127.0.0.1:7101
    SWITCHML_DC=0 torchrun --nproc-per-node 2 --master-port 29500 examples/train_gaia.py &
    SWITCHML_DC=1 torchrun --nproc-per-node 2 --master-port 29501 examples/train_gaia.py

On other hosts, give each leader's reachable address in SWITCHML_DC_LEADERS and the leaders
TLS credentials (``switchml tls init DIR`` on one host, copied to the others; then
``SWITCHML_TLS_DIR=DIR``). Every rank prints its accuracy and a digest of its parameters at
the end: after ``finish()`` the replicas of a data centre are identical, and every data
centre holds every update made anywhere (summed in another order: equal to float32 rounding).
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import switchml.gaia
import switchml.torch  # noqa: F401  registers the "switchml" backend
from switchml import env, workloads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", help="inside the data centre: gloo or "
                        "switchml (default gloo)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threshold", type=float, default=0.01,
                        help="Gaia's significance threshold S (default 0.01: 1%%)")
    parser.add_argument("--save", metavar="PREFIX",
                        help="save this rank's final parameters to PREFIX-dc<i>-rank<r>.npy")
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # this data centre's ranks (torchrun)
    rank = dist.get_rank()
    work = workloads.get("cnn")
    torch.manual_seed(0)  # the same initial model in every data centre
    task = work.build(seed=1000 * env.dc_index() + rank)  # data: each its own
    model = DDP(task.model)
    opt = work.optimizer(model.parameters())
    gaia = switchml.gaia.connect(task.model, threshold=args.threshold)
    for step in range(args.steps):
        x, y = task.batch_of(step)
        opt.zero_grad(set_to_none=True)
        task.loss_fn(model(x), y).backward()
        opt.step()
        gaia.after_step()
    gaia.finish()
    flat = torch.cat([p.detach().reshape(-1) for p in task.model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    if args.save:
        import numpy as np
        np.save(f"{args.save}-dc{env.dc_index()}-rank{rank}.npy", flat.numpy())
    # One write of the whole line: the ranks of a torchrun share its standard output.
    sys.stdout.write(f"data centre {env.dc_index()} rank {rank}: accuracy "
                     f"{task.evaluate(task.model):.3f}, published {gaia.entries_published}, "
                     f"applied {gaia.entries_applied}, parameters {digest}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
