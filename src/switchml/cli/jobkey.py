"""``switchml job-key``: the key of one job, or of a tenant (a range of job ids), for workers
that must not hold the switch's secret (``WorkerConfig.job_key``, ``SWITCHML_JOB_KEY``;
``WorkerConfig.tenant_key``, ``SWITCHML_TENANT_KEY``)."""

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
    p.add_argument("--job", type=_u32, help="the job id (0 .. 2^32-1)")
    p.add_argument("--token", type=_u64,
                   help="the job's token (0 .. 2^64-1; decimal, or hex with 0x)")
    p.add_argument("--tenant", type=_tenant,
                   help="print tenant T's key instead (0 .. 2047; no --job or --token): its "
                        "holder creates and joins any job of the tenant's range of ids "
                        "(2^31 + T * 2^20 .. + 2^20 - 1: control.new_job_spec(tenant=T); "
                        "SWITCHML_TENANT and SWITCHML_TENANT_KEY under torch), within the "
                        "switch's --tenant-slots, and no other job")
    p.add_argument("--secret-file", help="file holding the switch's secret (default: "
                                         "SWITCHML_SECRET)")
    p.set_defaults(func=run)


def _tenant(text: str) -> int:
    from switchml.protocol.auth import MAX_TENANT
    value = _bounded(text, 32)
    if value > MAX_TENANT:
        raise argparse.ArgumentTypeError(f"must be in 0 .. {MAX_TENANT}, got {value}")
    return value


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
    """Print the job's (or tenant's) key, or say why not (no secret: an open switch needs
    no key)."""
    from switchml.protocol.auth import key_for, tenant_key
    from switchml.service import SwitchSpec, switch_secret

    if (args.tenant is None) == (args.job is None or args.token is None) or (
            args.tenant is not None and (args.job, args.token) != (None, None)):
        print("switchml job-key: give --job and --token (one job's key), or --tenant alone "
              "(a tenant's)", file=sys.stderr)
        return 2

    # read as `switchml switch` reads it (the file, else SWITCHML_SECRET)
    secret = switch_secret(SwitchSpec(secret_file=args.secret_file))
    if not secret:
        print("switchml job-key: no secret (--secret-file or SWITCHML_SECRET): an open switch "
              "takes any worker, and a job key would protect nothing", file=sys.stderr)
        return 2
    if args.tenant is not None:
        print(tenant_key(secret, args.tenant).hex())
        return 0
    print(key_for(secret, args.job, args.token).hex())
    return 0
