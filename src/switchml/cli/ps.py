"""``switchml ps``: parameter servers, one subcommand per role (``server``, ``train``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from typing import TYPE_CHECKING

from switchml.cli.common import (
    SIGNAL_POLL_S,
    Subparsers,
    add_host_option,
    add_insecure_option,
    add_json_option,
    add_seed_option,
    add_workers_option,
    env_default,
    port,
    stop_on_signals,
    write_json,
)

if TYPE_CHECKING:
    from switchml.ps.launch import PSRunConfig
    from switchml.ps.server import ServerConfig

__all__ = ["add_parser", "run_server", "run_train", "server_config_from_args",
           "train_config_from_args"]


def add_parser(sub: Subparsers) -> None:
    """``switchml ps``: parameter servers, one subcommand per role."""
    ps = sub.add_parser(
        "ps", help="TensorFlow-style parameter servers: run one, or train with them",
        description="Parameter servers: parameters placed round-robin by tensor on P servers "
                    "(large tensors split), workers push gradients and pull parameters over "
                    "TCP, the optimizer step runs on the servers. Synchronous with backup "
                    "workers (each step takes the first N-b gradients; late ones are dropped "
                    "and counted) or asynchronous. See docs/geo.md.")
    pss = ps.add_subparsers(dest="ps", required=True, metavar="ROLE")
    _add_server_parser(pss)
    _add_train_parser(pss)


def _add_server_parser(sub: Subparsers) -> None:
    """``switchml ps server``: one parameter server in the foreground."""
    srv = sub.add_parser("server", help="run one parameter server in the foreground",
                         description="Serve until SIGINT/SIGTERM (or, with --exit-when-done, "
                                     "until every worker said goodbye or died).")
    srv.add_argument("--index", type=int, default=0, help="this server's index (default 0)")
    add_host_option(srv, help="listen address (default 127.0.0.1; beyond loopback it needs "
                              "--tls-dir or --insecure)")
    srv.add_argument("--port", type=port, default=40000, help="TCP port (default 40000)")
    srv.add_argument("--tls-dir", default=env_default("tls_dir", None),
                     help="mutual-TLS credentials (ca.pem, peer.pem, peer.key; 'switchml tls "
                          "init DIR' makes them): only peers with a certificate of the same CA "
                          "connect, and all traffic is encrypted (env SWITCHML_TLS_DIR)")
    add_insecure_option(srv, help="allow plain TCP beyond loopback (anyone who reaches the port "
                                  "can set parameters and read them)")
    srv.add_argument("--exit-when-done", action="store_true",
                     help="exit when every worker said goodbye or died")
    _add_training_args(srv)
    srv.set_defaults(func=run_server)


def _add_train_parser(sub: Subparsers) -> None:
    """``switchml ps train``: P servers and N workers on this machine."""
    tr = sub.add_parser("train", help="start P servers and N workers here; train on digits",
                        description="Start --servers server processes and --workers worker "
                                    "processes on this machine, train a model on "
                                    "scikit-learn's digits through the servers, print the "
                                    "placement, accuracy, dropped gradients and a digest of "
                                    "the final parameters (equal between runs with the same "
                                    "seed and no backup workers).")
    tr.add_argument("--servers", "-p", type=int, default=2, help="server processes (default 2)")
    tr.add_argument("--steps", type=int, default=200, help="steps (versions) (default 200)")
    tr.add_argument("--batch", type=int, default=32, help="samples per worker (default 32)")
    tr.add_argument("--model", choices=("mlp", "cnn"), default="mlp",
                    help="mlp (19k parameters) or cnn (560k) (default mlp)")
    add_seed_option(tr, help="seed of model and data (default 0)")
    tr.add_argument("--max-shard-elements", type=int, default=1 << 17,
                    help="split tensors above this many elements (default 131072)")
    tr.add_argument("--slow-worker", type=int, default=None,
                    help="make this worker a straggler (sleeps --slow-s per step)")
    tr.add_argument("--slow-s", type=float, default=0.05, help="straggler delay (default 0.05)")
    add_json_option(tr, "the figures")
    tr.add_argument("--tls", action="store_true",
                    help="mutual TLS on every link, with credentials made for this run")
    _add_training_args(tr)
    tr.set_defaults(func=run_train)


def _add_training_args(p: argparse.ArgumentParser) -> None:
    """The options a parameter server and a training run share: workers, rule, optimizer."""
    add_workers_option(p, "workers N")
    p.add_argument("--backup", "-b", type=int, default=0,
                   help="backup workers b: each step uses the first N-b gradients "
                        "(default 0)")
    p.add_argument("--mode", choices=("sync", "async"), default="sync",
                   help="synchronous steps or asynchronous updates (default sync)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="optimizer run on the servers (default sgd)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="a missing gradient or silent peer fails the run after this "
                        "long, naming it (default 60)")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The parameter server's training rule and optimizer from ``args``."""
    from switchml.ps.server import ServerConfig
    return ServerConfig(args.workers, args.backup, args.mode, args.optimizer, args.lr,
                        args.momentum, args.timeout_s)


def train_config_from_args(args: argparse.Namespace) -> PSRunConfig:
    """The local training run ``args`` describe (without TLS: :func:`run_train` adds it)."""
    from switchml.ps.launch import PSRunConfig
    return PSRunConfig(servers=args.servers, workers=args.workers, backup=args.backup,
                       mode=args.mode, steps=args.steps, batch=args.batch, lr=args.lr,
                       momentum=args.momentum, optimizer=args.optimizer, seed=args.seed,
                       model=args.model, max_shard_elements=args.max_shard_elements,
                       slow_worker=args.slow_worker, slow_s=args.slow_s,
                       timeout_s=args.timeout_s)


def run_server(args: argparse.Namespace) -> int:
    """``switchml ps server``: serve until a signal (or, optionally, every worker's goodbye)."""
    import json

    from switchml.links import LinkSecurity
    from switchml.ps.server import ParameterServer

    cfg = server_config_from_args(args)
    security = LinkSecurity.from_dir(args.tls_dir) if args.tls_dir else None
    server = ParameterServer(args.index, cfg, host=args.host, port=args.port,
                             security=security, insecure=args.insecure).start()
    print(f"parameter server ps{args.index} listening on {server.address[0]}:"
          f"{server.address[1]}", flush=True)
    stop = stop_on_signals("stopping")
    while not stop.wait(SIGNAL_POLL_S):
        if args.exit_when_done and server.wait_finished(0.01):
            break
    print(json.dumps(server.stats()), flush=True)
    server.stop()  # joins its threads: see ParameterServer.stop for the abort this avoids
    return 0


def run_train(args: argparse.Namespace) -> int:
    """``switchml ps train``: train on digits through local parameter servers."""
    from switchml.ps.launch import run_ps_training

    cfg = train_config_from_args(args)
    with tempfile.TemporaryDirectory(prefix="switchml-tls-") as tmp:
        if args.tls:
            from switchml.links import make_credentials
            make_credentials(f"{tmp}/tls")
            cfg = dataclasses.replace(cfg, tls_dir=f"{tmp}/tls")
        r = run_ps_training(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(r["placement"])
    print(f"test accuracy {r['test_accuracy']:.4f}  elapsed {r['elapsed_s']:.2f} s  "
          f"steps applied (all shards) {r['steps_applied']}  dropped late gradients "
          f"{r['dropped_late']}  iterations per worker {r['iterations']}")
    print(f"parameter digest {r['digest']}")
    if args.json:
        write_json(args.json, r)
    return 0
