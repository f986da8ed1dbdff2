"""Switch capacity: how many REQUEST datagrams per second one software switch aggregates.

The switch runs in a process of its own (``bench.switchproc.SwitchProcess``: the real
``SwitchServer`` with its default settings), pinned to one core where there are two or more.
One generator process, pinned to another core, joins a job as N ranks (one UDP socket each: the
switch checks that a rank's data comes from the address it joined from) and replays prebuilt,
valid int32 REQUEST datagrams as fast as the switch answers: every rank keeps W slots in
flight, and a slot's next request leaves when its RESULT arrives (self-clocked, as real workers
do). Requests are built once in numpy buffers; per round only ``seq``, ``chunk`` and ``set`` are
patched. With batching (default) requests go out with UDP GSO and results come in with UDP GRO
(``transport/batching.py``), and a whole GRO batch is checked and answered with a few numpy
operations, so the generator's cost per datagram is far below the switch's.

Every result is checked (header against the outstanding request of its slot, payload against
the exact sum), and the switch's own counters are read before and after the measured interval.
The generator's CPU use is reported next to the switch's: a switch near 100% of its core is the
bottleneck; a generator near 100% means the figure is a lower bound of the switch's capacity.

Figures: datagrams/s into and out of the switch, payload GB/s (requests x K x 4 bytes), switch
CPU time per datagram received, drops by reason.

A sharded switch (``shards`` = S): S switch processes, shard i owning lanes i mod S of the job,
as ``switchml switch --shards S`` runs them. Shards share nothing, so G generator processes
(default one per shard) each feed a disjoint set of shards with all N ranks, one connected
socket per (rank, shard). The figures are given per shard and summed; the capacity figure
(datagrams/s at a whole core per shard) is the sum of the shards' own.

Modules: ``config`` (the configuration and the result), ``generator`` (the generator process),
``driver`` (:func:`run_switchcap`: start, pin, measure, stop) and ``report`` (the figures from
the samples, and the JSON file).
"""

from __future__ import annotations

from switchml.bench.switchcap.config import SwitchCapConfig, SwitchCapResult
from switchml.bench.switchcap.driver import run_switchcap
from switchml.bench.switchcap.report import write_json

__all__ = ["SwitchCapConfig", "SwitchCapResult", "run_switchcap", "write_json"]
