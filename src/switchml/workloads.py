"""Training workloads: a model, its data, its loss, its optimizer and its target metric.

The paper's network-bound kinds of models, at sizes this 2-core machine trains in minutes, and
two models for contrast. Every workload's gradient is dense (every parameter's gradient is
all-reduced every step), as in DDP. ``demo``, ``bench train``, ``predict``, the parameter
servers and Gaia take their models from here.

=========  ==========================================================  =========  ==========
name       model and data                                              params     metric
=========  ==========================================================  =========  ==========
``ncf``    NCF-style click model: user and item embedding tables       9.6M       AUC
           (200k and 100k rows x 32), GMF and MLP towers; synthetic
           clicks from latent factors, Zipf item popularity (Adam)
``lstm``   word-level LSTM language model, large input vocabulary      5.3M       perplexity
           (16k x 256), adaptive softmax; the Python standard library's
           own source (shipped with every Python) as its text (Adam)
``bert``   BERT-style masked language model: 2 transformer layers,    5.7M       perplexity
           d = 256, 4 heads, output tied to the input embedding;                 on masked
           the same text (Adam)                                                  tokens
``cnn``    a small CNN on scikit-learn's 8x8 digits (SGD)              0.56M      accuracy
``mlp``    digits -> 4096 -> 4096 -> 10: one wide linear layer (98%    17M        accuracy
           of the parameters), the hybrid mode's case (SGD)
=========  ==========================================================  =========  ==========

Use::

    w = workloads.get("ncf")
    task = w.build(batch=w.batch, seed=rank)     # model, loss_fn, batch_of(step), evaluate()
    opt = w.optimizer(model.parameters())
    x, y = task.batch_of(0); loss = task.loss_fn(task.model(x), y)

``evaluate(model)`` returns the metric on held-out data that every rank builds the same way
(``w.higher_is_better`` says which way is better). ``torch.manual_seed`` before ``build``
decides the initial weights: call it with the same seed on every rank.
"""

from __future__ import annotations

import re
import sysconfig
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["NAMES", "Task", "Workload", "cnn_model", "corpus", "digits_split", "get",
           "mlp_model"]


@dataclass
class Task:
    """One rank's instance of a workload."""

    model: Any
    """A ``torch.nn.Module``."""
    loss_fn: Callable[[Any, Any], Any]
    """``loss_fn(model(x), y)``."""
    batch_of: Callable[[int], tuple[Any, Any]]
    """The (x, y) of training step ``step`` on this rank."""
    evaluate: Callable[[Any], float]
    """The workload's metric of ``model`` on the held-out data (no gradients)."""
    held_loss: Callable[[Any], float] | None = None
    """The training loss of ``model`` on the held-out data, where the workload defines it."""

    def timed_step(self, forward: Any, opt: Any, step: int) -> tuple[Any, tuple[float, ...]]:
        """One training step through ``forward`` (the model or its DDP wrapper): the loss and
        the ``time.perf_counter`` instants at which forward, backward and the optimizer began,
        and the step ended."""
        x, y = self.batch_of(step)
        opt.zero_grad(set_to_none=True)
        f0 = time.perf_counter()
        loss = self.loss_fn(forward(x), y)
        b0 = time.perf_counter()
        loss.backward()
        o0 = time.perf_counter()
        opt.step()
        return loss, (f0, b0, o0, time.perf_counter())


@dataclass(frozen=True)
class Workload:
    name: str
    summary: str
    batch: int
    """Default per-worker batch."""
    lr: float
    optim: str
    """``sgd`` (momentum 0.9), ``plain-sgd`` (no momentum: a step changes only the entries
    its batch has gradients for) or ``adam``."""
    metric: str
    higher_is_better: bool
    network_bound: bool
    """Whether communication dominates its step on this machine at 1 Gbit/s (compute is
    cheap per parameter: embedding tables, or a wide layer)."""
    _build: Callable[[int, Any], Task]

    def build(self, batch: int | None = None, seed: int = 0) -> Task:
        """The model, loss, batches (drawn with ``seed``: each rank its own) and metric."""
        import torch
        batch = self.batch if batch is None else batch
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        return self._build(batch, torch.Generator().manual_seed(seed))

    def optimizer(self, params: Iterable[Any]) -> Any:
        import torch
        if self.optim == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr,
                               momentum=0.0 if self.optim == "plain-sgd" else 0.9)

    def better(self, a: float, b: float) -> bool:
        """Whether metric ``a`` is at least as good as ``b``."""
        return a >= b if self.higher_is_better else a <= b


