"""``switchml job-key``: the key of one job, for a tenant's workers that must not hold the
switch's secret (``WorkerConfig.job_key``, ``SWITCHML_JOB_KEY``)."""

from __future__ import annotations

import argparse
import sys

from switchml.cli.common import Subparsers

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    """``switchml job-key --job ID --token T``: print the job's key as hex."""
    p = sub.add_parser(
        "job-key", help="print one job's key, for workers that must not hold the secret",
        description="Print the key of job ID under token T (HMAC-SHA256 of both under the "
                    "switch's secret: --secret-file, or SWITCHML_SECRET) as hex. A worker "
                    "given it (WorkerConfig(job_key=bytes.fromhex(...)), or SWITCHML_JOB_KEY) "
                    "can create and join that job, with that token, and no other, and the job "
                    "holds at most the switch's --max-window slots: give each tenant its jobs' "
                    "keys, never the secret (docs/operations.md). One I/O thread per rank: "
                    "several threads make a job each, which needs the secret.")
    p.add_argument("--job", type=_u32, required=True, help="the job id (0 .. 2^32-1)")
    p.add_argument("--token", type=_u64, required=True,
                   help="the job's token (0 .. 2^64-1; decimal, or hex with 0x)")
    p.add_argument("--secret-file", help="file holding the switch's secret (default: "
                                         "SWITCHML_SECRET)")
    p.set_defaults(func=run)


def _u32(text: str) -> int:
    return _bounded(text, 32)


def _u64(text: str) -> int:
    return _bounded(text, 64)


def _bounded(text: str, bits: int) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value < 2 ** bits:
        raise argparse.ArgumentTypeError(f"must be in 0 .. 2^{bits}-1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    """Print the job key, or say why not (no secret: an open switch needs no key)."""
    from switchml.protocol.auth import job_key
    from switchml.service import SwitchSpec, switch_secret

    # read as `switchml switch` reads it (the file, else SWITCHML_SECRET)
    secret = switch_secret(SwitchSpec(secret_file=args.secret_file))
    if not secret:
        print("switchml job-key: no secret (--secret-file or SWITCHML_SECRET): an open switch "
              "takes any worker, and a job key would protect nothing", file=sys.stderr)
        return 2
    print(job_key(secret, args.job, args.token).hex())
    return 0
