"""Per-datagram loss before GRO: a tiny XDP program on the receiving end of a veth.

The testbed's nftables loss rules run after GRO, so with loss on GRO had to be off on every
veth end (a rule would otherwise drop a merged batch whole), and every lossy run paid for
receiving datagrams one by one, which real NICs (which merge with GRO whatever the loss) do
not: measured on the testbed, GRO took the switch at MTU 1500 from 35% to 52% of the line rate.
XDP runs in the veth's receive path before GRO, one wire frame at a time: this module builds a
program that drops an IPv4 frame with probability ``loss_rate`` (``bpf_get_prandom_u32``) and
passes everything else (ARP keeps working), loads it with the ``bpf`` system call, and pins it
in a private bpffs mount so that ``ip link set dev D xdpdrv pinned PATH`` can attach it inside
a namespace. Drops are counted by the kernel per veth (``ethtool -S``: ``xdp_drops``).

Linux only, root only; :func:`xdp_supported` says whether it works here (the testbed falls
back to the nftables rules and GRO off where it does not).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

__all__ = ["LossProgram", "loss_instructions", "xdp_supported"]

_SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)
_BPF_PROG_LOAD, _BPF_OBJ_PIN = 5, 6
_BPF_PROG_TYPE_XDP = 6
_BPF_F_XDP_HAS_FRAGS = 1 << 5
_XDP_DROP, _XDP_PASS = 1, 2
_FN_GET_PRANDOM_U32 = 7


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def loss_instructions(loss_rate: float) -> bytes:
    """The program: IPv4 frames dropped with probability ``loss_rate``, all else passed.

    ::

        r2 = ctx->data; r3 = ctx->data_end
        if r2 + 14 > r3: pass             # shorter than an Ethernet header
        if ethertype != 0x0800: pass      # ARP and the rest go through
        w0 = bpf_get_prandom_u32()
        if w0 >= threshold: pass          # unsigned: P(drop) = threshold / 2^32
        return XDP_DROP
        pass: return XDP_PASS
    """
    if not 0.0 < loss_rate < 1.0:
        raise ValueError(f"loss_rate must be in (0, 1), got {loss_rate}")
    threshold = min(int(round(loss_rate * 2**32)), 2**32 - 1)
    imm = threshold - 2**32 if threshold >= 2**31 else threshold  # the 32-bit pattern
    prog = [
        _insn(0x61, 2, 1, 0),          # r2 = *(u32 *)(r1 + 0)   data
        _insn(0x61, 3, 1, 4),          # r3 = *(u32 *)(r1 + 4)   data_end
        _insn(0xBF, 4, 2),             # r4 = r2
        _insn(0x07, 4, 0, 0, 14),      # r4 += 14
        _insn(0x2D, 4, 3, 6),          # if r4 > r3 goto pass (+6)
        _insn(0x69, 5, 2, 12),         # r5 = *(u16 *)(r2 + 12)  ethertype, as stored
        _insn(0x55, 5, 0, 4, 0x0008),  # if r5 != 0x0008 (0x0800 big-endian) goto pass (+4)
        _insn(0x85, 0, 0, 0, _FN_GET_PRANDOM_U32),  # call bpf_get_prandom_u32
        _insn(0x36, 0, 0, 2, imm),     # if w0 >= threshold (unsigned, 32 bit) goto pass (+2)
        _insn(0xB7, 0, 0, 0, _XDP_DROP),
        _insn(0x95),                   # exit
        _insn(0xB7, 0, 0, 0, _XDP_PASS),  # pass:
        _insn(0x95),                   # exit
    ]
    return b"".join(prog)


def _bpf(cmd: int, attr: bytes) -> int:
    if _SYS_BPF is None:
        raise OSError("the bpf system call number of this machine is unknown")
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    buf = ctypes.create_string_buffer(attr.ljust(128, b"\0"), 128)
    ret = libc.syscall(_SYS_BPF, cmd, buf, 128)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf({cmd}): {os.strerror(err)}")
    return int(ret)


def _load(prog: bytes) -> int:
    """Load ``prog`` as an XDP program that handles multi-buffer frames (jumbo MTUs on veth
    need it: it only reads the first buffer's Ethernet header), or, on kernels without that
    flag, as a plain one."""
    insns = ctypes.create_string_buffer(prog, len(prog))
    lic = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(4096)
    error: OSError | None = None
    for flags in (_BPF_F_XDP_HAS_FRAGS, 0):
        attr = struct.pack("<IIQQIIQII16s", _BPF_PROG_TYPE_XDP, len(prog) // 8,
                           ctypes.addressof(insns), ctypes.addressof(lic), 1, len(log),
                           ctypes.addressof(log), 0, flags, b"switchml_loss")
        try:
            return _bpf(_BPF_PROG_LOAD, attr)
        except OSError as exc:
            error = exc
    assert error is not None
    raise OSError(error.errno, f"{error.strerror}; verifier: "
                  f"{log.value.decode(errors='replace')[-500:]}")


class LossProgram:
    """The loss program for ``loss_rate``, loaded and pinned under a private bpffs mount
    (``path``); :meth:`close` unpins it and unmounts (programs stay attached to their
    devices until those go, with their namespaces). A context manager."""

    def __init__(self, loss_rate: float) -> None:
        self.loss_rate = loss_rate
        self._dir = Path(tempfile.mkdtemp(prefix="switchml-bpf-"))
        self._mounted = False
        fd = -1
        try:
            subprocess.run(["mount", "-t", "bpf", "bpf", str(self._dir)], check=True,
                           capture_output=True, text=True)
            self._mounted = True
            fd = _load(loss_instructions(loss_rate))
            self.path = self._dir / "loss"
            name = ctypes.create_string_buffer(str(self.path).encode())
            _bpf(_BPF_OBJ_PIN, struct.pack("<QI", ctypes.addressof(name), fd))
        except (OSError, subprocess.CalledProcessError):
            self.close()
            raise
        finally:
            if fd >= 0:
                os.close(fd)

    def attach_args(self, dev: str) -> list[str]:
        """``ip`` arguments that attach the program to ``dev`` (native veth XDP)."""
        return ["link", "set", "dev", dev, "xdpdrv", "pinned", str(self.path)]

    def close(self) -> None:
        """Unpin, unmount, remove the mount point. Idempotent."""
        if self._mounted:
            (self._dir / "loss").unlink(missing_ok=True)
            subprocess.run(["umount", str(self._dir)], capture_output=True)
            self._mounted = False
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LossProgram:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def xdp_supported() -> bool:
    """Whether the loss program loads here (root, a kernel with BPF, a bpffs to pin it)."""
    if os.geteuid() != 0 or _SYS_BPF is None or shutil.which("mount") is None:
        return False
    try:
        with LossProgram(0.5):
            return True
    except (OSError, subprocess.CalledProcessError):
        return False
