"""The one seam to torchft: replica groups that may die and rejoin (``gradzip train --ft``).

torchft (PyPI ``torchft``, the ``ft`` extra) runs a Lighthouse that forms a quorum of the
live replica groups, a ``Manager`` per group that joins each quorum, votes on whether a
round commits, and heals a group that fell behind from a live peer (its state over HTTP),
and a process group that it reconfigures for every new quorum. Nothing else in gradzip
imports torchft: DiLoCo (``gradzip.comm.outer``) sees only ``Replicas`` (one round at a
time: ``begin_round``, the ``communicator`` the round's collectives run on, ``commit``)
and ``RoundFailed``; without torchft installed everything else works as before.

A replica group is one process here (its world of one rank), so a quorum of N groups is
a gloo group of N processes. The environment carries the job (set by ``gradzip train
--ft``, or by hand on several machines, see the README):

- ``GRADZIP_FT_LIGHTHOUSE``: the Lighthouse's address (``http://host:port``);
- ``GRADZIP_FT_REPLICA`` / ``GRADZIP_FT_REPLICAS``: this group's index, and how many;
- ``GRADZIP_FT_HOST``: the address other groups reach this one at (default: 127.0.0.1
  when the Lighthouse is on this machine, else this host's name);
- ``GRADZIP_FT_TIMEOUT``: seconds a collective or a commit vote may take (default 60).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from gradzip.collectives.communicator import Communicator
from gradzip.collectives.linkmodel import backend_model

INSTALL_HINT = ("--ft needs torchft (torch >= 2.7): pip install torchft (in a checkout: "
                "pip install -e '.[ft]')")
ENV_LIGHTHOUSE = "GRADZIP_FT_LIGHTHOUSE"
ENV_REPLICA = "GRADZIP_FT_REPLICA"
ENV_REPLICAS = "GRADZIP_FT_REPLICAS"
ENV_HOST = "GRADZIP_FT_HOST"
ENV_TIMEOUT = "GRADZIP_FT_TIMEOUT"
#: test-only: ``REPLICA@ROUND`` makes that replica die inside that round: the quorum
#: formed and the round's header exchanged, its peers encoding (their error feedback
#: updated) and sending their payloads, but its own never sent
ENV_DIE_IN_ROUND = "GRADZIP_FT_DIE_IN_ROUND"


def torchft_available() -> bool:
    try:
        import torchft  # noqa: F401
    except ImportError:
        return False
    return True


def require_torchft() -> None:
    """Raise a clear error saying how to install torchft, if it is missing."""
    if not torchft_available():
        raise RuntimeError(INSTALL_HINT)


class RoundFailed(RuntimeError):
    """A collective of this round failed (a peer died or a link broke): the round rolls
    back on this replica, and its commit vote is no."""


class Lighthouse:
    """A torchft Lighthouse in this process: forms each round's quorum of the groups
    that asked for one. Listens on ``bind`` (localhost by default).

    ``min_replicas`` groups are needed for a quorum; ``join_ms`` is how long it waits
    for groups that are alive but late; a group that sent no heartbeat for
    ``heartbeat_ms`` is dead to it.
    """

    def __init__(self, bind: str = "127.0.0.1:0", *, min_replicas: int = 1,
                 join_ms: int = 2000, heartbeat_ms: int = 2000) -> None:
        require_torchft()
        from torchft._torchft import LighthouseServer

        self.server = LighthouseServer(bind=bind, min_replicas=min_replicas,
                                       join_timeout_ms=join_ms,
                                       heartbeat_timeout_ms=heartbeat_ms)

    @property
    def address(self) -> str:
        return str(self.server.address())

    def close(self) -> None:
        self.server.shutdown()


@dataclass(frozen=True)
class FtJob:
    """This process's place in a torchft job, from the environment."""

    lighthouse: str
    replica: int
    replicas: int
    host: str
    timeout_s: float

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FtJob | None:
        env = os.environ if environ is None else environ
        if ENV_LIGHTHOUSE not in env:
            return None
        lighthouse = env[ENV_LIGHTHOUSE]
        local = any(h in lighthouse for h in ("127.0.0.1", "localhost", "[::1]"))
        host = env.get(ENV_HOST) or ("127.0.0.1" if local else socket.getfqdn())
        job = cls(lighthouse, int(env.get(ENV_REPLICA, "0")), int(env.get(ENV_REPLICAS, "1")),
                  host, float(env.get(ENV_TIMEOUT, "60")))
        if not 0 <= job.replica < job.replicas:
            raise ValueError(f"{ENV_REPLICA}={job.replica} must be in [0, {job.replicas})")
        return job

    def environ(self) -> dict[str, str]:
        """The variables that make a child process this job's replica."""
        return {ENV_LIGHTHOUSE: self.lighthouse, ENV_REPLICA: str(self.replica),
                ENV_REPLICAS: str(self.replicas), ENV_HOST: self.host,
                ENV_TIMEOUT: str(self.timeout_s)}


