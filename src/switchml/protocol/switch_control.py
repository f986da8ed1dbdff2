"""The switch's control plane: JOIN (challenge, proof, job creation), LEAVE and KEEPALIVE.

Part of :class:`~switchml.protocol.switch.SwitchDataplane` (a base class of it, split off so
that the data plane's module stays readable): the rare messages that change who is in a job,
handled in plain Python datagram by datagram (``docs/protocol.md``, "Who may join"). A JOIN
counts only with a fresh cookie for its source address and a proof under the job key
(``protocol/auth.py``); a LEAVE proves the cookie its membership began with.
"""

from __future__ import annotations

import hmac
from collections import Counter, deque

from switchml.protocol import kernels as K
from switchml.protocol.address import Address, format_address
from switchml.protocol.auth import (
    Challenges,
    join_proof,
    key_for,
    leave_proof,
    seal_reply,
    tenant_of,
)
from switchml.protocol.config import SwitchConfig
from switchml.protocol.errors import WireError
from switchml.protocol.events import Event, JobCreated, JobRefused, MemberJoined
from switchml.protocol.jobs import Job, SlotAllocator
from switchml.protocol.wire import (
    AUTH_DATA,
    AUTH_TAG_SIZE,
    COOKIE_AT,
    COOKIE_SIZE,
    HEADER,
    HEADER_SIZE,
    INCARNATION_SIZE,
    JOIN_BYTES,
    MAGIC,
    MAX_DATAGRAM_BYTES,
    NO_COOKIE,
    VERSION,
    ControlInfo,
    Datagram,
    ElementType,
    Field,
    Header,
    MessageType,
    pack_challenge,
    pack_header,
    pack_joined,
    unpack_join,
    unpack_leave,
    unpack_payload,
)

__all__ = ["SwitchControl"]

_JOIN, _BYTES = int(MessageType.JOIN), int(ElementType.BYTES)
_HALF = 2**31
_MASK32 = 2**32 - 1


