"""``switchml tls init DIR``: TLS credentials for the parameter-server and Gaia links."""

from __future__ import annotations

import argparse

from switchml.cli.common import Subparsers, bounded_int

__all__ = ["add_parser", "run_init", "run_issue"]


def add_parser(sub: Subparsers) -> None:
    """``switchml tls init DIR``: credentials for the parameter-server and Gaia links."""
    tls = sub.add_parser("tls", help="make TLS credentials for parameter servers and Gaia",
                         description="TLS credentials for the parameter-server and Gaia links "
                                     "(docs/operations.md).")
    tsub = tls.add_subparsers(dest="tls_command", required=True, metavar="SUBCOMMAND")
    init = tsub.add_parser("init", help="make a CA and a peer certificate in DIR",
                           description="Make a CA and one peer certificate signed by it: "
                                       "ca.pem, peer.pem and peer.key in DIR, which every "
                                       "server, worker and data-centre leader of the job "
                                       "loads (--tls-dir or SWITCHML_TLS_DIR), and the CA's "
                                       "key in DIR-ca/ca.key, a directory of its own: keep it "
                                       "off the peers.")
    init.add_argument("dir", help="directory to create (mode 0700)")
    init.add_argument("--days", type=days, default=365,
                      help="validity, 1..36500 (default 365 days)")
    init.set_defaults(func=run_init)
    issue = tsub.add_parser(
        "issue", help="make one peer's own certificate, naming its id",
        description="Sign one peer's own certificate with the CA that 'tls init DIR' made: "
                    "ca.pem, peer.pem and peer.key in DIR/ROLE-ID, which that peer alone "
                    "loads. The certificate names the peer (URI:switchml:ROLE:ID), and the "
                    "other side of every link refuses it under any other id: a parameter "
                    "server checks its workers', a worker its shard's, a Gaia leader the "
                    "other data centres'. A peer with the shared certificate of 'tls init' "
                    "may claim any id.")
    issue.add_argument("dir", help="the directory 'tls init' made (its CA key is in DIR-ca)")
    issue.add_argument("role", choices=["worker", "server", "dc"],
                       help="worker: a parameter-server worker; server: a parameter-server "
                            "shard; dc: a Gaia data centre's leader")
    issue.add_argument("id", type=int, help="the worker id, shard index or data-centre id")
    issue.add_argument("--days", type=days, default=365,
                       help="validity, 1..36500 (default 365 days)")
    issue.set_defaults(func=run_issue)


days = bounded_int("a validity in days", 1, 36500)
"""A certificate's validity in days: 1 to 36,500 (a hundred years)."""


def run_init(args: argparse.Namespace) -> int:
    """``switchml tls init``: a CA and a peer certificate in DIR."""
    from switchml.links import ca_key_dir, make_credentials

    sec = make_credentials(args.dir, days=args.days)
    print(f"made {sec.ca}, {sec.cert} and {sec.key}; the CA's key is in "
          f"{ca_key_dir(args.dir) / 'ca.key'}: keep it off the peers")
    return 0


def run_issue(args: argparse.Namespace) -> int:
    """``switchml tls issue``: one peer's own certificate in DIR/ROLE-ID."""
    from switchml.links import issue_credentials

    sec = issue_credentials(args.dir, args.role, args.id, days=args.days)
    print(f"made {sec.cert} and {sec.key} (with {sec.ca}) for {args.role} {args.id}: give "
          f"that directory to that peer alone (--tls-dir {sec.cert.parent})")
    return 0