# -- digits: cnn and mlp ------------------------------------------------------------------------

def _digits() -> Any:
    """scikit-learn's digits as one float64 array, a row per image: 64 pixels in 0..16, then
    the digit. Read from the file scikit-learn ships (``sklearn/datasets/data/
    digits.csv.gz``, what ``load_digits`` reads), found without importing scikit-learn, whose
    import (about 1 s of CPU) each benchmark process would otherwise pay before its first
    step; where the installed layout keeps that file elsewhere (an editable build, say),
    ``load_digits`` itself."""
    import importlib.util
    import os

    import numpy as np
    try:
        spec = importlib.util.find_spec("sklearn")
    except ValueError:  # (imported already, without a spec)
        spec = None
    for place in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(place, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return np.loadtxt(path, delimiter=",")
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise RuntimeError("the digits workloads need scikit-learn's data: pip install "
                           "scikit-learn") from None
    digits = load_digits()
    return np.column_stack([digits.data, digits.target])


@lru_cache(maxsize=4)
def digits_split(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """scikit-learn's digits (1797 real 8x8 images shipped with it) as (1, 8, 8) float
    tensors in [0, 1]: (train x, train y, test x, test y), split 80/20 under ``seed``."""
    import numpy as np
    import torch
    data = _digits()
    x = torch.tensor(data[:, :-1].reshape(-1, 8, 8), dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data[:, -1].astype(np.int64), dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def cnn_model() -> Any:
    """A small CNN for 8x8 digits (~560k parameters, so gradients are worth aggregating)."""
    from torch import nn
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 512), nn.ReLU(), nn.Linear(512, 10),
    )


def mlp_model(widths: tuple[int, ...] = (4096, 4096)) -> Any:
    """Digits (flattened) -> widths... -> 10, ReLU between: with (4096, 4096), the wide
    middle layer holds 98% of the parameters."""
    from torch import nn
    layers: list[Any] = [nn.Flatten()]
    for a, b in zip((64, *widths), widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1] if widths else 64, 10))


def _digits_task(model: Any, batch: int, gen: Any) -> Task:
    import torch
    from torch import nn
    xtr, ytr, xte, yte = digits_split(0)

    def batch_of(step: int) -> tuple[Any, Any]:
        idx = torch.randint(0, len(ytr), (batch,), generator=gen)
        return xtr[idx], ytr[idx]

    def evaluate(m: Any) -> float:
        with torch.no_grad():
            return float((m(xte).argmax(1) == yte).float().mean())

    def held_loss(m: Any) -> float:
        with torch.no_grad():
            return float(nn.functional.cross_entropy(m(xte), yte))

    return Task(model, nn.CrossEntropyLoss(), batch_of, evaluate, held_loss)


# -- ncf: a click model with large embedding tables ----------------------------------------------

def _zipf(n: int, exponent: float) -> Any:
    """Probabilities proportional to 1 / rank^exponent over ranks 1..n (click-log popularity)."""
    import torch
    p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** exponent
    return p / p.sum()