class SwitchControl:
    """JOIN, LEAVE and KEEPALIVE handlers of the switch (``SwitchDataplane``'s base class).

    Uses the switch's state: its jobs, allocator, challenges, output and event queues, drop
    counters; and two of its methods, ``remove_job`` and ``_unknown_job``.
    """

    config: SwitchConfig
    allocator: SlotAllocator
    challenges: Challenges
    challenges_sent: int
    _challenge_tokens: tuple[float, float]
    relayed_jobs: set[int]
    _jobs: dict[int, Job]
    _out: list[tuple[bytes | memoryview, Address]]
    _events: deque[Event]
    _drops: Counter[str]
    _membership: Counter[str]
    _removed: dict[int, float]
    _now: float

    def remove_job(self, job_id: int, reason: str) -> bool:
        raise NotImplementedError

    def _unknown_job(self, f: tuple, addr: Address) -> None:
        raise NotImplementedError

    def _reply_key(self, job_id: int, token: int) -> bytes:
        raise NotImplementedError

    def _refuse(self, h: Header, addr: Address, reason: str) -> None:
        """REFUSED, sealed, echoing the JOIN's ``seq`` (its epoch)."""
        self._drops["refused"] += 1
        self._events.append(JobRefused(h.job, h.rank, addr, reason))
        payload = reason.encode()[:1024]
        reply = Header(MessageType.REFUSED, h.job, rank=h.rank, token=h.token, seq=h.seq,
                       count=len(payload), elem=ElementType.BYTES)
        self._out.append((seal_reply(self._reply_key(h.job, h.token),
                                     pack_header(reply) + payload), addr))

    def _stranger_join(self, data: Datagram, addr: Address, now: float) -> bool:
        """The stateless part of a JOIN, from its raw bytes before anything is decoded (a
        stranger's JOIN costs the switch this and nothing more): one without a cookie is
        answered with a CHALLENGE, one whose cookie was not made here for this address a
        moment ago is dropped (``bad_cookie``, ``stale_cookie``: challenged again). True when
        that handled it; False for anything else (a JOIN with a fresh cookie of ours, or
        malformed: ``_handle_join`` and the strict decoder judge it)."""
        if len(data) != JOIN_BYTES:
            return False
        f = HEADER.unpack_from(data)
        if (f[Field.MAGIC] != MAGIC or f[Field.VERSION] != VERSION or f[Field.TYPE] != _JOIN
                or f[Field.FLAGS] or f[Field.SET] > 1 or f[Field.ELEM] != _BYTES):
            return False
        cookie = bytes(data[COOKIE_AT:COOKIE_AT + COOKIE_SIZE])
        job, token, rank = f[Field.JOB], f[Field.TOKEN], f[Field.RANK]
        if cookie != NO_COOKIE:
            problem = self.challenges.check(cookie, now, addr, job, rank)
            if problem is None:
                return False
            self._drops[problem] += 1
            if problem != "stale_cookie":  # a slow worker asks again; a replay gets nowhere
                return True
        self._challenge(job, token, rank, addr, now)
        return True

    def _handle_join(self, h: Header, data: Datagram, addr: Address,
                     now: float) -> None:
        """JOIN creates the job on first use (same token and geometry for every rank after),
        refreshes its lease (as KEEPALIVE does for idle workers), and carries in ``seq`` the
        first operation of the worker's epoch (raised after a switch restart).

        A JOIN without a cookie is answered with a CHALLENGE and changes nothing. A JOIN with
        one counts only if the cookie was made here, for this source address, a moment ago
        (else ``bad_cookie`` or ``stale_cookie``), and its proof verifies under the job key
        (else ``bad_proof``): a captured JOIN replayed from elsewhere, or later, changes
        nothing (``protocol/auth.py``)."""
        try:
            asked, cookie, proof = unpack_join(unpack_payload(data, h))
        except WireError as exc:
            self._drops[exc.reason] += 1
            return
        job = self._jobs.get(h.job)
        if cookie == NO_COOKIE:  # whatever the token: a live job id and an unused one look the
            self._challenge(h.job, h.token, h.rank, addr, now)  # same to whoever lacks it
            return
        if job is not None and h.token != job.token:
            self._wrong_token_join(h, asked, cookie, proof, addr, now)
            return
        key = self._verify_join(h, job, asked, cookie, proof, addr, now)
        if key is None:
            return
        if job is None:
            if h.rank >= asked.num_workers:  # refuse before allocating anything
                self._refuse(h, addr, f"rank {h.rank} outside job {h.job} of "
                             f"{asked.num_workers}")
                return
            job = self._create_job(h, asked, addr)
            if job is None:
                return
            job.incarnation = cookie[COOKIE_SIZE - INCARNATION_SIZE:]  # its MAC: new each time
            job.use_key(key)
        self._join_member(h, job, asked, cookie, addr, now)

    def _verify_join(self, h: Header, job: Job | None, asked: ControlInfo, cookie: bytes,
                     proof: bytes, addr: Address, now: float) -> bytes | None:
        """The job key, if the JOIN's cookie is fresh and unspent and its proof verifies;
        else None (dropped and counted, refused or challenged again where that helps)."""
        problem = self.challenges.check(cookie, now, addr, h.job, h.rank)
        if problem is not None:
            self._drops[problem] += 1
            if problem == "stale_cookie":  # a slow worker asks again; a replay gets nowhere
                self._challenge(h.job, h.token, h.rank, addr, now)
            return None
        if job is None:
            ended = self._removed.get(h.job)
        else:
            ended = job.left_at[h.rank] if h.rank < job.num_workers else None
        if ended is not None and self.challenges.issued_at(cookie) <= ended:
            # Proven, but asked for before this rank left (or the job ended): a JOIN replayed
            # from the member's own address within the cookie's lifetime.
            self._drops["spent_cookie"] += 1
            return None
        key = job.key if job is not None else key_for(self.config.secret, h.job, h.token)
        if not hmac.compare_digest(proof, join_proof(key, job=h.job, token=h.token,
                                                     rank=h.rank, seq=h.seq, info=asked,
                                                     cookie=cookie)):
            self._drops["bad_proof"] += 1
            self._refuse(h, addr, "the JOIN's proof does not verify: "
                         + ("the worker's secret (SWITCHML_SECRET) is not this switch's"
                            if self.config.secret is not None else
                            "this switch has no secret, but the worker used one "
                            "(unset SWITCHML_SECRET)"))
            return None
        return key

    def _wrong_token_join(self, h: Header, asked: ControlInfo, cookie: bytes, proof: bytes,
                          addr: Address, now: float) -> None:
        """A JOIN with a cookie for a live job id but another token: checked, and counted,
        as a JOIN that would create the job. Without the switch's secret its proof fails, and
        the answer is an unknown job's; with it, the job id is taken, and the REFUSED says so
        (a holder of the secret may create jobs, and needs another id)."""
        if self._verify_join(h, None, asked, cookie, proof, addr, now) is not None:
            self._refuse(h, addr, f"job {h.job} is in use with another token (draw a new "
                         "job id)")

    def _join_member(self, h: Header, job: Job, asked: ControlInfo, cookie: bytes,
                     addr: Address, now: float) -> None:
        """A proven JOIN of ``job``: check its geometry and rank, record the member (a new
        address only while the job has not started, or, in a quorum job, in place of the
        rank's old one: a replacement), raise the epoch, answer JOINED."""
        if (asked.num_workers, asked.window, asked.elements_per_packet, asked.quorum,
                asked.quorum_min, asked.deadline_us, asked.options) != (
                job.num_workers, job.window, job.elements_per_packet, job.quorum,
                job.quorum_min, job.deadline_us, job.info.options):
            self._refuse(h, addr, f"job {h.job} exists with n={job.num_workers} "
                         f"window={job.window} elements_per_packet={job.elements_per_packet} "
                         f"quorum={job.quorum or 'none'} (at {job.deadline_us} us: "
                         f"{job.quorum_min}){' auth_data' if job.auth else ''}; asked "
                         f"n={asked.num_workers} window={asked.window} elements_per_packet="
                         f"{asked.elements_per_packet} quorum={asked.quorum or 'none'} (at "
                         f"{asked.deadline_us} us: {asked.quorum_min})"
                         f"{' auth_data' if asked.options & AUTH_DATA else ''}")
            return
        if h.rank >= job.num_workers:
            self._refuse(h, addr, f"rank {h.rank} outside job {h.job} of {job.num_workers}")
            return
        old = job.members[h.rank]
        replaced = False
        if old != addr:
            if old is not None and job.started:
                if not job.quorum:
                    self._refuse(h, addr, f"rank {h.rank} of job {h.job} is joined from "
                                 f"{format_address(old)} and the job is running; a restarted "
                                 "worker cannot take over its state: start a new job (or give "
                                 "the job a quorum: a replacement can join one running)")
                    return
                # A quorum job's rounds go on without the rank: a replacement (its key proved
                # it) takes the rank's place from here, and the old address is dropped.
                replaced = True
                self._membership["members_replaced"] += 1
                # The old process's JOINs, replayed from its address, must not take the rank
                # back: cookies issued before this one are spent.
                job.left_at[h.rank] = self.challenges.issued_at(cookie) - 1e-6
            job.set_member(h.rank, addr)
            job.cookies[h.rank] = cookie  # the membership's cookie: its LEAVE proves it
            job.heard[h.rank] = now
            self._events.append(MemberJoined(job.job_id, h.rank, addr))
            self._membership["members_joined"] += 1
        if h.seq and not replaced and (job.min_seq is None
                                       or ((h.seq - job.min_seq) & _MASK32) < _HALF):
            job.min_seq = h.seq  # a new epoch: older requests are stale from now on
        job.last_seen = now
        self._out.append((seal_reply(job.key, pack_joined(
            job=h.job, token=h.token, rank=h.rank, shard=self.config.shard_index, info=job.info,
            cookie=job.cookies[h.rank], seq=h.seq, incarnation=job.incarnation)), addr))

    def _challenge(self, job: int, token: int, rank: int, addr: Address, now: float) -> None:
        """Answer a JOIN with a cookie for its source address (no state is kept), within the
        budget (``SwitchConfig.challenges_per_s``: a token bucket; beyond it the JOIN is
        dropped, ``challenge_budget``)."""
        rate = self.config.challenges_per_s
        if rate is not None:
            tokens, at = self._challenge_tokens
            tokens = min(rate, tokens + (now - at) * rate) if now > at else tokens
            if tokens < 1.0:
                self._challenge_tokens = (tokens, max(now, at))
                self._drops["challenge_budget"] += 1
                return
            self._challenge_tokens = (tokens - 1.0, max(now, at))
        self.challenges_sent += 1
        cookie = self.challenges.issue(now, addr, job, rank)
        self._out.append((pack_challenge(job=job, token=token, rank=rank,
                                         shard=self.config.shard_index, cookie=cookie), addr))

    def _job_problem(self, h: Header, asked: ControlInfo) -> str | None:
        """Why a new job of geometry ``asked`` cannot be created here, or None."""
        cfg = self.config
        problem = None
        if not 1 <= asked.num_workers <= cfg.max_workers:
            problem = f"num_workers must be in 1..{cfg.max_workers}, got {asked.num_workers}"
        elif not 1 <= asked.elements_per_packet <= cfg.max_elements_per_packet:
            problem = (f"elements_per_packet must be in 1..{cfg.max_elements_per_packet}, got "
                       f"{asked.elements_per_packet}")
        elif not 1 <= asked.window <= cfg.max_window:
            problem = f"window must be in 1..{cfg.max_window}, got {asked.window}"
        elif not 0 <= asked.quorum <= asked.num_workers:
            problem = f"quorum must be in 1..{asked.num_workers} (0: none), got {asked.quorum}"
        elif (asked.deadline_us > 0) != (asked.quorum > 0 and 1 <= asked.quorum_min
                                         <= asked.quorum):
            problem = (f"a quorum deadline needs a quorum and a minimum in 1..quorum; got "
                       f"quorum={asked.quorum}, minimum={asked.quorum_min}, deadline "
                       f"{asked.deadline_us} us")
        elif asked.quorum and h.job in self.relayed_jobs:
            problem = "a job relayed to a parent switch (a rack's) cannot have a quorum"
        elif asked.options & ~AUTH_DATA:
            problem = f"unknown job options 0x{asked.options:x} (this switch knows auth_data, 0x1)"
        elif asked.options & AUTH_DATA and (asked.quorum or h.job in self.relayed_jobs):
            problem = "an authenticated data plane (auth_data) has no quorum or parent switch yet"
        elif (asked.options & AUTH_DATA and HEADER_SIZE + 4 * asked.elements_per_packet
              + AUTH_TAG_SIZE > MAX_DATAGRAM_BYTES):
            problem = (f"an authenticated job's datagrams carry a {AUTH_TAG_SIZE}-byte MAC: "
                       f"elements_per_packet must be at most "
                       f"{(MAX_DATAGRAM_BYTES - HEADER_SIZE - AUTH_TAG_SIZE) // 4}")
        elif asked.options & AUTH_DATA and cfg.secret is None:
            problem = ("an authenticated data plane (auth_data) needs a switch with a secret: an "
                       "open switch's job keys derive from values any datagram shows")
        elif (tenant := tenant_of(h.job)) is not None and cfg.tenant_slots is not None:
            held = sum(j.window for j in self._jobs.values() if tenant_of(j.job_id) == tenant)
            if held + asked.window > cfg.tenant_slots:
                problem = (f"tenant {tenant} holds {held} slots in its other jobs; {asked.window} "
                           f"more would pass its quota of {cfg.tenant_slots}")
        return problem

    def _create_job(self, h: Header, asked: ControlInfo, addr: Address) -> Job | None:
        cfg = self.config
        problem = self._job_problem(h, asked)
        if problem is not None:
            self._refuse(h, addr, problem)
            return None
        base = self.allocator.allocate(asked.window)
        if base is None:
            self._refuse(h, addr, f"no room for job {h.job}: asked {asked.window} slots, the "
                         f"largest free range is {self.allocator.largest_free()} of a pool of "
                         f"{cfg.pool_slots}")
            return None
        try:
            job = Job(h.job, h.token, asked.num_workers, base, asked.window,
                      asked.elements_per_packet, [None] * asked.num_workers,
                      nack_log_windows=cfg.nack_log_windows,
                      member_timeout_s=cfg.member_timeout_s, quorum=asked.quorum,
                      history=cfg.quorum_history, quorum_min=asked.quorum_min,
                      deadline_us=asked.deadline_us, auth=bool(asked.options & AUTH_DATA))
            # NACKs assume every rank is in every round; a quorum job's late ranks are not, and
            # one rank's lost request stalls no round there: its loss recovery is the workers'
            # re-sends (RETRY), answered from the round, the shadow set or the slot's history.
            job.jobv[K.J.NACK_GAP] = job.jobv[K.J.NACK_BASE_GAP] = (
                0 if asked.quorum else self.config.nack_gap)
            job.jobv[K.J.NACK_CALM] = self.config.nack_calm
            job.jobv[K.J.LOG_AT_RELEASE] = int(h.job in self.relayed_jobs)
            job.jobv[K.J.SHARDS] = self.config.shard_count
        except MemoryError:
            self.allocator.release(base, asked.window)
            self._refuse(h, addr, f"no memory for job {h.job}")
            return None
        job.last_seen = self._now
        job.heard[:] = self._now  # silence counts from here
        self._jobs[h.job] = job
        self._events.append(JobCreated(h.job, job.num_workers, base, job.window,
                                       job.elements_per_packet))
        return job

    def _handle_leave(self, h: Header, data: Datagram,
                      addr: Address, now: float) -> None:
        """A member leaves, if its LEAVE comes from its address and proves the cookie its
        membership began with (else ``bad_leave``, and nothing changes); the job and its
        slots go when the last member has left. A LEAVE from a non-member, or for a job this
        switch does not hold (a retry whose LEFT was lost, or a stranger), is answered,
        changes nothing and is counted (``stray_leave``)."""
        try:
            proof = unpack_leave(unpack_payload(data, h))
        except WireError as exc:
            self._drops[exc.reason] += 1
            return
        job = self._jobs.get(h.job)
        if job is not None and h.token != job.token:
            self._drops["bad_token"] += 1  # answered as for an unknown job, changing nothing
        elif job is not None:
            if h.rank < job.num_workers and job.members[h.rank] == addr:
                cookie = job.cookies[h.rank]
                if cookie is None or not hmac.compare_digest(proof, leave_proof(
                        job.key, job=h.job, token=h.token, rank=h.rank, cookie=cookie)):
                    self._drops["bad_leave"] += 1
                    return
                job.set_member(h.rank, None)
                job.cookies[h.rank] = None
                job.left_at[h.rank] = now  # JOINs challenged before now are spent
                self._membership["members_left"] += 1
            else:
                self._drops["stray_leave"] += 1
            if all(m is None for m in job.members):
                self.remove_job(h.job, "left")
        else:
            self._drops["stray_leave"] += 1
        reply = Header(MessageType.LEFT, h.job, rank=h.rank, token=h.token,
                       chunk=self.config.shard_index)
        self._out.append((seal_reply(self._reply_key(h.job, h.token), pack_header(reply)),
                          addr))

    def _handle_keepalive(self, h: Header, data: Datagram,
                          addr: Address, now: float) -> None:
        """Renew the lease of a member's job; an unknown job is answered with UNKNOWN_JOB."""
        job = self._jobs.get(h.job)
        if job is None:
            self._drops["unknown_job"] += 1
            self._unknown_job(HEADER.unpack_from(data), addr)
            return
        if h.token != job.token:  # answered as an unknown job is (no live-job oracle)
            self._drops["bad_keepalive"] += 1
            self._unknown_job(HEADER.unpack_from(data), addr)
            return
        if h.rank >= job.num_workers:
            self._drops["bad_keepalive"] += 1
            return
        member = job.members[h.rank]
        if member is None:  # a member of an earlier incarnation of the job: rejoin
            self._drops["not_joined"] += 1
            self._unknown_job(HEADER.unpack_from(data), addr)
            return
        if member != addr:
            self._drops["bad_keepalive"] += 1
            return
        if not job.mac_ok(h.flags, data):  # an authenticated job's keep-alive carries its MAC
            self._drops["bad_mac"] += 1
            return
        job.last_seen = now
        job.heard[h.rank] = now

    def _admit(self, f: tuple, addr: Address, now: float, data: Datagram | None = None
               ) -> Job | None:
        """The isolation checks of a REQUEST (``f``: its header tuple), before it touches any
        slot: its job, token, rank, the address the rank joined from, and its epoch. Returns
        the job, or None when the request was dropped (and answered, where that helps).

        The kernel repeats the job, token, rank and epoch checks for the datagrams after the
        first of a buffer (a GRO buffer has one sender address, so one member check holds)."""
        rank, job_id, token, seq = f[Field.RANK], f[Field.JOB], f[Field.TOKEN], f[Field.SEQ]
        job = self._jobs.get(job_id)
        if job is None:
            self._drops["unknown_job"] += 1
            self._unknown_job(f, addr)
            return None
        if token != job.token:
            # Answered as an unknown job is: to whoever does not hold the token, a live job
            # id and an unused one look the same.
            self._drops["bad_token"] += 1
            self._unknown_job(f, addr)
            return None
        if rank >= job.num_workers:
            self._drops["bad_rank"] += 1
            return None
        if not job.mac_ok(f[Field.FLAGS], data):
            # An authenticated job's request answers nothing, and changes nothing, unless its
            # MAC verifies (the kernel checks it again for the datagrams after this one).
            self._drops["bad_mac"] += 1
            return None
        member = job.members[rank]
        if member != addr:
            if member is None:
                # Right token, but this rank has not joined this incarnation of the job (the
                # switch restarted, or its lease expired and another rank re-created it).
                self._drops["not_joined"] += 1
                self._unknown_job(f, addr)
            else:
                self._drops["wrong_source"] += 1
            return None
        min_seq = job.min_seq
        if min_seq is not None and ((seq - min_seq) & _MASK32) >= _HALF:
            self._drops["stale_epoch"] += 1  # from before a restart: tell it to catch up
            self._unknown_job(f, addr)
            return None
        job.last_seen = now
        job.heard[rank] = now
        job.started = True
        return job
