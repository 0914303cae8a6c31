"""DiLoCo: rare synchronization of pseudo-gradients, through any gradzip codec.

DiLoCo (Douillard et al., 2023) trains ``sync_every`` (H) inner steps locally on every
rank, then averages the parameter drift — the pseudo-gradient ``anchor - params`` —
and applies it to the anchor (the last synchronized weights, kept in fp32) with an
outer SGD step with Nesterov momentum; the new anchor becomes every rank's weights.
``outer="average"`` applies the plain mean (post-local SGD: outer SGD, lr 1, no
momentum), the control without the outer optimizer.

The pseudo-gradient crosses the link through a gradzip codec (``codec="int8"``,
``"ef | topk(ratio=0.01)"``, ...; ``None``: the fp32 all-reduce; a list: one codec per
fragment) and its own reduction
(``Reducer.reduce_mean`` on gradzip's private group), so link bytes are counted in
``CommStats`` exactly as for the hooks; error feedback and other codec state stay per
rank and are checkpointed. The model is not wrapped by DDP: nothing is communicated on
the inner steps. Initial weights are broadcast once from rank 0.

``fragments=F`` (Streaming DiLoCo, Douillard et al. 2025) splits the model's numbered
blocks (``blocks.0.``, ``layers.0.``, ...) into F groups of consecutive blocks, each with
its own anchor slice, outer optimizer and codec key, synchronized every H steps at
staggered offsets ``f * H // F``: the same bytes per step on average, but each exchange
is 1/F of the model (peak link use and the pause it costs drop F-fold). Parameters before
the first block (embeddings) go with fragment 0, those after the last with fragment F-1.

``overlap_steps=S`` (Streaming DiLoCo's overlap) starts a fragment's exchange and goes
on training: the reduction runs on a background thread (one, so every rank issues its
collectives in the same order; the inner steps communicate nothing; beside NCCL it
communicates over gloo, through the host: ``exchange_backend``) and is applied S
inner steps later: the outer step moves the anchor, and the fragment's weights become the
new anchor plus what the S local steps since the exchange began changed. With
``alpha`` (Streaming DiLoCo's mixing, 0.5 in the paper) they become ``alpha * local +
(1 - alpha) * anchor`` instead.

SparseLoCo (Sarfi et al., 2025) is this loop with ``outer_lr=1, outer_momentum=0`` and a
codec of error feedback with decay, chunked top-k and 2-bit values: its error feedback
replaces the outer momentum, so the outer step applies the decoded mean as it is.

``replicas`` (``gradzip.comm.ft.Replicas``, torchft; ``gradzip train --ft``): the ranks are
replica groups that may die and rejoin. Each synchronization is then a round of its own
quorum (``_ft_round``): the live groups agree on the fragment, exchange, and vote; a
round that failed anywhere here (a peer died mid-exchange) rolls back on this group: the
anchor and outer momentum stay, the error-feedback residual returns to its value before
the round, and the local weights return to the anchor. A group that comes back heals
from a live peer (anchor, outer optimizers, inner optimizer, step counts; its own
residual starts at zero) and sends a zero pseudo-gradient in that round, which the mean
leaves out. Overlap is not supported there (a round must commit before training goes on).

Use: ``outer = DiLoCo(model, opt, sync_every=32, codec="int8")`` after building the model
and its inner optimizer ``opt`` (optional: given, its state is in ``state_dict``);
call ``outer.step()`` after every inner optimizer step; evaluate inside
``with outer.synchronized_weights():``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradzip.aggregation.choose import forget_paths
from gradzip.codecs.chain import Codec
from gradzip.comm.communicator import HostCommunicator, TorchCommunicator
from gradzip.comm.ddp import build_codec
from gradzip.comm.groups import on_device, private_group
from gradzip.comm.reducer import Reducer
from gradzip.comm.replicas import inherit as replica_thread_start
from gradzip.comm.stats import CommStats
from gradzip.comm.streams import SideStreams

#: ``sparseloco`` is DiLoCo's loop with SparseLoCo's outer step (SGD, lr 1, no momentum)
#: and codec (``gradzip.comm.method.sparseloco_codec``)
OUTER_KINDS = ("diloco", "average", "sparseloco")


class DiLoCo:
    """Outer synchronization of ``model`` every ``sync_every`` inner steps."""

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer | None = None,
                 *, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True,
                 codec: str | Codec | None | Sequence[str | Codec | None] = None,
                 outer: str = "diloco",
                 process_group: dist.ProcessGroup | None = None, seed: int = 0,
                 nonfinite: str = "error", fragments: int = 1,
                 overlap_steps: int = 0, alpha: float | None = None,
                 replicas: Any = None, sync_ramp: int = 0) -> None:
        if replicas is not None:
            check_replica_options(overlap_steps)
        check_options(sync_every, outer_lr, outer_momentum, outer, fragments, overlap_steps,
                      alpha, sync_ramp)
        #: inner steps over which H grows from 1 to ``sync_every`` (0: H from the start)
        self.sync_ramp = sync_ramp
        self.alpha = alpha
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.fragments = fragment_indices([n for n, _ in named], fragments)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DiLoCo needs torch.distributed initialized")
        self.sync_every = sync_every
        self.offsets = [f * sync_every // fragments for f in range(fragments)]
        self.outer = outer
        self.params = [p for _, p in named]
        with on_device(model):  # NCCL's object exchange runs on the current device
            self.group = private_group(process_group)
            self.comm = self._exchange_communicator(process_group, overlap_steps)
            self._broadcast(model)
        self.anchor = [p.detach().float().clone() for p in self.params]
        lr, momentum = (1.0, 0.0) if outer == "average" else (outer_lr, outer_momentum)
        self.optimizers = [
            torch.optim.SGD([self.anchor[i] for i in idx], lr=lr, momentum=momentum,
                            nesterov=nesterov and momentum > 0) for idx in self.fragments]
        self.stats = CommStats()
        specs: list[Any] = list(codec) if isinstance(codec, list | tuple) else [codec]
        if len(specs) not in (1, fragments):
            raise ValueError(f"{len(specs)} codecs for {fragments} fragments: give one, or "
                             "one per fragment")
        #: one codec for every fragment (its state keyed by fragment), or one each
        self.codecs = [build_codec(c or "none", seed=seed, nonfinite=nonfinite)
                       for c in specs]
        self.reducers = [Reducer(c, self.stats) for c in self.codecs]
        self.inner_steps = 0
        self.syncs = 0  # since the run began (restored on resume)
        self.syncs_here = 0  # by this process: what ``stats`` covers
        self.inner_optimizer = inner_optimizer  # its state travels in ``state_dict``
        self.overlap_steps = overlap_steps
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="diloco-exchange",
                                         initializer=replica_thread_start())
                      if overlap_steps else None)
        self._streams = SideStreams()
        self._pending: list[_Exchange] = []  # started, not yet applied (start order)
        #: torchft's replica groups (``gradzip.comm.ft.Replicas``), or None
        self.replicas = replicas
        #: one entry per torchft round: step, committed, digests (``_ft_round``)
        self.rounds: list[dict[str, Any]] = []
        #: the job's progress beyond the model (the trainer's clock and evaluations): what
        #: to send a healing peer, and how to take a peer's (``share_job_progress``)
        self.job_progress: tuple[Callable[[], Any], Callable[[Any], None]] | None = None
        if replicas is not None:
            self.comm = replicas.communicator
            self._fresh_codecs = [c.state_dict() for c in self.codecs]
            replicas.register(self._heal_state, self._heal)

    def _exchange_communicator(self, process_group: dist.ProcessGroup | None,
                               overlap_steps: int) -> TorchCommunicator:
        """Where the pseudo-gradients travel: this group's own backend; with overlap
        beside NCCL, a gloo group of the same ranks through the host
        (``HostCommunicator``), since the exchange thread's collectives and the main
        thread's (logging, evaluation, checkpoints) would reach two NCCL communicators
        from two threads in a different order on each rank."""
        backend = group_backend(self.group)
        if exchange_backend(backend, overlap=overlap_steps > 0) != backend:
            return HostCommunicator(private_group(process_group, backend="gloo"))
        return TorchCommunicator(self.group)

    def _broadcast(self, model: nn.Module) -> None:
        """Every rank starts from rank 0's weights and buffers."""
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=src, group=self.group)

    def due(self, inner_steps: int) -> list[int]:
        """The fragments synchronized after inner step ``inner_steps`` (1-based): each
        every H steps from its offset (with ``sync_ramp``, H ramping up first:
        ``ramped_sync``). The schedule depends only on the step count, so a resumed run
        keeps it."""
        if self.sync_ramp:
            return [0] if ramped_sync(inner_steps, self.sync_every, self.sync_ramp) else []
        return [f for f, off in enumerate(self.offsets)
                if inner_steps >= max(off, 1) and (inner_steps - off) % self.sync_every == 0]

    def step(self) -> bool:
        """After an inner optimizer step: apply the exchanges that are due, then start
        (or, without overlap, run) those of the fragments now due. Returns whether any
        fragment's weights were synchronized."""
        self.inner_steps += 1
        applied = False
        while self._pending and self._pending[0].apply_at == self.inner_steps:
            self._apply(self._pending.pop(0))
            applied = True
        if self.replicas is not None:
            due = self.due(self.inner_steps)
            return bool(due) and self._ft_round(due)
        for f in self.due(self.inner_steps):
            if self._pool is None:
                self.synchronize(f)
                applied = True
            else:
                self._start(f)
        return applied

    @torch.no_grad()
    def synchronize(self, fragment: int = 0) -> None:
        """Average one fragment's pseudo-gradient through the codec, outer step on its
        anchor, which becomes its weights on every rank."""
        self._outer_step(fragment, self._exchange(fragment, self._pseudo(fragment)), None)

    def _params(self, fragment: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        idx = self.fragments[fragment]
        return [self.anchor[i] for i in idx], [self.params[i] for i in idx]

    def _pseudo(self, fragment: int) -> torch.Tensor:
        anchor, params = self._params(fragment)
        return torch.cat([(a - p.detach().float()).reshape(-1)
                          for a, p in zip(anchor, params, strict=True)])

    def _exchange(self, fragment: int, pseudo: torch.Tensor) -> torch.Tensor:
        """The ranks' mean pseudo-gradient of the fragment, through the codec."""
        key = "pseudo_gradient" if len(self.fragments) == 1 else f"pseudo_gradient.{fragment}"
        shapes = [p.shape for p in self._params(fragment)[1]]
        reducer = self.reducers[fragment if len(self.reducers) > 1 else 0]
        return reducer.reduce_mean(pseudo, key, self.comm, shapes=shapes)

    @torch.no_grad()
    def _outer_step(self, fragment: int, mean: torch.Tensor,
                    since: list[torch.Tensor] | None) -> None:
        """Outer step of the fragment's anchor with ``mean``; its weights become the new
        anchor (plus their change since ``since``, the weights when the exchange began),
        or with ``alpha`` the mix ``alpha * weights + (1 - alpha) * anchor``."""
        anchor, params = self._params(fragment)
        for a, g in zip(anchor, mean.split([a.numel() for a in anchor]), strict=True):
            a.grad = g.view_as(a)
        self.optimizers[fragment].step()
        for i, (a, p) in enumerate(zip(anchor, params, strict=True)):
            a.grad = None
            if self.alpha is not None:
                p.copy_(torch.lerp(a, p.float(), self.alpha))
            else:
                p.copy_(a if since is None else a + (p - since[i]))
        self.syncs += 1
        self.syncs_here += 1

    @torch.no_grad()
    def _start(self, fragment: int) -> None:
        assert self._pool is not None
        pseudo = self._pseudo(fragment)
        since = [p.detach().clone() for p in self._params(fragment)[1]]
        # on CUDA the exchange runs on a stream of its own, after the pseudo-gradient's
        # kernels (an event edge): the inner steps' stream never waits for NCCL
        event = self._streams.mark(pseudo)
        future = self._pool.submit(self._streams.run, partial(self._exchange, fragment, pseudo),
                                   pseudo.device, event)
        self._pending.append(_Exchange(fragment, self.inner_steps + self.overlap_steps,
                                       future, since))

    def _apply(self, ex: _Exchange) -> None:
        # the mean was allocated on gradzip's stream by the exchange thread
        self._outer_step(ex.fragment, self._streams.adopt(ex.future.result()), ex.since)

    # ------------------------------------------------------------ torchft rounds
    def join(self) -> None:
        """Under ``replicas``: a round that syncs nothing of this group's own, once at
        the start: the groups that start together align, and a group that comes back
        heals from a peer and takes part in the round its peers are in."""
        if self.replicas is not None:
            self._ft_round([])

    @torch.no_grad()
    def _ft_round(self, due: list[int]) -> bool:
        """One torchft round syncing ``due`` (this group's due fragment, or none): join
        the quorum, agree on the fragment, exchange, vote; outer step if the round
        commits, else roll back. Returns whether it committed a fragment."""
        from gradzip.comm.ft import RoundFailed

        before = [c.state_dict() for c in self.codecs]  # copies (CodecState.state_dict)
        t0, fragment, ok, healed = time.perf_counter(), -1, True, False
        mean: torch.Tensor | None = None
        try:
            info = self.replicas.begin_round()
            healed = info.healed
            fragment, contributors = self._agree(due, healed=healed)
            if fragment >= 0:
                for c in self.codecs:  # members may be new: every one agrees afresh
                    forget_paths(c)
                pseudo = self._pseudo(fragment)
                # the mean over the groups that sent a pseudo-gradient (not the healed)
                mean = self._exchange(fragment, pseudo) * (info.size / contributors)
        except RoundFailed as e:
            ok = False
            print(f"gradzip --ft: round {self.replicas.step + 1} failed on this replica "
                  f"group ({e}); rolling it back", file=sys.stderr, flush=True)
        committed = self.replicas.commit(ok)
        if committed and mean is not None:
            self._outer_step(fragment, mean, None)
        elif not committed:
            self._roll_back(before)
        meant = fragment if fragment >= 0 or not due else due[0]  # not agreed: its own
        self._log_round(meant, committed, before, time.perf_counter() - t0, healed)
        return committed and fragment >= 0

    def _agree(self, due: list[int], *, healed: bool) -> tuple[int, int]:
        """The round's fragment (-1: none) and how many groups contribute a
        pseudo-gradient (a group just healed has none; it sends zeros): one all-gather of
        (contributes, fragment, inner steps). A group that came back takes its peers'
        step count."""
        mine = torch.tensor([0.0 if healed else 1.0, float(due[0]) if due else -1.0,
                             float(self.inner_steps)], dtype=torch.float64)
        rows = torch.stack(self.comm.all_gather(mine))
        fragments = {int(f) for f in rows[:, 1].tolist() if f >= 0}
        if len(fragments) > 1:
            raise RuntimeError(f"replica groups disagree on the fragment to synchronize "
                               f"({sorted(fragments)}): their schedules differ (same "
                               "--sync-every and --fragments everywhere?)")
        self.inner_steps = int(rows[:, 2].max())
        return (fragments.pop() if fragments else -1), max(1, int(rows[:, 0].sum()))

    def _roll_back(self, before: list[dict[str, Any]]) -> None:
        """A failed round: the codec state (error-feedback residual) as it was before
        the round; the local weights back to the anchor (the round's local progress is
        lost, as in torchft's DiLoCo); the anchor and outer optimizers never moved."""
        for c, state in zip(self.codecs, before, strict=True):
            c.load_state_dict(state)
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params, strict=True):
                p.copy_(a)

    def _log_round(self, fragment: int, committed: bool, before: list[dict[str, Any]],
                   seconds: float, healed: bool) -> None:
        """What the round did here, with digests every group can compare: of the anchor
        and outer optimizers (equal on every group that committed the round) and of the
        codec state before and after (equal when the round rolled back)."""
        self.rounds.append({
            "round": self.replicas.step, "inner_steps": self.inner_steps, "time": time.time(),
            "fragment": fragment, "committed": committed, "healed": healed,
            "seconds": round(seconds, 4),
            "anchor_digest": self.outer_digest(),
            "codec_before": tensor_digest(before),
            "codec_after": tensor_digest([c.state_dict() for c in self.codecs])})

    def outer_digest(self) -> str:
        """A digest of the anchor and the outer optimizers' state (bit for bit)."""
        return tensor_digest([self.anchor, [o.state_dict()["state"] for o in self.optimizers]])

    def _heal_state(self) -> dict[str, Any]:
        """What a group that comes back takes from this one (torchft sends it)."""
        inner = {} if self.inner_optimizer is None else {
            "inner_optimizer": self.inner_optimizer.state_dict()}
        job = {} if self.job_progress is None else {"job": self.job_progress[0]()}
        return {"anchor": [a.clone() for a in self.anchor], "inner_steps": self.inner_steps,
                "syncs": self.syncs, "optimizers": [o.state_dict() for o in self.optimizers],
                **inner, **job}

    def _heal(self, sd: dict[str, Any]) -> None:
        """Become a live peer's copy: its anchor (also as the local weights), outer and
        inner optimizers, step counts and the job's progress; this group's codec state
        starts afresh (its residual was lost with it)."""
        with torch.no_grad():
            for a, p, saved in zip(self.anchor, self.params, sd["anchor"], strict=True):
                a.copy_(saved)
                p.copy_(saved)
        for opt, state in zip(self.optimizers, sd["optimizers"], strict=True):
            opt.load_state_dict(state)
        if self.inner_optimizer is not None and "inner_optimizer" in sd:
            self.inner_optimizer.load_state_dict(sd["inner_optimizer"])
        for c, state in zip(self.codecs, self._fresh_codecs, strict=True):
            c.load_state_dict(state)
        self.inner_steps, self.syncs = int(sd["inner_steps"]), int(sd["syncs"])
        if self.job_progress is not None and "job" in sd:
            self.job_progress[1](sd["job"])

    @contextlib.contextmanager
    def synchronized_weights(self) -> Iterator[None]:
        """The model holds the last synchronized weights (the anchor) inside."""
        local = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params, strict=True):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for saved, p in zip(local, self.params, strict=True):
                    p.copy_(saved)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: its local weights (ranks differ between syncs), the
        anchor, the outer optimizer, the codec's state and the step counts."""
        pending = [{"fragment": ex.fragment, "apply_at": ex.apply_at,
                    "mean": ex.future.result().clone(), "since": [t.clone() for t in ex.since]}
                   for ex in self._pending]  # waits for exchanges in flight
        inner = {} if self.inner_optimizer is None else {
            "inner_optimizer": self.inner_optimizer.state_dict()}
        return {"kind": "diloco", "inner_steps": self.inner_steps, "syncs": self.syncs,
                "pending": pending, **inner,
                "local": [p.detach().clone() for p in self.params],
                "anchor": [a.clone() for a in self.anchor], "fragments": len(self.fragments),
                "optimizers": [o.state_dict() for o in self.optimizers],
                **self._codec_states()}

    def _codec_states(self) -> dict[str, Any]:
        """``codec``: the one codec's state; ``codecs``: each fragment's."""
        if len(self.codecs) == 1:
            return {"codec": self.codecs[0].state_dict()}
        return {"codecs": [c.state_dict() for c in self.codecs]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") != "diloco":
            raise ValueError(f"this checkpoint's comm state is {sd.get('kind')!r}, not a "
                             "DiLoCo state: resume with the same --outer")
        if len(sd["anchor"]) != len(self.anchor):
            raise ValueError("the checkpoint's DiLoCo state is for another model")
        states = sd.get("optimizers", [sd.get("optimizer")])  # one, before fragments
        if len(states) != len(self.optimizers):
            raise ValueError(f"the checkpoint has {len(states)} DiLoCo fragment(s), this run "
                             f"{len(self.optimizers)}: resume with the same --fragments")
        with torch.no_grad():
            for a, saved in zip(self.anchor, sd["anchor"], strict=True):
                a.copy_(saved)
            for p, saved in zip(self.params, sd["local"], strict=True):
                p.copy_(saved)
        for opt, state in zip(self.optimizers, states, strict=True):
            opt.load_state_dict(state)
        states = sd["codecs"] if "codecs" in sd else [sd["codec"]]
        if len(states) != len(self.codecs):
            raise ValueError(f"the checkpoint has {len(states)} pseudo-gradient codec(s), this "
                             f"run {len(self.codecs)}: resume with the same --outer-codec")
        for c, state in zip(self.codecs, states, strict=True):
            c.load_state_dict(state)
        self.inner_steps, self.syncs = int(sd["inner_steps"]), int(sd["syncs"])
        if sd.get("pending") and self._pool is None:
            raise ValueError("the checkpoint has exchanges in flight (--overlap-steps): "
                             "resume with the same --overlap-steps")
        # a checkpoint loads on the CPU: an exchange in flight resumes beside the weights
        device = self.anchor[0].device
        self._pending = [_Exchange(e["fragment"], e["apply_at"], _done(e["mean"].to(device)),
                                   [t.to(device) for t in e["since"]])
                         for e in sd.get("pending", [])]
        if self.inner_optimizer is not None and "inner_optimizer" in sd:
            self.inner_optimizer.load_state_dict(sd["inner_optimizer"])

    def close(self) -> None:
        """Wait for exchanges in flight (their collectives must finish on every rank)
        and stop the exchange thread."""
        for ex in self._pending:
            ex.future.result()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.replicas is not None:
            self.replicas.close()


@dataclass
class _Exchange:
    """A fragment's exchange in flight: applied after inner step ``apply_at``."""

    fragment: int
    apply_at: int
    future: Future[torch.Tensor]
    since: list[torch.Tensor]  # the fragment's weights when it began


def tensor_digest(obj: Any) -> str:
    """sha256 of every tensor's bytes in ``obj`` (nested lists and dicts, in order): equal
    on two ranks exactly when they hold the same bits."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(x.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())
    walk(obj)
    return h.hexdigest()[:16]


def _done(mean: torch.Tensor) -> Future[torch.Tensor]:
    future: Future[torch.Tensor] = Future()
    future.set_result(mean)
    return future


def group_backend(group: dist.ProcessGroup) -> str:
    """``nccl`` where the group runs CUDA tensors on NCCL, else its backend's name: a
    group from ``init_process_group()`` without a backend, or ``"cpu:gloo,cuda:nccl"``,
    reports ``undefined`` from ``get_backend`` but has NCCL for CUDA tensors."""
    config = str(dist.get_backend_config(group))
    return "nccl" if "nccl" in config else dist.get_backend(group)


def exchange_backend(backend: str, overlap: bool = True) -> str:
    """The backend DiLoCo's exchanges run on, for a group on ``backend``: gloo when they
    overlap training beside NCCL (see ``DiLoCo._exchange_communicator``)."""
    return "gloo" if overlap and backend == "nccl" else backend


def check_replica_options(overlap_steps: int) -> None:
    """Clear errors for what DiLoCo cannot run over torchft's replica groups."""
    if overlap_steps:
        raise ValueError("--ft runs each synchronization as a round that commits or rolls "
                         "back before training goes on: drop --overlap-steps")


def ramped_sync(inner_steps: int, sync_every: int, ramp: int) -> bool:
    """Whether inner step ``inner_steps`` (1-based) ends with a synchronization when H
    ramps up over the first ``ramp`` steps: each interval after a synchronization at
    step t lasts ``max(1, min(H, round(H * t / ramp)))`` steps (1 at the start, as DDP
    does, then linearly longer), and H from the first synchronization at or after
    ``ramp`` on."""
    early, settled = _ramp_schedule(sync_every, ramp)
    if inner_steps < settled:
        return inner_steps in early
    return (inner_steps - settled) % sync_every == 0


@functools.cache
def _ramp_schedule(sync_every: int, ramp: int) -> tuple[frozenset[int], int]:
    """The synchronizations before the ramp ends, and the first one at or after it."""
    t, early = 0, set()
    while t < ramp:
        t += max(1, min(sync_every, round(sync_every * t / ramp)))
        early.add(t)
    return frozenset(early), t


def check_options(sync_every: int, outer_lr: float, outer_momentum: float, outer: str,
                  fragments: int = 1, overlap_steps: int = 0,
                  alpha: float | None = None, sync_ramp: int = 0) -> None:
    """Clear errors for values DiLoCo cannot run with (before any training)."""
    if sync_ramp < 0:
        raise ValueError(f"the ramp of H must be >= 0 inner steps, got {sync_ramp}")
    if sync_ramp and (fragments > 1 or overlap_steps):
        raise ValueError("a ramp of H (ramp=, --sync-ramp) needs one fragment and no "
                         "overlap: Streaming DiLoCo's staggered fragments keep a fixed H")
    if alpha is not None and not 0 <= alpha < 1:
        raise ValueError(f"alpha (the local weights' share after an outer step) must be in "
                         f"[0, 1), got {alpha}")
    if outer not in OUTER_KINDS:
        raise ValueError(f"outer must be one of {', '.join(OUTER_KINDS)}, got {outer!r}")
    if sync_every < 1:
        raise ValueError(f"sync_every (H) must be >= 1, got {sync_every}")
    if fragments < 1 or fragments > sync_every:
        raise ValueError(f"fragments must be in [1, sync_every={sync_every}] (each fragment "
                         f"needs its own step in the H-step cycle), got {fragments}")
    if not 0 <= overlap_steps < sync_every:
        raise ValueError(f"overlap_steps must be in [0, sync_every={sync_every}) (an exchange "
                         f"lands before the fragment's next one starts), got {overlap_steps}")
    if outer_lr <= 0 or not 0 <= outer_momentum < 1:
        raise ValueError(f"outer lr must be > 0 and outer momentum in [0, 1), got "
                         f"{outer_lr}, {outer_momentum}")


#: the numbered blocks of a model: ``blocks.3.``, ``layers.3.``, ``h.3.``, ``layer.3.``
_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers|layer|h)\.(\d+)\.")


def fragment_indices(names: list[str], fragments: int) -> list[list[int]]:
    """Indices (into ``names``) of each fragment's parameters: consecutive blocks, the
    same number per fragment; parameters outside the blocks join the nearest fragment."""
    if fragments == 1:
        return [list(range(len(names)))]
    blocks = [int(m.group(1)) if (m := _BLOCK.search(n)) else None for n in names]
    ids = sorted({b for b in blocks if b is not None})
    if not ids:
        raise ValueError("fragments > 1 needs a model with numbered blocks (parameters named "
                         "like 'blocks.0.…' or 'layers.0.…'); this model has none")
    if len(ids) % fragments:
        divisors = [d for d in range(1, len(ids) + 1) if len(ids) % d == 0]
        raise ValueError(f"fragments={fragments} does not divide the model's {len(ids)} "
                         f"blocks: choose one of {divisors}")
    per = len(ids) // fragments
    of_block = {b: i // per for i, b in enumerate(ids)}
    out: list[list[int]] = [[] for _ in range(fragments)]
    after_blocks = False
    for i, b in enumerate(blocks):
        if b is not None:
            after_blocks = True
        out[of_block[b] if b is not None else (fragments - 1 if after_blocks else 0)].append(i)
    return out
