"""Replicas that come and go: data-parallel training through a quorum job that a replacement
joins while it runs (docs/torch.md, "A replacement joins a running job").

Each rank is a replica group of its own, as torchft's are: its own ``torchrun`` (which restarts
it when it dies), DDP over a one-process gloo group (nothing collective in its constructor
reaches the other replicas), and :func:`live_hook` averaging every gradient bucket across the
replicas through one quorum job on the switch. A rank that dies holds nobody up: the others'
rounds complete with ``quorum`` ranks. Its replacement joins the job while it runs
(``WorkerClient(late_join=True)``), asks through a store every replica reaches for the live
state, and a live rank sends it, at its next step boundary, with its position in the job
(``WorkerClient.position``): the replacement resumes there and contributes from that step on.

Example (every replica, and each replacement with ``replacement=True``)::

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    store = dist.TCPStore(host, port, is_master=False)     # shared by the replicas
    live = LiveQuorum(store, rank, world, quorum=world - 1, replacement=restarted)
    model, opt = build()                                   # (the state arrives meanwhile)
    step = 0
    if live.state is not None:                             # a replacement: the live state
        model.load_state_dict(live.state["model"]); opt.load_state_dict(live.state["opt"])
        step = live.state["step"]
    ddp = DistributedDataParallel(model)
    live.register(ddp)                                     # live_hook, per bucket
    if live.state is not None:                             # DDP's buckets as the others'
        live.warm_up(lambda: loss_of(ddp, a_batch))
    while step < steps:
        ...forward, backward, opt.step()...
        step += 1
        live.serve(lambda: {"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step})
"""

# No ``from __future__ import annotations``: DDP checks a hook's annotations as objects.
import dataclasses
import datetime
import json
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from switchml import env
from switchml.control import decode_job_spec, encode_job_spec, new_job_spec
from switchml.links import WarningBudget
from switchml.protocol.address import Address, as_addresses, parse_addresses
from switchml.protocol.config import WorkerConfig
from switchml.protocol.errors import (
    ConfigError,
    LocalProtocolError,
    OperationFailed,
    RoundGone,
    SwitchMLError,
)
from switchml.protocol.worker_ahead import Position
from switchml.torch.failover import Failover, PendingOp, SwitchBack
from switchml.torch.live_state import (
    NONCE_BYTES,
    check_listener,
    receive_state,
    route_address,
    send_state,
)
from switchml.torch.staging import StagedTensor
from switchml.torch.works import complete_elsewhere, failable_future
from switchml.transport.udp import WorkerClient

