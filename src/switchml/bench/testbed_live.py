"""``switchml bench train --systems switchml-live --kill-worker-at S``: what a killed worker and
its replacement cost a job whose replicas come and go (``switchml.torch.live``), measured on
the testbed: the live ranks' worst step after the death against their step before, when the
replacement's first step ended after its start, whether it contributed, and whether every
replica ended with the same parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from switchml.bench.testbed_train import TrainBenchConfig

__all__ = ["around_the_replacement"]


def around_the_replacement(cfg: TrainBenchConfig, out: list[dict[str, Any]],
                           replaced: dict[str, Any]) -> dict[str, Any]:
    """The row's fields for a run whose last rank died at ``cfg.kill_worker_at`` and was
    replaced (``out``: the live ranks' reports, the replacement's last; ``replaced``: the
    wall-clock times it died and its replacement started)."""
    live, new = out[:-1], out[-1]
    died, started = replaced["died_wall"], replaced["started_wall"]
    before, after = [], []
    for o in live:  # each step's duration, by when it ended (evaluations left out)
        durations = np.diff([0.0, *o["times"]])
        walls = np.asarray(o["walls"])
        before += durations[2:cfg.kill_worker_at].tolist()
        after += durations[walls > died].tolist()
    first = new["walls"][0] if new["walls"] else None
    # The first step whose sums held the replacement's data (the results it took that were
    # not left out grew over the step; torchft's: every committed step counts it).
    mine = np.diff([0, *new["mine"]]) if new.get("mine") else None
    helped = (int(np.argmax(mine > 0)) if mine is not None and (mine > 0).any()
              else 0 if mine is None and first is not None else None)
    stats = new.get("live") or {}
    left_out, received = stats.get("results_left_out", 0), stats.get("results_received", 0)
    # From when the replacement started on, how its steps' sums were made: the share of the
    # results it took that held its own data.
    return {
        "kill_worker_at": cfg.kill_worker_at, "replace_after_s": cfg.replace_after_s,
        "before_kill_step_s": float(np.median(before)) if before else None,
        "kill_stall_s": float(max(after)) if after else None,
        "after_kill_step_s": float(np.median(after)) if after else None,
        "replacement_start_step": new.get("start_step"),
        "replacement_state_s": stats.get("joined_after_s"),
        "replacement_first_step_s": None if first is None else first - started,
        "replacement_contributes_s": (None if helped is None
                                      else new["walls"][helped] - started),
        "replacement_contributed": new.get("contributed", (1.0 - left_out / received)
                                           if received else 0.0),
        "replicas_identical": len({o.get("params_digest") for o in out}) == 1,
        "states_served": sum((o.get("live") or {}).get("states_served", 0) for o in live),
    }