def _ncf_task(batch: int, gen: Any, users: int = 200_000, items: int = 100_000,
              dim: int = 32) -> Task:
    import torch
    from torch import nn

    class NCF(nn.Module):
        """Neural collaborative filtering (He et al. 2017): a generalised matrix factorisation
        tower and an MLP tower over user and item embeddings."""

        def __init__(self) -> None:
            super().__init__()
            self.user = nn.Embedding(users, dim)
            self.item = nn.Embedding(items, dim)
            self.mlp = nn.Sequential(nn.Linear(2 * dim, 64), nn.ReLU(), nn.Linear(64, 32),
                                     nn.ReLU())
            self.out = nn.Linear(dim + 32, 1)
            for e in (self.user, self.item):
                nn.init.normal_(e.weight, std=0.05)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            u, i = self.user(ids[:, 0]), self.item(ids[:, 1])
            return self.out(torch.cat([u * i, self.mlp(torch.cat([u, i], 1))], 1)).squeeze(1)

    # The world: latent factors (fixed seed, the same on every rank); users and items are
    # drawn with Zipf-like popularity, as in real click logs, so the head of each table is
    # seen often enough to learn in a short run (the gradient stays dense).
    truth = torch.Generator().manual_seed(7)
    fu = torch.randn(users, 8, generator=truth)
    fi = torch.randn(items, 8, generator=truth)

    pu, pi = _zipf(users, 1.05), _zipf(items, 1.05)

    def draw(n: int, g: Any) -> tuple[Any, Any]:
        u = torch.multinomial(pu, n, replacement=True, generator=g)
        i = torch.multinomial(pi, n, replacement=True, generator=g)
        y = ((fu[u] * fi[i]).sum(1) > 0).float()
        return torch.stack([u, i], 1), y

    held_x, held_y = draw(20_000, torch.Generator().manual_seed(99))

    def evaluate(m: Any) -> float:
        from sklearn.metrics import roc_auc_score
        with torch.no_grad():
            return float(roc_auc_score(held_y.numpy(), m(held_x).numpy()))

    return Task(NCF(), nn.BCEWithLogitsLoss(), lambda step: draw(batch, gen), evaluate)


# -- mf: matrix factorisation, the kind Gaia trained across data centres --------------------------

def _mf_task(batch: int, gen: Any, users: int = 2000, items: int = 2000, dim: int = 16) -> Task:
    """Matrix factorisation of implicit feedback: ``like(u, i) = <p_u, q_i> + b_u + b_i > 0``,
    trained with plain SGD, the kind of model Gaia's evaluation trained across data centres
    (Hsieh et al. 2017, Netflix). The world: rank-8 latent factors (fixed seed, the same on
    every rank), a pair liked when its factors agree; users and items drawn with Zipf
    popularity. A step changes only the rows of the users and items in its batch (no
    momentum), as SGD on a factorisation does: the sparse update Gaia's filter exploits."""
    import torch
    from torch import nn

    class MF(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user, self.item = nn.Embedding(users, dim), nn.Embedding(items, dim)
            self.user_bias, self.item_bias = nn.Embedding(users, 1), nn.Embedding(items, 1)
            for e in (self.user, self.item):
                nn.init.normal_(e.weight, std=0.1)
            for e in (self.user_bias, self.item_bias):
                nn.init.zeros_(e.weight)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            u, i = ids[:, 0], ids[:, 1]
            return ((self.user(u) * self.item(i)).sum(1) + self.user_bias(u).squeeze(1)
                    + self.item_bias(i).squeeze(1))

    truth = torch.Generator().manual_seed(7)
    fu, fi = torch.randn(users, 8, generator=truth), torch.randn(items, 8, generator=truth)
    pu, pi = _zipf(users, 1.0), _zipf(items, 1.0)

    def draw(n: int, g: Any) -> tuple[Any, Any]:
        u = torch.multinomial(pu, n, replacement=True, generator=g)
        i = torch.multinomial(pi, n, replacement=True, generator=g)
        return torch.stack([u, i], 1), ((fu[u] * fi[i]).sum(1) > 0).float()

    held_x, held_y = draw(20_000, torch.Generator().manual_seed(99))
    loss_fn = nn.BCEWithLogitsLoss()

    def evaluate(m: Any) -> float:
        with torch.no_grad():
            return float(((m(held_x) > 0).float() == held_y).float().mean())

    def held_loss(m: Any) -> float:
        with torch.no_grad():
            return float(loss_fn(m(held_x), held_y))

    return Task(MF(), loss_fn, lambda step: draw(batch, gen), evaluate, held_loss)


# -- text: the Python standard library's source ----------------------------------------------------

_VOCAB = 16_000
_TOKEN = re.compile(r"[A-Za-z_]+|\d+|\S")


@lru_cache(maxsize=1)
def corpus() -> tuple[Any, Any, int]:
    """(train ids, held-out ids, vocabulary size): the top-level modules of this Python's
    standard library (about 1M tokens), tokenised into words, numbers and symbols; the
    ``_VOCAB - 1`` most frequent tokens and one for the rest. The last 5% is held out."""
    import torch
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join(f.read_text(errors="replace") for f in sorted(root.glob("*.py")))
    tokens = _TOKEN.findall(text)
    if len(tokens) < 100_000:
        raise RuntimeError(f"the standard library at {root} has too little text "
                           f"({len(tokens)} tokens) for the language-model workloads")
    ranked = [t for t, _ in Counter(tokens).most_common(_VOCAB - 1)]
    index = {t: i + 1 for i, t in enumerate(ranked)}  # 0: any other token
    ids = torch.tensor([index.get(t, 0) for t in tokens], dtype=torch.long)
    cut = int(0.95 * len(ids))
    return ids[:cut], ids[cut:], _VOCAB


def _windows(ids: Any, batch: int, length: int, gen: Any) -> Any:
    import torch
    starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=gen)
    return torch.stack([ids[s:s + length + 1] for s in starts.tolist()])