def die_in_round(replica: int, environ: Mapping[str, str] | None = None) -> int | None:
    """The round (1-based, of the rounds this process began) in which
    ``ENV_DIE_IN_ROUND`` makes ``replica`` die in this start of it: its i-th entry for
    ``replica`` in the i-th start (``TORCHELASTIC_RESTART_COUNT``, as the kills)."""
    env = os.environ if environ is None else environ
    mine = [int(at) for who, _, at in (item.partition("@") for item in
                                       env.get(ENV_DIE_IN_ROUND, "").split(",") if item)
            if int(who) == replica]
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return mine[attempt] if attempt < len(mine) else None


@dataclass
class RoundInfo:
    """What a quorum said to this replica: its rank among the round's ``size`` groups,
    and whether it was just healed from a peer (its state replaced by theirs)."""

    rank: int
    size: int
    healed: bool


class FtCommunicator(Communicator):
    """The codec ``Communicator`` over torchft's reconfigurable gloo group: the rank and
    size are the current quorum's. A failed collective reports the error to the manager
    (the replica's commit vote becomes no) and raises ``RoundFailed``."""

    def __init__(self, pg: Any, manager: Any) -> None:
        super().__init__(0, 1)
        self.pg, self.manager = pg, manager
        self.counter.backend = backend_model("gloo")
        #: what the Reducer reads of a ``TorchCommunicator``: no CUDA events here (gloo
        #: through the host: every collective is timed on the host clock)
        self.events: list[tuple[str, Any, Any]] = []
        self.calls = 0  # collectives this round (``set_quorum`` starts a round)
        self.die_at_call: int | None = None  # ENV_DIE_IN_ROUND

    def on_events(self, t: torch.Tensor) -> bool:
        return False

    def set_quorum(self, rank: int, size: int) -> None:
        self.rank, self.world_size = rank, size
        self.counter.world_size = size
        self.calls = 0

    def _issue(self) -> None:
        """Before each collective: count it (and die where ENV_DIE_IN_ROUND says)."""
        self.calls += 1
        if self.calls == self.die_at_call:
            os._exit(9)  # gone mid-round: sockets closed, no clean-up

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except Exception as e:  # gloo: connection reset, closed, timed out
            self.manager.report_error(e)
            raise RoundFailed(f"a collective of this round failed: {e}") from e

    def _all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        self._issue()
        out = t.detach().clone(memory_format=torch.contiguous_format)
        opts = AllreduceOptions()
        opts.reduceOp = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX,  # type: ignore[assignment]
                         "min": ReduceOp.MIN}[op]
        self._wait(self.pg.allreduce([out], opts))
        return out

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        from torch.distributed.distributed_c10d import AllgatherOptions

        self._issue()
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._wait(self.pg.allgather([out], [t], AllgatherOptions()))
        return out

    def _all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        from torch.distributed.distributed_c10d import AllToAllOptions

        if not chunks:
            return []
        self._issue()
        flat = torch.stack([c.contiguous() for c in chunks])  # equal shapes (the contract)
        out = torch.empty_like(flat)
        self._wait(self.pg.alltoall_base(out, flat, [], [], AllToAllOptions()))
        return list(out.unbind(0))

    def _reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        # gloo has no reduce-scatter: each row to its rank (all-to-all), summed there
        return torch.stack(self._all_to_all(list(t.unbind(0)))).sum(0)


