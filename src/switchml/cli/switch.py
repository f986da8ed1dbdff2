"""``switchml switch``: a software switch in the foreground (one, sharded, or a rack switch).

The flags become a :class:`switchml.service.SwitchSpec` (:func:`config_from_args`); the service
runs it until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from switchml import env
from switchml.cli.common import (
    Subparsers,
    add_host_option,
    add_insecure_option,
    add_nack_gap_option,
    add_shards_option,
    address,
    env_default,
    port,
    shard,
    stop_on_signals,
)

if TYPE_CHECKING:
    from switchml.service import SwitchSpec

__all__ = ["add_parser", "config_from_args", "run"]


def add_parser(sub: Subparsers) -> None:
    """``switchml switch``: a software switch in the foreground."""
    sw = sub.add_parser("switch", help="run a software switch in the foreground",
                        description="Run a software switch until SIGINT/SIGTERM. Jobs register "
                                    "themselves with their first JOIN; see docs/protocol.md.")
    add_host_option(sw, default=env_default("host", "127.0.0.1"),
                    help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    sw.add_argument("--port", type=port, default=int(env_default("port", 48864)),
                    help="UDP port (default 48864; 0 picks a free one)")
    sw.add_argument("--pool-slots", type=int, default=int(env_default("pool_slots", 1024)),
                    help="aggregation slots shared by all jobs; bounds the switch's slot "
                         "memory at 128 KiB per slot (default 1024 = 128 MiB)")
    sw.add_argument("--stats-interval-s", type=float, default=0.0,
                    help="log the counters every this many seconds (default 0: only at exit)")
    sw.add_argument("--lease-timeout-s", type=float,
                    default=float(env_default("lease_timeout_s", 30.0)),
                    help="a job silent for this long loses its slots (default 30)")
    sw.add_argument("--member-timeout-s", type=float,
                    default=float(env_default("member_timeout_s", 20.0)),
                    help="a member silent this long (no request, no keep-alive) is reported "
                         "gone to its peers, which then fail at once naming it (default 20)")
    sw.add_argument("--challenges-per-s", type=float,
                    default=float(env_default("challenges_per_s", 4096.0)),
                    help="the most JOIN challenges answered per second (bursts of as many): a "
                         "flood of JOINs from spoofed sources draws no more than this back, and "
                         "beyond it a JOIN is dropped and its worker asks again; 0: no budget "
                         "(default 4096)")
    add_nack_gap_option(sw, default=int(env_default("nack_gap", 4)),
                        help="loss recovery: tell a worker at once that a chunk of its is missing "
                             "when its later chunks arrive, tolerating this much reordering "
                             "(completions); 0 leaves recovery to the workers' timeouts "
                             "(default 4)")
    sw.add_argument("--quorum-history", type=int,
                    default=int(env_default("quorum_history", 16)),
                    help="quorum jobs: earlier rounds kept per slot, so that a rank the quorum "
                         "left behind gets their results (each costs a job its window's slot "
                         "memory once more; default 16)")
    _add_admission_args(sw)
    sw.add_argument("--metrics-port", type=port,
                    default=int(env_default("metrics_port", 9109)),
                    help="Prometheus /metrics on 127.0.0.1:PORT (default 9109; 0: off); read "
                         "by 'switchml stats'")
    sw.add_argument("--mtu", type=int, default=None,
                    help="refuse jobs whose datagrams would not fit this MTU (e.g. 1500 or "
                         "9000), instead of letting IP fragment them; default: any size UDP "
                         "carries (workers size their chunks to their own path MTU)")
    sw.add_argument("--no-batching", action="store_true",
                    help="one system call per datagram: turn off UDP GSO/GRO batching (also: "
                         "SWITCHML_GSO=0)")
    sw.add_argument("--stop-on-stdin-eof", action="store_true",
                    help="also stop when standard input closes (used by the PyTorch backend's "
                         "embedded switch, so it dies with the process that started it)")
    _add_topology_args(sw)
    sw.set_defaults(func=run)


def _add_admission_args(sw: argparse.ArgumentParser) -> None:
    """Who may create jobs on the switch, and how many slots a tenant's may hold."""
    sw.add_argument("--tenant-slots", type=int,
                    default=_optional_int(env_default("tenant_slots", None)),
                    help="the most slots one tenant's jobs (job ids of its range: switchml "
                         "job-key --tenant) may hold at once; a JOIN that would create a job "
                         "beyond it is refused (default: no quota)")
    sw.add_argument("--secret-file", default=env_default("secret_file", None),
                    help="file holding the secret needed to create jobs (workers pass it in "
                         "SWITCHML_SECRET); SWITCHML_SECRET also works here")
    add_insecure_option(sw, help="allow listening beyond loopback without a secret (anyone who "
                                 "can reach the port can then create jobs)")


def _add_topology_args(sw: argparse.ArgumentParser) -> None:
    """The switch's sharding (``--shards``, ``--shard``) and rack (``--upstream``) options."""
    add_shards_option(sw, metavar="S",
                      help="run S switch processes (0: one per core) on ports PORT .. PORT+S-1 "
                           "(metrics on METRICS_PORT+i): workers stripe every job's lanes over "
                           "them (give them all: SWITCHML_SWITCH=h:p,h:p+1,...), so one job uses "
                           "every shard's core (default 1)")
    sw.add_argument("--upstream", type=address, default=None, metavar="HOST:PORT",
                    help="run as the rack switch of a hierarchical job: aggregate this rack's "
                         "workers and send every partial sum to the parent (spine) switch at "
                         "HOST:PORT as one worker of its job; needs --rack and --job")
    sw.add_argument("--rack", type=shard, default=None, metavar="I/R",
                    help="with --upstream: this is rack I of R equal racks")
    sw.add_argument("--job", default=None, metavar="SPEC",
                    help="with --upstream: the job of all the tree's workers "
                         "(switchml.control.encode_job_spec); the rack prints the spec its "
                         "own workers join with")
    sw.add_argument("--shard", type=shard, default=None, metavar="I/S",
                    help="run shard I of a switch sharded over S processes or hosts (each "
                         "shard started by hand, e.g. one per host)")


def config_from_args(args: argparse.Namespace) -> SwitchSpec:
    """The switch ``args`` describe (``SWITCHML_GSO=0`` folded into ``batching``)."""
    from switchml.service import SwitchSpec
    return SwitchSpec(
        host=args.host, port=args.port, pool_slots=args.pool_slots,
        stats_interval_s=args.stats_interval_s, lease_timeout_s=args.lease_timeout_s,
        member_timeout_s=args.member_timeout_s, nack_gap=args.nack_gap,
        challenges_per_s=args.challenges_per_s or None,
        quorum_history=args.quorum_history, tenant_slots=args.tenant_slots,
        secret_file=args.secret_file, insecure=args.insecure, metrics_port=args.metrics_port,
        mtu=args.mtu, batching=not args.no_batching and env.batching(),
        stop_on_stdin_eof=args.stop_on_stdin_eof, shards=args.shards, shard=args.shard,
        upstream=args.upstream, rack=args.rack, job=args.job, log_level=args.log_level)


def run(args: argparse.Namespace) -> int:
    """``switchml switch``: serve until SIGINT/SIGTERM (or standard input's end)."""
    from switchml import service
    spec = config_from_args(args)
    return service.serve(spec, stop_on_signals(
        "stopping" if spec.shards == 1 else "stopping the shards"))


def _optional_int(text: str | None) -> int | None:
    return None if text in (None, "") else int(text)