def _lstm_task(batch: int, gen: Any, dim: int = 256, hidden: int = 256,
               length: int = 32) -> Task:
    import torch
    from torch import nn
    train, held, vocab = corpus()

    class LM(nn.Module):
        """Embedding, one LSTM layer, adaptive softmax (Grave et al. 2017) as large-vocabulary
        language models use; the input embedding holds most parameters."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.lstm = nn.LSTM(dim, hidden, batch_first=True)
            self.head = nn.AdaptiveLogSoftmaxWithLoss(hidden, vocab, cutoffs=[1000, 4000],
                                                      div_value=4.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.lstm(self.embed(x))
            return h.reshape(-1, h.shape[-1])

    def loss_fn(h: Any, y: Any) -> Any:
        # (+ 0 x the tail clusters' weights: a batch with no target in a cluster still gives
        # every parameter a gradient, as DDP requires of each step)
        touch = sum(p.reshape(-1)[0] for p in model.head.tail.parameters())
        return model.head(h, y.reshape(-1)).loss + 0.0 * touch

    def batch_of(step: int) -> tuple[Any, Any]:
        w = _windows(train, batch, length, gen)
        return w[:, :-1], w[:, 1:]

    held_w = _windows(held, 64, length, torch.Generator().manual_seed(99))

    def evaluate(m: Any) -> float:
        with torch.no_grad():
            h = m(held_w[:, :-1])
            return float(torch.exp(m.head(h, held_w[:, 1:].reshape(-1)).loss))

    model = LM()
    return Task(model, loss_fn, batch_of, evaluate)


def _bert_task(batch: int, gen: Any, dim: int = 256, layers: int = 2, heads: int = 4,
               length: int = 64, mask_rate: float = 0.15) -> Task:
    import torch
    from torch import nn
    train, held, vocab = corpus()
    mask_id = vocab  # one extra row: [MASK]

    class MLM(nn.Module):
        """A small BERT: token and position embeddings, post-norm transformer encoder layers
        (GELU), an output layer tied to the token embedding."""

        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab + 1, dim)
            self.pos = nn.Embedding(length, dim)
            layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0,
                                               activation="gelu", batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(dim)
            self.bias = nn.Parameter(torch.zeros(vocab + 1))
            nn.init.normal_(self.tok.weight, std=0.02)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
            return self.norm(self.encoder(h))

    def masked(w: Any, g: Any) -> tuple[Any, Any]:
        """BERT's corruption: 15% of positions are predicted, shown as [MASK]."""
        x = w.clone()
        chosen = torch.rand(w.shape, generator=g) < mask_rate
        x[chosen] = mask_id
        y = torch.where(chosen, w, torch.full_like(w, -100))
        return x, y

    def logits(m: Any, h: Any, y: Any) -> tuple[Any, Any]:
        keep = y.reshape(-1) != -100
        return h.reshape(-1, dim)[keep] @ m.tok.weight.t() + m.bias, y.reshape(-1)[keep]

    ce = nn.CrossEntropyLoss()

    def loss_fn(h: Any, y: Any) -> Any:
        out, target = logits(model, h, y)
        return ce(out, target)

    def batch_of(step: int) -> tuple[Any, Any]:
        return masked(_windows(train, batch, length - 1, gen), gen)

    g = torch.Generator().manual_seed(99)
    held_x, held_y = masked(_windows(held, 64, length - 1, g), g)

    def evaluate(m: Any) -> float:
        with torch.no_grad():
            out, target = logits(m, m(held_x), held_y)
            return float(torch.exp(ce(out, target)))

    model = MLM()
    return Task(model, loss_fn, batch_of, evaluate)


