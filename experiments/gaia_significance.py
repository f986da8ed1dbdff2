"""How many entries Gaia's significance filter sends, in process (no network).

Two simulated data centres, each one model trained on its own 64-sample batches of
scikit-learn's digits (two workers of 32), exchange their significant updates after every step
with no staleness (``SignificanceFilter`` from switchml.gaia). Prints the fraction of entries
sent per data centre and clock, and data centre 0's test accuracy every 10 steps. Cited in
docs/geo.md (the choice of the benchmark's threshold).

    python experiments/gaia_significance.py --threshold 0.01 --decay
    python experiments/gaia_significance.py --threshold 0.1 --lr 0.025
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from switchml.gaia.rules import SignificanceFilter
from switchml.workloads import cnn_model as build_model
from switchml.workloads import digits_split as load_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threshold", type=float, default=0.01, help="S (default 0.01)")
    ap.add_argument("--decay", action=argparse.BooleanOptionalAction, default=False,
                    help="S_t = S / sqrt(t) (default off)")
    ap.add_argument("--lr", type=float, default=0.05, help="each data centre's lr")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_data(0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_model())
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9) for m in models]
    gens = [torch.Generator().manual_seed(r) for r in range(4)]

    def flat(m: nn.Module) -> np.ndarray:
        with torch.no_grad():
            return parameters_to_vector(m.parameters()).numpy().copy()

    def write(m: nn.Module, v: np.ndarray) -> None:
        src, off = torch.from_numpy(v), 0
        with torch.no_grad():
            for p in m.parameters():
                p.view(-1).copy_(src[off:off + p.numel()])
                off += p.numel()

    prev = [flat(m) for m in models]
    filters = [SignificanceFilter(prev[0].size, threshold=args.threshold, decay=args.decay)
               for _ in models]
    sent, accs = 0, []
    for t in range(1, args.steps + 1):
        updates = []
        for d, (m, opt) in enumerate(zip(models, opts)):
            idx = torch.cat([torch.randint(0, len(ytr), (32,), generator=g)
                             for g in gens[2 * d:2 * d + 2]])
            opt.zero_grad()
            nn.functional.cross_entropy(m(xtr[idx]), ytr[idx]).backward()
            opt.step()
            cur = flat(m)
            filters[d].add(cur - prev[d])
            updates.append(filters[d].select(cur, clock=t))
            sent += updates[-1][0].size
        for d, m in enumerate(models):
            cur = flat(m)
            i, v = updates[1 - d]
            np.add.at(cur, i, v)
            write(m, cur)
            prev[d] = cur
        if t % 10 == 0:
            with torch.no_grad():
                accs.append(round(float((models[0](xte).argmax(1) == yte).float().mean()), 3))
    print(f"S {args.threshold} decay {args.decay} lr {args.lr}: fraction of entries sent per "
          f"clock {sent / (2 * args.steps * prev[0].size):.4f}")
    print("test accuracy every 10 steps:", accs)


if __name__ == "__main__":
    main()
