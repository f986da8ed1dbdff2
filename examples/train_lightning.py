"""PyTorch Lightning on switchml: DDP's gradients through the switch, one string changed.

    python examples/train_lightning.py --backend gloo     --devices 4
    python examples/train_lightning.py --backend switchml --devices 4

Lightning starts the other processes itself (its DDP launcher runs this script again per
device); ``import switchml.torch`` registers the backend in each of them, and
``DDPStrategy(process_group_backend="switchml")`` is the only change to a gloo script. With
SWITCHML_SWITCH unset, rank 0 starts a software switch on this machine. Needs
``pip install -e ".[integrations]"`` (the ``lightning`` package).
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import switchml.torch  # noqa: F401  registers the "switchml" backend


class Digits(L.LightningModule):
    """A small CNN on scikit-learn's 8x8 digits."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(16 * 64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _i: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _i: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def loaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    train, val = TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])
    # Lightning gives each rank its shard (a DistributedSampler) in both loaders.
    return (DataLoader(train, batch_size=batch_size, shuffle=True),
            DataLoader(val, batch_size=batch_size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", help="gloo or switchml (default gloo)")
    parser.add_argument("--devices", type=int, default=4, help="CPU processes (default 4)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--metrics", help="rank 0 writes the final metrics here as JSON")
    args = parser.parse_args()

    L.seed_everything(0, workers=True)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_epochs=args.epochs,
                        strategy=DDPStrategy(process_group_backend=args.backend),
                        deterministic=True, enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    train, val = loaders(args.batch_size)
    trainer.fit(Digits(), train, val)
    if trainer.global_rank == 0:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        print(f"{args.backend}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(
            metrics.items())), flush=True)
        if args.metrics:
            with open(args.metrics, "w") as f:
                json.dump(metrics, f)


if __name__ == "__main__":
    main()