_ALL = [
    Workload("ncf", "NCF-style click model, 200k + 100k x 32 embeddings (9.6M parameters)",
             batch=256, lr=0.03, optim="adam", metric="auc", higher_is_better=True,
             network_bound=True, _build=_ncf_task),
    Workload("lstm", "LSTM language model, 16k x 256 input vocabulary, adaptive softmax "
             "(5.3M parameters)", batch=16, lr=0.003, optim="adam", metric="perplexity",
             higher_is_better=False, network_bound=True, _build=_lstm_task),
    Workload("bert", "BERT-style masked language model, 2 layers, d = 256 (5.7M parameters)",
             batch=8, lr=0.001, optim="adam", metric="masked_perplexity",
             higher_is_better=False,
             network_bound=True, _build=_bert_task),
    Workload("cnn", "small CNN on 8x8 digits (0.56M parameters)", batch=64, lr=0.05,
             optim="sgd", metric="accuracy", higher_is_better=True, network_bound=False,
             _build=lambda b, g: _digits_task(cnn_model(), b, g)),
    Workload("mlp", "digits -> 4096 -> 4096 -> 10, one wide layer (17M parameters)",
             batch=16, lr=0.02, optim="sgd", metric="accuracy", higher_is_better=True,
             network_bound=True, _build=lambda b, g: _digits_task(mlp_model(), b, g)),
    # A row's gradient is 1/batch of its samples' (a mean loss), so the rate scales with the
    # whole step's batch: 12 for one process of 64 (a sample moves its rows by lr/64 = 0.19);
    # switchml bench geo's 4 x 64 takes 50 (80 diverged late in a measured run).
    Workload("mf", "matrix factorisation, 2000 users + 2000 items x 16, plain SGD (68k "
             "parameters; Gaia's kind)", batch=64, lr=12.0, optim="plain-sgd",
             metric="accuracy", higher_is_better=True, network_bound=False, _build=_mf_task),
]
_BY_NAME = {w.name: w for w in _ALL}
NAMES: tuple[str, ...] = tuple(_BY_NAME)


def get(name: str) -> Workload:
    """The workload ``name``, or a user's model given as ``module:attribute``: a
    :class:`Workload`, or a factory ``f(batch) -> Task`` (or ``(model, loss_fn, batch_of)``;
    trained with SGD, lr 0.01, batch 32 by default). Raises ValueError naming the known ones."""
    if ":" in name:
        return _imported(name)
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(NAMES)}, or "
                         "module:factory") from None


def _imported(spec: str) -> Workload:
    import importlib
    module, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load the model factory {spec!r}: {exc}") from None
    if isinstance(obj, Workload):
        return obj
    if not callable(obj):
        raise ValueError(f"{spec!r} is neither a Workload nor a callable factory")

    def build(batch: int, _gen: Any) -> Task:
        made = obj(batch)
        if isinstance(made, Task):
            return made
        model, loss_fn, batch_of = made
        return Task(model, loss_fn, batch_of, lambda _m: float("nan"))

    return Workload(spec, f"the factory {spec}", batch=32, lr=0.01, optim="sgd",
                    metric="none", higher_is_better=True, network_bound=False, _build=build)
