"""``switchml tls init DIR``: TLS credentials for the parameter-server and Gaia links."""

from __future__ import annotations

import argparse

from switchml.cli.common import Subparsers

__all__ = ["add_parser", "run_init"]


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
    init.add_argument("--days", type=int, default=365, help="validity (default 365 days)")
    init.set_defaults(func=run_init)


def run_init(args: argparse.Namespace) -> int:
    """``switchml tls init``: a CA and a peer certificate in DIR."""
    from switchml.links import ca_key_dir, make_credentials

    sec = make_credentials(args.dir, days=args.days)
    print(f"made {sec.ca}, {sec.cert} and {sec.key}; the CA's key is in "
          f"{ca_key_dir(args.dir) / 'ca.key'}: keep it off the peers")
    return 0
