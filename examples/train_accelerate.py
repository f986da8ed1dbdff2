"""Hugging Face Accelerate on switchml: DDP's gradient buckets through the switch.

    accelerate launch --cpu --num_processes 4 examples/train_accelerate.py --via gloo
    accelerate launch --cpu --num_processes 4 examples/train_accelerate.py --via switchml

On the CPU, Accelerate makes the process group itself and always picks gloo (or MPI): a
backend named in ``InitProcessGroupKwargs`` is kept only for an accelerator's devices, and
without one Accelerate leaves the model unwrapped (no gradient is averaged at all, which
silently trains each process alone). So the gradients reach the switch through switchml's DDP
communication hook, on the model Accelerate prepared: two lines,
``from switchml.torch.hooks import register_hook`` and ``register_hook(model, "switchml")``
(``"switchml16"``: 16 bits on the wire, with error feedback). Everything else stays on the
gloo group. With SWITCHML_SWITCH unset, the hook's first use on rank 0 starts a software
switch on this machine. Needs ``pip install -e ".[integrations]"`` (the ``accelerate``
package).
"""

from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from switchml.torch.hooks import register_hook


def model() -> nn.Module:
    """A small CNN on scikit-learn's 8x8 digits."""
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 64, 64), nn.ReLU(), nn.Linear(64, 10))


def loaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    train, val = TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])
    # accelerator.prepare shards both loaders across the processes.
    return (DataLoader(train, batch_size=batch_size, shuffle=True),
            DataLoader(val, batch_size=batch_size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--via", default="gloo",
                        help="gloo (DDP's own all-reduce), or a switchml hook: switchml, "
                             "switchml16 (default gloo)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--metrics", help="the main process writes the final metrics here")
    args = parser.parse_args()

    set_seed(0)
    accelerator = Accelerator(cpu=True)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    train, val = loaders(args.batch_size)
    net, opt, train, val = accelerator.prepare(net, opt, train, val)
    hook = register_hook(net, args.via) if args.via != "gloo" else None
    loss = torch.zeros(())
    for _epoch in range(args.epochs):
        net.train()
        for x, y in train:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            accelerator.backward(loss)
            opt.step()
    net.eval()
    total = torch.zeros(3)  # summed loss, correct, samples
    with torch.no_grad():
        for x, y in val:
            logits = net(x)
            total += torch.tensor([nn.functional.cross_entropy(logits, y, reduction="sum"),
                                   (logits.argmax(1) == y).sum(), len(y)])
    total = accelerator.reduce(total, reduction="sum")
    train_loss = accelerator.reduce(loss.detach(), reduction="mean")
    wrapped = isinstance(net, torch.nn.parallel.DistributedDataParallel)
    if accelerator.is_main_process:
        metrics = {"val_loss": float(total[0] / total[2]), "val_acc": float(total[1] / total[2]),
                   "train_loss": float(train_loss), "via": args.via, "ddp": wrapped,
                   "processes": accelerator.num_processes,
                   # gradient buckets that went through the switch (0 on gloo)
                   "switch_buckets": hook.buckets if hook is not None else 0}
        print(json.dumps(metrics))
        if args.metrics:
            with open(args.metrics, "w") as f:
                json.dump(metrics, f)
    accelerator.wait_for_everyone()  # (every rank done before the group goes)
    accelerator.end_training()  # (destroys the process group)


if __name__ == "__main__":
    main()
