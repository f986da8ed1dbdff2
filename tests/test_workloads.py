"""The training workloads (``switchml.workloads``): each one learns, gives every parameter a
gradient every step (DDP requires it), holds out data it never trains on, and says what is
wrong with a wrong name or batch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from switchml import workloads  # noqa: E402

# Steps after which each workload's metric has clearly moved from its start (measured: ncf
# AUC 0.50 -> 0.57 at 20 steps, lstm perplexity 3200 -> 400, bert 15000 -> 1500, the digits
# models' accuracy 0.1 -> 0.8).
STEPS = {"ncf": 20, "lstm": 20, "bert": 20, "cnn": 30, "mlp": 20, "mf": 60}


@pytest.mark.parametrize("name", workloads.NAMES)
def test_every_workload_learns_on_held_out_data(name):
    torch.set_num_threads(1)
    w = workloads.get(name)
    torch.manual_seed(0)
    task = w.build(seed=1)
    model, opt = task.model, w.optimizer(task.model.parameters())
    before = task.evaluate(model)
    losses = []
    for step in range(STEPS[name]):
        x, y = task.batch_of(step)
        opt.zero_grad(set_to_none=True)
        loss = task.loss_fn(model(x), y)
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"{name}: no gradient for {missing} at step {step}"
        opt.step()
        losses.append(loss.item())
    after = task.evaluate(model)
    assert sum(losses[-3:]) < sum(losses[:3]), (name, losses)
    # better by a clear margin, in the metric's own direction
    if w.higher_is_better:
        assert after > before + 0.03, (name, before, after)
    else:
        assert after < 0.7 * before, (name, before, after)


def test_an_mf_step_changes_only_the_rows_its_batch_names():
    # Gaia's filter sends what changed: on a factorisation trained with plain SGD that is the
    # rows of the batch's users and items, and nothing else.
    w = workloads.get("mf")
    torch.manual_seed(0)
    task = w.build(batch=16, seed=3)
    model, opt = task.model, w.optimizer(task.model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = task.batch_of(0)
    opt.zero_grad()
    task.loss_fn(model(x), y).backward()
    opt.step()
    for name, col in (("user", 0), ("item", 1), ("user_bias", 0), ("item_bias", 1)):
        moved = (getattr(model, name).weight != before[f"{name}.weight"]).any(1)
        assert set(moved.nonzero().flatten().tolist()) == set(x[:, col].tolist()), name


def test_the_lstm_gives_every_parameter_a_gradient_when_a_batch_misses_a_cluster():
    # The adaptive softmax's tail clusters see no gradient from a batch whose targets all
    # fall in the head; DDP would then wait for them forever.
    w = workloads.get("lstm")
    torch.manual_seed(0)
    task = w.build(batch=2, seed=0)
    x, _ = task.batch_of(0)
    y = torch.ones_like(x)  # every target is token 1, in the head
    task.loss_fn(task.model(x), y).backward()
    assert all(p.grad is not None for p in task.model.parameters())


def test_the_text_corpus_holds_out_its_tail_and_is_the_same_everywhere():
    train, held, vocab = workloads.corpus()
    assert len(train) > 500_000 and len(held) > 20_000
    assert int(max(train.max(), held.max())) < vocab
    assert int(train.min()) >= 0 and (train == 0).float().mean() < 0.05  # few unknowns
    # The held-out part is the text's last 5%, never trained on.
    assert abs(len(held) / (len(train) + len(held)) - 0.05) < 0.001
    # The same ids in another process (every rank builds its own).
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "from switchml.workloads import corpus; "
                          "t, h, v = corpus(); print(int(t[:1000].sum()), int(h.sum()), v)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(int(train[:1000].sum())), str(int(held.sum())), str(vocab)]


def test_a_wrong_name_or_batch_says_what_is_wrong():
    with pytest.raises(ValueError, match="unknown workload 'resnet'.*ncf"):
        workloads.get("resnet")
    with pytest.raises(ValueError, match="batch must be >= 1"):
        workloads.get("cnn").build(batch=0)


def test_the_digits_are_scikit_learns_and_load_without_importing_it(monkeypatch):
    """The digits come from scikit-learn's own file, read without importing scikit-learn
    (about 1 s of CPU per process); set against ``sklearn.datasets.load_digits``: the same
    1,797 images and labels, 80/20 between train and test."""
    import collections
    import subprocess
    import sys
    code = ("import sys; from switchml.workloads import digits_split; digits_split(0); "
            "assert 'sklearn' not in sys.modules, 'sklearn imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    from sklearn.datasets import load_digits
    ref = load_digits()
    tx, ty, vx, vy = workloads.digits_split(3)
    assert (len(ty), len(vy)) == (1437, 360) and tx.shape[1:] == (1, 8, 8)
    assert 0 <= float(tx.min()) and float(tx.max()) <= 1

    def images(x, y):  # each (label, pixels 0..16) as often as it occurs
        return collections.Counter(
            (int(label), bytes((img * 16).round().to(torch.uint8).flatten().tolist()))
            for img, label in zip(x, y))

    assert images(torch.cat([tx, vx]), torch.cat([ty, vy])) == images(
        torch.tensor(ref.images, dtype=torch.float32).unsqueeze(1) / 16, ref.target)
    assert images(tx, ty) != images(*workloads.digits_split(4)[:2])  # the seed splits
    # where scikit-learn's layout has no such file (an editable build): load_digits itself
    import importlib.util
    workloads.digits_split.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert torch.equal(workloads.digits_split(3)[0], tx)
    monkeypatch.undo()
    workloads.digits_split.cache_clear()
