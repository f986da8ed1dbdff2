"""Cutting what a batch released into UDP GSO runs, the reference rules (``csrc/worker.c`` and
``csrc/switch.c`` are the production implementations, tested against these): a worker's queued
requests (``plan_runs``) and a switch's completed results (``plan_result_runs``), each run one
``sendmsg`` of equal-sized datagrams to one destination, one slice of the buffer when its rows
are consecutive, else gathered."""

from __future__ import annotations

__all__ = ["plan_result_runs", "plan_runs"]


def plan_runs(sendq, nq, sendlen, stride, shards, max_segments, max_bytes, order, runs):
    """Cut the queued lanes ``sendq[:nq]`` into UDP GSO runs; return how many.

    A run goes to one shard (lane ``i`` to shard ``i mod shards``), in queue order, and holds
    up to ``max_segments`` datagrams and ``max_bytes`` bytes of one size (the last may be
    shorter: the kernel allows a short last segment). ``runs[r] = (first, count, size,
    contiguous, shard)``: its lanes are ``sendq[order[first : first + count]]``; contiguous:
    they are consecutive lanes of full ``stride``-byte rows (but the last), so the run is one
    slice of the transmit buffer, ``txbuf[lane0 * stride : ...]``, sent with no gathering;
    otherwise its datagrams are gathered (one iovec each: under loss, results come back out
    of lane order, and a run of scattered lanes is still one system call)."""
    no = 0
    nr = 0
    for s in range(shards):
        r_first = -1
        r_count = 0
        r_size = 0
        r_contig = False
        prev = -1
        for q in range(nq):
            i = sendq[q]
            if i % shards != s:
                continue
            ln = sendlen[i]
            if r_count > 0:
                fits = (r_count < max_segments and (r_count + 1) * r_size <= max_bytes
                        and ln <= r_size)
                if fits:
                    if i != prev + 1:  # not the next row: the run gathers its datagrams
                        r_contig = False
                    order[no] = q
                    no += 1
                    r_count += 1
                    prev = i
                    if ln < r_size:  # a short segment ends the run
                        runs[nr, 0], runs[nr, 1], runs[nr, 2] = r_first, r_count, r_size
                        runs[nr, 3], runs[nr, 4] = r_contig, s
                        nr += 1
                        r_count = 0
                    continue
                runs[nr, 0], runs[nr, 1], runs[nr, 2] = r_first, r_count, r_size
                runs[nr, 3], runs[nr, 4] = r_contig, s
                nr += 1
                r_count = 0
            r_first = no
            order[no] = q
            no += 1
            r_count = 1
            r_size = ln
            r_contig = shards == 1 and ln == stride
            prev = i
        if r_count > 0:
            runs[nr, 0], runs[nr, 1], runs[nr, 2] = r_first, r_count, r_size
            runs[nr, 3], runs[nr, 4] = r_contig, s
            nr += 1
    return nr


def plan_result_runs(pend, n, stride, max_segments, max_bytes, runs):
    """Cut a job's completed rounds ``pend[:n]`` (rows ``(set, slot, length)``, in the order
    they completed) into UDP GSO runs; return how many.

    A run holds up to ``max_segments`` results and ``max_bytes`` bytes of one length (the last
    may be shorter). ``runs[r] = (first, count, size, contiguous)``: its results are
    ``pend[first : first + count]``; contiguous: consecutive slots of one set, full
    ``stride``-byte rows but the last, so the run is one slice of the set's buffers (the
    kernel reads it with no gathering); otherwise its results are gathered (under loss rounds
    complete out of slot order, and scattered results are still one system call). Every
    member gets the same runs (a multicast)."""
    nr = 0
    i = 0
    while i < n:
        size = pend[i, 2]
        contig = size == stride
        count = 1
        j = i + 1
        while j < n and count < max_segments and (count + 1) * size <= max_bytes:
            ln = pend[j, 2]
            if ln > size:
                break
            if contig and (pend[j, 0] != pend[j - 1, 0] or pend[j, 1] != pend[j - 1, 1] + 1):
                contig = False  # not the next slot: the run gathers its results
            count += 1
            j += 1
            if ln < size:  # a short result ends its run
                break
        runs[nr, 0], runs[nr, 1], runs[nr, 2], runs[nr, 3] = i, count, size, contig
        nr += 1
        i = j
    return nr