__all__ = ["LiveQuorum", "live_hook"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _LiveOp(PendingOp):
    """A live job's all-reduce, as the failover holds it: with its staged tensor, which the
    switch path writes the average into (``LiveQuorum._through_switch``)."""

    staged: StagedTensor | None = None


class LiveQuorum:
    """One replica's part in a quorum job that replicas may join while it runs.

    Args:
        store: a ``torch.distributed.Store`` every replica reaches (a ``TCPStore``): the job's
            spec, replacements' requests and the state sent to them go through it.
        rank, world: this replica's rank and the number of replicas.
        quorum: a round completes with this many ranks (``JobSpec.quorum``).
        switch: the switch's address (or ``"HOST:PORT[,...]"``); default ``SWITCHML_SWITCH``.
            It must outlive any rank
            (an embedded switch dies with its rank), so one is required.
        replacement: this process replaces a rank of the running job: it joins late, asks for
            the live state, and finds it in :attr:`state`.
        timeout_s: an all-reduce without progress for this long fails; a replacement waits
            this long for the state; the others this long for rank 0's spec.
        prefix: the store keys' prefix (one per job sharing a store).
        state_host: the address a replacement (or a rank catching up) listens on for the
            state, which a live rank sends it over TCP; default this host's address on its
            route to the switch. The connection must prove the request's one-time nonce and
            ``state_secret``, and the stream's tag must verify under them.
        state_secret: the secret every replica shares (default ``SWITCHML_SECRET``): it
            proves the state's sender and the stream's integrity. Without one, a listener
            beyond loopback is refused (ConfigError) unless ``insecure``.
        insecure: listen beyond loopback with no secret (the nonce, which travels in the
            store, then proves the sender alone).
        keep_bytes: results a rank behind keeps for the steps it has not reached
            (``WorkerConfig.quorum_keep_bytes``); a rank further behind than this holds loses
            results it cannot get again, and fails after ``timeout_s``. Default 1 GiB: 26 of
            ncf's steps (9.6 M parameters), where a replacement resumes several steps behind.
        failover: ``"gloo"``: when the switch stops answering for ``timeout_s``, the live
            replicas go on over a gloo group of their own, with the same sums everywhere
            (``torch/failover.py``; docs/torch.md, "A live job whose switch dies"); ``"off"``:
            the all-reduce fails. Default ``SWITCHML_FAILOVER`` (off). Every replica must
            choose the same.
        failover_probe_s: while on gloo, how often the first of the living replicas tries
            to open a fresh job at the switch; once it can, they all go back to it. Default
            ``SWITCHML_FAILOVER_PROBE_S`` (10 s; 0: never).

    Raises:
        ConfigError: bad arguments, no switch, or a job in the store of another geometry.
        OperationFailed: the switch refused the JOIN, or no live rank sent the state in time.
    """

    def __init__(self, store: dist.Store, rank: int, world: int, quorum: int, *,
                 switch: str | Address | Sequence[Address] | None = None,
                 replacement: bool = False,
                 timeout_s: float = 60.0, window: int | None = None,
                 elements_per_packet: int | None = None, prefix: str = "switchml/live",
                 keep_bytes: int = 1 << 30, state_host: str | None = None,
                 state_secret: bytes | None = None, insecure: bool = False,
                 failover: str | None = None, failover_probe_s: float | None = None) -> None:
        if not 0 <= rank < world:
            raise ConfigError(f"rank must be in 0..{world - 1}, got {rank}")
        if not 1 <= quorum <= world:
            raise ConfigError(f"quorum must be in 1..{world}, got {quorum}")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        if isinstance(switch, str):
            switch = parse_addresses(switch, what="switch")
        switch = switch if switch is not None else env.switch_addresses()
        if switch is None:
            raise ConfigError("LiveQuorum needs a switch that outlives every rank: pass switch= "
                              "or set SWITCHML_SWITCH (an embedded switch dies with its rank)")
        self.store, self.rank, self.world, self.quorum = store, rank, world, quorum
        self.timeout_s, self.prefix = timeout_s, prefix
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        key = f"{prefix}/spec"
        # Where the job went back to the switch after a failover, if it did (``_back``): the
        # fresh job's spec and the failover's epoch.
        back: dict[str, Any] = (json.loads(store.get(f"{prefix}/back"))
                                if replacement and store.check([f"{prefix}/back"]) else {})
        if rank == 0 and not replacement:
            spec = new_job_spec(world, switch=switch, quorum=quorum, window=window,
                                elements_per_packet=elements_per_packet)
            store.set(key, encode_job_spec(spec))
        elif back:
            spec = decode_job_spec(back["spec"])
        else:
            spec = decode_job_spec(store.get(key).decode())
            if (spec.num_workers, spec.quorum) != (world, quorum):
                raise ConfigError(f"the store's job has {spec.num_workers} ranks and quorum "
                                  f"{spec.quorum}; this rank asked {world} and {quorum}")
        self.spec = spec
        if keep_bytes < 0:
            raise ConfigError(f"keep_bytes must be >= 0, got {keep_bytes}")
        failover = env.failover() if failover is None else failover
        if failover not in ("gloo", "off"):
            raise ConfigError(f"failover must be 'gloo' or 'off', got {failover!r}")
        host, port = as_addresses(switch)[0]
        self.state_host = state_host or route_address(socket.gethostbyname(host), port)
        self.state_secret = state_secret if state_secret is not None else env.secret()
        check_listener(self.state_host, self.state_secret, insecure=insecure)
        self._switch = switch
        self._config = WorkerConfig(op_timeout_s=timeout_s, join_timeout_s=timeout_s,
                                    secret=env.secret(), quorum_keep_bytes=keep_bytes)
        self.client = WorkerClient(switch, spec, rank, self._config, late_join=replacement)
        self._seen = 0  # replacements' requests looked at (``serve``)
        self.served = 0
        self.caught_up = 0  # ``catch_up``s that took a live rank's state
        self.skipped = 0  # steps taken from the others' sums without computing (``skip_step``)
        self.partial = 0  # all-reduces whose sum lacked some rank
        self.joined_after_s: float | None = None
        """A replacement: seconds from its JOIN to having the state and its position."""
        self._index: dict[int, int] = {}  # id of a parameter -> its place in the model
        self._layouts: dict[int, tuple[int, ...]] = {}  # DDP's buckets of the last whole step
        self._step_layouts: dict[int, tuple[int, ...]] = {}  # (this step's, so far)
        self._steps = 0  # steps ``serve`` closed with the hook's buckets
        self._expected: dict[int, tuple[int, ...]] | None = None  # a replacement: the donor's
        self._local = False  # ``warm_up``: the hook all-reduces nothing
        self._params: list[torch.nn.Parameter] = []
        self.refused = 0  # connections to the state listener that did not prove themselves
        self._warn = WarningBudget(log)
        self._state: dict[str, Any] | None = None
        self._receiving: threading.Thread | None = None
        self._receive_error: BaseException | None = None
        self._listener: socket.socket | None = None
        self.failover: Failover | None = None
        """Where the replicas go on over gloo when the switch dies (``failover="gloo"``)."""
        self._installed = False  # a fresh job was installed; its first operation not sent yet
        if failover == "gloo":
            keep = env.failover_keep_bytes()
            # A replacement takes part in switch-overs once it resumed (``number_from``), from
            # the epoch the job is in (``_back`` says where it went back to the switch).
            self.failover = Failover(
                store, rank, world, datetime.timedelta(seconds=timeout_s),
                keep_bytes=keep if keep is not None else 256 << 20,
                close_switch=lambda: self.client.close(), prefix=f"{prefix}/failover",
                roster=self._roster, stays=(RoundGone,), epoch=back.get("epoch", 0),
                back=self._back(), armed=not replacement,
                probe_s=env.failover_probe_s() if failover_probe_s is None
                else failover_probe_s)
        if replacement:  # asked now; received while the caller builds its model
            t0 = time.monotonic()
            try:
                listener, nonce = self._ask()
            except BaseException:
                self.client.close()
                raise

            def receive() -> None:
                try:
                    self._state = self._await_state(listener, nonce)
                    self.joined_after_s = time.monotonic() - t0
                except BaseException as exc:  # noqa: BLE001 - raised by ``state``
                    self._receive_error = exc
            self._receiving = threading.Thread(target=receive, name="switchml-live-state",
                                               daemon=True)
            self._receiving.start()

    @property
    def state(self) -> dict[str, Any] | None:
        """A replacement's state, as the live rank's ``serve`` sent it (None for a rank that
        is not a replacement). It is received in the background from the constructor on, so
        that the caller builds its model meanwhile; the first access waits for it.

        Raises:
            OperationFailed: no live rank sent it within ``timeout_s``, or what came was not
                a state (the rank then leaves the job; every later call raises it again).
        """
        self._wait_state()
        return self._state

    def _wait_state(self) -> None:
        """A replacement: wait for the state (every method that uses the job does first: an
        all-reduce before ``resume`` would be refused), and raise its failure, every time."""
        if self._receiving is not None:
            self._receiving.join()
            self._receiving = None
        if self._receive_error is not None:
            self.client.close()
            raise self._receive_error

    # -- a replacement ---------------------------------------------------------------------

    def _ask(self) -> tuple[socket.socket, bytes]:
        """Listen for the state on ``state_host`` and ask the live ranks for it through the
        store: the request names the listener and a one-time nonce the sender must open
        with."""
        nonce = os.urandom(NONCE_BYTES)
        listener = socket.create_server((self.state_host, 0),
                                        family=socket.AF_INET6 if ":" in self.state_host
                                        else socket.AF_INET)
        self._listener = listener
        try:
            self._post_request({"rank": self.rank, "nonce": nonce.hex(),
                                "host": self.state_host, "port": listener.getsockname()[1]})
        except BaseException:
            listener.close()
            raise
        return listener, nonce

    def _post_request(self, request: dict[str, Any]) -> None:
        """Put a request for the state in the store, numbered after the others."""
        number = self.store.add(f"{self.prefix}/joins", 1)
        self.store.set(f"{self.prefix}/join/{number}", json.dumps(request))

    def _await_state(self, listener: socket.socket, nonce: bytes) -> dict[str, Any]:
        """The state a live rank sends to ``listener``; resume at its position."""
        def refused(why: str) -> None:
            self.refused += 1
            self._warn.warn("rank %d: a connection to its state listener was refused: %s",
                            self.rank, why)
        extras: dict[str, Any] = {}
        try:
            with listener:
                position, layouts, state = receive_state(
                    listener, nonce, time.monotonic() + self.timeout_s,
                    secret=self.state_secret, refused=refused, on_position=self.client.pin,
                    extras=extras)
        except TimeoutError:
            raise OperationFailed(f"rank {self.rank} joined the running job, but no live rank "
                                  f"sent the state within {self.timeout_s:g} s (every live "
                                  f"rank calls serve() at its step boundaries, and must reach "
                                  f"{self.state_host}: LiveQuorum(state_host=))") from None
        except (ValueError, TypeError, AttributeError, RuntimeError, EOFError, OSError,
                pickle.UnpicklingError, MemoryError, LocalProtocolError) as exc:
            if self._listener is None:  # (``close`` stopped the listener)
                raise OperationFailed(f"rank {self.rank} closed while it waited for the "
                                      "state") from None
            raise OperationFailed(f"the state a live rank sent is not one: {exc}") from None
        finally:
            self._listener = None
        self._expected = layouts
        self.client.resume(position)  # (last: a state that does not load leaves no trace)
        if self.failover is not None:  # numbered as the sender numbers its next operation
            # (not from the position: the worker's sequence numbers jump where the job
            # rejoined a restarted switch, or went back to a fresh job)
            if "numbered" not in extras:
                self.client.close()
                raise OperationFailed("the live rank that sent the state has no failover; "
                                      "every replica must choose the same failover")
            self.failover.number_from(extras["numbered"])
        log.info("rank %d resumed the running job at operation %d", self.rank,
                 position.seqs[0])
        return state  # type: ignore[no-any-return]

    def _buckets(self) -> dict[int, tuple[int, ...]]:
        """DDP's buckets as the parameters' places, as they stay from its second step: this
        rank's, once ``serve`` closed two steps; a replacement's before then, the live
        replicas' (sent with the state); else none."""
        return self._layouts if self._steps >= 2 else (self._expected or {})

    def skip_step(self) -> bool:
        """At a step boundary, before the forward: if the others are past this rank's next
        step (results of a later all-reduce are here), every sum of that step is complete,
        and this rank's gradients would be left out of all of them. Then take the step's
        averaged gradients without computing any: each bucket's all-reduce runs on zeros
        (a complete round adds nothing; its result comes from what this rank was multicast)
        and the sums land in the parameters' ``.grad``; call the optimizer's ``step`` and go
        on. Returns False, doing nothing, when not that far behind (or before the first
        step: the buckets are not known yet). A straggler that skips the steps it is behind
        on stays within a step of the others, at no cost to them."""
        self._wait_state()
        buckets = self._buckets()
        if (not buckets or not self._params or self._failed_over()
                or self._ops_behind() <= len(buckets)):
            return False
        for index in sorted(buckets):  # (DDP launches its buckets in index order)
            params = [self._params[i] for i in buckets[index]]
            flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
            self.allreduce(flat)
            at = 0
            for p in params:
                p.grad = flat[at:at + p.numel()].view_as(p).to(p.dtype)
                at += p.numel()
        self.skipped += 1
        return True

    def catch_up(self, max_steps_behind: int) -> dict[str, Any] | None:
        """A straggler's remedy, at a step boundary: when the others are more than
        ``max_steps_behind`` steps ahead (as the results this rank kept show), take a live
        rank's state and position, as a replacement does, and skip the steps between. Returns
        that state (load it, and go on from its step), or None when not that far behind.
        What it costs the others: one live rank copies its state and streams it."""
        self._wait_state()
        per_step = len(self._buckets())
        if (not per_step or self._failed_over()
                or self._ops_behind() <= max_steps_behind * per_step):
            return None
        self.client.catch_up()
        try:
            try:
                asked = self._ask()
            except OSError as exc:  # (no listener on state_host, or the store failed)
                raise OperationFailed(f"could not ask for the state: {exc}") from None
            state = self._await_state(*asked)
        except OperationFailed as exc:
            raise OperationFailed(f"catch-up failed: {exc}; this rank keeps waiting for a "
                                  "position: close it and rejoin as a replacement") from None
        self.caught_up += 1
        return state

    # -- every live rank -------------------------------------------------------------------

    def serve(self, state: Callable[[], dict[str, Any]]) -> bool:
        """Call at every step boundary (every all-reduce of the step done: after DDP's
        backward and the optimizer's step). If a replacement asked for the live state, the
        first live rank to see the request sends it ``state()`` (tensors, numbers, dicts:
        what ``torch.load(weights_only=True)`` reads, e.g. the model's and optimizer's
        ``state_dict`` and the step) with this rank's position; a rank behind the others
        leaves it to one at the front. One store round trip when nobody
        asked. Returns whether this rank sent a state."""
        self._wait_state()
        if self._step_layouts:  # the step's buckets, as its hook saw them, replace the last
            self._layouts, self._step_layouts = self._step_layouts, {}
            self._steps += 1
        if self._failed_over():  # (no switch job to join: a replacement's request times out)
            return False
        asked = self.store.add(f"{self.prefix}/joins", 0)
        if self._seen >= asked:
            return False
        if self._ops_behind():
            # Behind the others (results of its next all-reduce are here): a replacement
            # starting here would have to fetch rounds that completed before it joined from
            # the switch's history, which may have moved on. A rank at the front serves it:
            # every result of its next all-reduces is multicast after the request, so after
            # the replacement joined.
            return False
        if self._steps < 2:
            return False  # (DDP lays its buckets out for good at its second step)
        sent = False
        while self._seen < asked:
            n = self._seen + 1
            if not self.store.check([f"{self.prefix}/join/{n}"]):
                break  # counted, not yet written (or its writer died): look again next step
            self._seen = n
            mine = str(self.rank).encode()
            if self.store.compare_set(f"{self.prefix}/claim/{n}", b"", mine) != mine:
                continue  # another live rank serves it
            try:
                asked_by = json.loads(self.store.get(f"{self.prefix}/join/{n}"))
                who, nonce = int(asked_by["rank"]), bytes.fromhex(asked_by["nonce"])
                address = (str(asked_by["host"]), int(asked_by["port"]))
                position = self.client.position()
                numbered = self.failover.numbered if self.failover is not None else None
                # A copy now, on the CPU (tens of milliseconds), streamed on a thread of its
                # own: the others' rounds wait for this rank only while it copies.
                snapshot = tree_map(lambda t: t.detach().to("cpu", copy=True)
                                    if isinstance(t, torch.Tensor) else t, state())
            except Exception as exc:  # noqa: BLE001 - a bad request must not stop training
                log.warning("rank %d could not serve request %d: %s", self.rank, n, exc)
                continue
            threading.Thread(target=self._send_state, name="switchml-live-serve", daemon=True,
                             args=(address, nonce, who, position, dict(self._layouts),
                                   snapshot, asked_by, numbered)).start()
            self.served += 1
            sent = True
        return sent

    def _send_state(self, address: tuple[str, int], nonce: bytes, who: int,
                    position: Position, layouts: dict[int, tuple[int, ...]],
                    snapshot: dict[str, Any], request: dict[str, Any],
                    numbered: int | None) -> None:
        t0 = time.monotonic()
        try:
            sent = send_state(address, nonce, position, layouts, snapshot,
                              timeout_s=self.timeout_s, secret=self.state_secret,
                              numbered=numbered)
            log.info("rank %d sent the live state to a replacement of rank %d at %s:%d (%.1f "
                     "MB in %.2f s)", self.rank, who, *address, sent / 1e6,
                     time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 - asked again, or the replacement times out
            tries = int(request.get("tries", 0)) + 1
            log.warning("rank %d could not send the state to rank %d at %s:%d (try %d of %d): "
                        "%s", self.rank, who, *address, tries, self.SEND_TRIES, exc)
            if tries < self.SEND_TRIES:  # a new request: a live rank serves it at its next step
                try:
                    self._post_request({**request, "tries": tries})
                except Exception as again:  # noqa: BLE001 - the replacement times out
                    log.warning("rank %d could not ask again for rank %d: %s", self.rank, who,
                                again)

    SEND_TRIES = 3
    """How many live ranks' sends a replacement's request gets before it is left to time out."""

    def register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register :func:`live_hook` on ``ddp`` (a DDP over this replica's own one-process
        group). The hook notes how DDP laid its buckets out, which a replacement must match
        (``warm_up``)."""
        self._wait_state()
        self._params = list(ddp.module.parameters())
        self._index = {id(p): i for i, p in enumerate(self._params)}
        ddp.register_comm_hook(self, live_hook)

    def warm_up(self, run: Callable[[], torch.Tensor]) -> None:
        """A replacement, before its first step: one forward and backward through the DDP
        model (``run()`` returns a loss) that all-reduces nothing, after which the gradients
        are dropped. DDP lays its buckets out in parameter order at its first step and in the
        order gradients became ready from its second: the live replicas did their first step
        together long ago, and a replacement's first all-reduce must have their layout (the
        hook refuses another rather than sum mismatched gradients)."""
        if not self._index:
            raise ConfigError("warm_up needs the DDP model registered first (live.register)")
        self._local = True
        try:
            loss = run()
            loss.backward()
        finally:
            self._local = False
        for p in self._params:
            p.grad = None

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` (float32, CPU) across the replicas, in place: each element is
        divided by the ranks its sum holds. Returns it."""
        self._wait_state()
        staged = StagedTensor(tensor, dtype=torch.float32)
        box: list[BaseException | None] = []
        finished = threading.Event()

        def done(error: BaseException | None) -> None:
            box.append(error)
            finished.set()

        self._submit(staged, done)
        finished.wait()
        if box[0] is not None:
            raise box[0]
        return tensor

    def _submit(self, staged: StagedTensor, done: Callable[[BaseException | None], None]
                ) -> None:
        """Average ``staged`` across the replicas: through the switch, or over gloo once the
        replicas switched over (``failover``); written back into the caller's tensor, then
        ``done(None)``, or ``done(error)`` (its tensor as it was)."""
        fo = self.failover
        if fo is None:
            h = self.client.allreduce_async(staged.array, staged.array)
            h.add_done_callback(lambda h: done(self._settle(staged, h)))
            return
        seq, to_switch = fo.issue()

        def op_done(error: BaseException | None) -> None:
            if error is None:  # (over gloo, or a peer's copy: the values are in ``staged``)
                try:
                    staged.finish(self.world, False)
                except Exception as exc:  # noqa: BLE001 - surfaced through ``done``
                    error = exc
            done(error)

        op = _LiveOp(seq, [staged.flat], True, op_done, staged=staged)
        if not to_switch:  # switched over: gloo, in order
            fo.take(op)
            return
        try:
            self._through_switch(op)
        except SwitchMLError as exc:  # (the client closed under us: a switch-over)
            if not fo.failed(op, exc):
                raise

    def _through_switch(self, op: "_LiveOp") -> None:
        """``op`` through the switch job; its result kept for the failover's hand-over.

        Raises:
            SwitchMLError: the client refused it (closed).
        """
        fo = self.failover
        assert fo is not None and op.staged is not None
        staged = op.staged
        h = self.client.allreduce_async(staged.array, staged.array)

        def settled(h: Any) -> None:
            kept: list[torch.Tensor] = []
            error = self._settle(staged, h, kept)
            if error is None:
                fo.completed(op.seq, kept)
                op.done(None)
            elif not fo.failed(op, error):
                op.done(error)

        h.add_done_callback(settled)

    def _back(self) -> SwitchBack:
        """How the replicas on gloo go back to the switch (``Failover(back=)``): the first of
        them opens a fresh job like this one at the switch; the others join it; each installs
        it, and the operations from then on go through it. The store then names the fresh
        job and the failover's epoch, for replacements to come (which number their operations
        as the live rank that sends them the state)."""
        def open_job(text: str | None) -> tuple[WorkerClient, str]:
            fo = self.failover
            if text is None and fo is not None and fo.size < self.quorum:
                raise OperationFailed(f"{fo.size} live replicas, fewer than the quorum of "
                                      f"{self.quorum}: a fresh job would never complete a "
                                      "round; staying on gloo")
            spec = decode_job_spec(text) if text else new_job_spec(
                self.world, switch=self._switch, quorum=self.quorum, window=self.spec.window,
                elements_per_packet=self.spec.elements_per_packet)
            probe = dataclasses.replace(self._config,
                                        join_timeout_s=min(self.timeout_s, 2.0))
            return WorkerClient(self._switch, spec, self.rank, probe), encode_job_spec(spec)

        def install(client: WorkerClient) -> None:
            self.client, self.spec, self._installed = client, client.spec, True

        def submit(op: PendingOp) -> None:
            assert isinstance(op, _LiveOp)
            fo = self.failover
            assert fo is not None
            if self._installed:  # the fresh job's first operation: name the job, at once
                self._installed = False
                self.store.set(f"{self.prefix}/back", json.dumps(
                    {"spec": encode_job_spec(self.spec), "epoch": fo.epoch}))
            try:
                self._through_switch(op)
            except SwitchMLError as exc:  # (refused: the failover takes it, or it fails)
                if not fo.failed(op, exc):
                    op.done(exc)

        return SwitchBack(probe=lambda: open_job(None), join=lambda text: open_job(text)[0],
                          install=install, submit=submit, close=lambda c: c.close())

    def _ops_behind(self) -> int:
        """``client.ops_behind()``; 0 once the client closed for a switch-over (the failover
        is active by then), which can happen between the caller's check and this."""
        try:
            return self.client.ops_behind()
        except SwitchMLError:
            if self._failed_over():
                return 0
            raise

    def _settle(self, staged: StagedTensor, handle: Any,
                kept: list[torch.Tensor] | None = None) -> BaseException | None:
        """A switch all-reduce is done: write its average back (each element divided by the
        ranks its sum holds; with ``kept``, a copy of it appended there, for the failover).
        Returns its error, or the write-back's."""
        error = handle.exception()
        if error is not None:
            return error
        try:
            counts = handle.contributors
            if counts is not None and counts.size and int(np.min(counts)) < self.world:
                self.partial += 1
            final = staged.finish(self.world, True, counts, handle.block,
                                  keep=kept is not None)
            if kept is not None and final is not None:
                kept.append(final)
        except Exception as exc:  # noqa: BLE001 - surfaced by the caller
            return exc
        return None

    def _roster(self, epoch: int, reason: str) -> tuple[int, int]:
        """The failover's roster (``Failover(roster=)``): the live replicas that go on over
        gloo, agreed through the store. Each says it is alive; once every rank of the job
        did, or ``timeout_s`` after this one did (a dead rank never will), the first to look
        writes the list, and every one takes it. Returns this rank's place in it and its
        length.

        Raises:
            OperationFailed: this rank came after the list was written.
        """
        key = f"{self.prefix}/failover/roster/{epoch}"
        self.store.set(f"{key}/alive/{self.rank}", b"1")
        count = self.store.add(f"{key}/count", 1)
        end = time.monotonic() + self.timeout_s
        while count < self.world and time.monotonic() < end:
            if self.store.check([f"{key}/list"]):
                break  # written already
            time.sleep(0.05)
            count = self.store.add(f"{key}/count", 0)
        alive = [r for r in range(self.world) if self.store.check([f"{key}/alive/{r}"])]
        members = json.loads(self.store.compare_set(f"{key}/list", b"",
                                                    json.dumps(alive).encode()))
        if self.rank not in members:
            raise OperationFailed(f"rank {self.rank} came too late to go on over gloo with the "
                                  f"live replicas {members} ({reason})")
        log.warning("rank %d: the switch is gone (%s); the live replicas %s go on over gloo",
                    self.rank, reason, members)
        return members.index(self.rank), len(members)

    def _failed_over(self) -> bool:
        """Whether the replicas went on over gloo: no switch job to serve, skip or catch up
        in from then on."""
        return self.failover is not None and self.failover.active

    def stats(self) -> dict[str, Any]:
        """This rank's worker counters, the states it served and its partial sums (and the
        failover's counters, with ``failover="gloo"``)."""
        out = {**self.client.counters, "states_served": self.served,
               "caught_up": self.caught_up, "steps_skipped": self.skipped,
               "allreduce_partial": self.partial, "joined_after_s": self.joined_after_s,
               "state_connections_refused": self.refused}
        if self.failover is not None:
            out["failover"] = self.failover.stats()
        return out

    def close(self) -> None:
        """Leave the job (a replacement still waiting for the state stops listening)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        if self._receiving is not None:
            self._receiving.join(self.timeout_s)
        if self.failover is not None:
            self.failover.close()
        self.client.close()


def live_hook(state: "LiveQuorum", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average a gradient bucket across the replicas through
    ``state``'s quorum job (each element divided by the ranks its sum holds). Register it on
    a DDP over this replica's own one-process group with ``live.register(ddp)``."""
    buffer = bucket.buffer()
    completer, future = failable_future()
    if state._local:  # (``warm_up``)
        completer.set_result(buffer)
        return future
    layout = tuple(state._index.get(id(p), -1) for p in bucket.parameters())
    expected = state._expected.get(bucket.index()) if state._expected is not None else None
    if expected is not None and expected != layout:
        completer.set_result(RuntimeError(
            f"switchml live hook: DDP's bucket {bucket.index()} holds parameters {layout[:8]}"
            f"..., the live replicas' {expected[:8]}...: a replacement's DDP lays its buckets "
            "out as the others' only from its second step (call live.warm_up before the "
            "first)"))
        return future
    state._step_layouts[bucket.index()] = layout
    staged = StagedTensor(buffer, dtype=torch.float32)

    def done(error: BaseException | None) -> None:
        complete_elsewhere(completer, buffer if error is None
                           else RuntimeError(f"switchml live hook failed: {error}"))

    try:
        state._submit(staged, done)
    except Exception as exc:  # noqa: BLE001 - refused: DDP hears of it through the future
        done(exc)
    return future