class Replicas:
    """This replica group's membership in a torchft job: one round at a time.

    ``register(save, load)`` names the state a peer heals this group with (and this
    group sends to one that fell behind). Each round: ``begin_round()`` joins the next
    quorum (healing first when behind), the round's collectives run on
    ``communicator``, and ``commit(ok)`` votes; it returns whether the round commits
    here. A group that votes no must roll the round back.
    """

    def __init__(self, job: FtJob) -> None:
        require_torchft()
        from torch.distributed import TCPStore
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self.job = job
        timeout = timedelta(seconds=job.timeout_s)
        # torchft warns at every new quorum that it cannot reset NCCL's flight recorder
        # (there is no NCCL here), and torch that a healing peer's buffer is read-only
        logging.getLogger("torchft.manager").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        # the group's own store (a group of one rank); peers rendezvous on it when this
        # group is the quorum's first
        self.store = TCPStore(job.host, 0, is_master=True, wait_for_workers=False)
        self.pg = ProcessGroupGloo(timeout=timeout)
        self._save: Callable[[], Any] | None = None
        self._load: Callable[[Any], None] | None = None
        self.manager = Manager(
            pg=self.pg, load_state_dict=self._load_state, state_dict=self._state,
            min_replica_size=1, use_async_quorum=False, rank=0, world_size=1,
            store_addr=job.host, store_port=self.store.port, lighthouse_addr=job.lighthouse,
            replica_id=f"replica_{job.replica}", hostname=job.host, timeout=timeout,
            # a round comes every H inner steps; a group waits that long for the others
            quorum_timeout=timedelta(seconds=max(600.0, 10 * job.timeout_s)),
            connect_timeout=timeout)
        self.communicator = FtCommunicator(self.pg, self.manager)
        self._healed = False
        self.rounds = 0  # begun by this process
        self.die_at = die_in_round(job.replica)
        #: seconds spent joining quorums (waiting for the others, healing)
        self.quorum_s = 0.0

    def register(self, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        self._save, self._load = save, load

    def _state(self) -> Any:
        if self._save is None:
            raise RuntimeError("a peer asked to heal from this replica before its state "
                               "was registered")
        return self._save()

    def _load_state(self, state: Any) -> None:
        if self._load is None:
            raise RuntimeError("healing before the state to heal was registered")
        self._load(state)
        self._healed = True

    def begin_round(self) -> RoundInfo:
        """Join the next quorum; heal from a peer first when this group is behind."""
        self._healed = False
        t0 = time.perf_counter()
        self.manager.start_quorum()
        self.quorum_s += time.perf_counter() - t0
        self.rounds += 1
        if self.manager.errored() is not None:
            raise RoundFailed(f"joining the quorum failed: {self.manager.errored()}")
        rank = self.manager.participating_rank()
        info = RoundInfo(0 if rank is None else int(rank), self.manager.num_participants(),
                         self._healed)
        self.communicator.set_quorum(info.rank, info.size)
        # ENV_DIE_IN_ROUND: after the round's header (its first collective)
        self.communicator.die_at_call = 2 if self.die_at == self.rounds else None
        return info

    def commit(self, ok: bool) -> bool:
        """Vote on the round (no when ``ok`` is false); whether it commits here."""
        if not ok and self.manager.errored() is None:
            self.manager.report_error(RoundFailed("this replica's round failed"))
        return bool(self.manager.should_commit())

    @property
    def step(self) -> int:
        """Rounds committed by the job (the manager's step: healing restores it)."""
        return int(self.manager.current_step())

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def replicas_from_env() -> Replicas | None:
    """This process's ``Replicas`` when it was started as a replica group of a torchft
    job (``FtJob.from_env``), else None."""
    job = FtJob.from_env()
    return None if job is None else Replicas(job)
