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

__all__ = ["around_the_replacement", "plot_steps"]


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


def plot_steps(rows: list[dict[str, Any]], path: str) -> None:
    """Each run's step time against its steps (rank 0's, evaluations left out), the faults
    marked: the switch or a worker killed, the replacement's first step (the step of the
    state it took), a straggler's steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in rows:
        steps = np.diff([0.0, *r["times"]])
        line, = ax.plot(range(1, len(steps) + 1), 1e3 * steps,
                        label=f"{r['model']} {r['system']}", lw=1.2)
        for at, what in ((r.get("kill_worker_at"), "worker killed"),
                         (r.get("kill_switch_at"), "switch killed"),
                         (r.get("replacement_start_step"), "replacement's first step")):
            if at:
                ax.axvline(at, color=line.get_color(), ls=":" if "replacement" in what
                           else "--", lw=1)
                ax.annotate(what, (at, ax.get_ylim()[1] * 0.95), rotation=90, fontsize=7,
                            color=line.get_color(), va="top", ha="right")
    ax.set_xlabel("step")
    ax.set_ylabel("step time, rank 0 (ms)")
    ax.set_title(f"step time with faults: {rows[0]['workers']} workers, "
                 f"{rows[0]['rate_bps'] / 1e6:g} Mbit/s links")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
