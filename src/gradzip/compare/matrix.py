"""What a compare runs: presets, the matrix of link settings x methods x seeds, and the
``gradzip train`` command of each run.

Every run of a matrix trains the same model on the same data from the same
initialization and in the same data order (``--seed`` drives both; seed k of every
method is the same), evaluates on the same fixed validation batches every
``eval_every`` steps, and leaves the same warm-up steps out of its timings, so runs
differ only in how gradients cross the link.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path


def method_flags(method: str) -> list[str]:
    """``gradzip train`` flags of a method (``gradzip.comm.method``'s grammar: a codec
    spec, ``torch:...``, or ``diloco(...)``/``average(...)`` with the pseudo-gradients'
    codec); ValueError or SpecError if malformed."""
    from gradzip.comm.method import parse_method

    return parse_method(method).train_flags()


#: how the ranks of a run reach each other: one token bucket on a loopback shared by
#: all ranks (``gradzip.comm.netns``), a shaped link per rank (``comm.rank_links``), or
#: ``nodes=NxL``: N nodes of L ranks, unshaped inside a node, a shaped uplink per node;
#: or ``replicas``: the ranks as replicas in one process (``gradzip train --replicas``),
#: the link modelled at the rate, not emulated
LINK_KINDS = ("shared", "per-rank", "nodes=NxL", "replicas")
#: ``--ckpt-every`` of a run that torchrun restarts after a kill, unless its train flags
#: set one (the steps since the last checkpoint are trained again)
KILL_CKPT_EVERY = "25"
_NODES = re.compile(r"^nodes=(\d+)x(\d+)$")


def nodes_of(link: str) -> tuple[int, int] | None:
    """``(N, L)`` of a ``nodes=NxL`` link; None for the other kinds."""
    m = _NODES.match(link)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_link(link: str) -> None:
    """ValueError unless ``link`` is one of ``LINK_KINDS`` (``nodes=NxL``, N, L >= 1)."""
    nodes = nodes_of(link)
    if link not in ("shared", "per-rank", "replicas") and (
            nodes is None or min(nodes) < 1 or nodes == (1, 1)):
        raise ValueError(f"--link must be shared, per-rank, nodes=NxL (N nodes of L "
                         f"ranks, e.g. nodes=2x2) or replicas, got {link!r}")


@dataclass(frozen=True)
class Preset:
    """A ready matrix: methods, links, ranks, seeds and the training run."""

    methods: tuple[str, ...]
    rates: tuple[str | None, ...]
    ranks: tuple[int, ...]
    seeds: int
    train: tuple[str, ...]
    doc: str


# The tiny model (~130k parameters, 0.5 MB of fp32 gradients) on the standard library:
# at 100 Mbit/s an uncompressed step spends most of its time on the link, so the race
# shows what compression buys; 300 steps reach a loss where differences are visible.
_TINY = ("--model", "tiny", "--dataset", "stdlib", "--max-tokens", "600000",
         "--seq-len", "64", "--batch-size", "8", "--max-steps", "300", "--eval-every", "25",
         "--eval-steps", "4", "--log-every", "25", "--timing-warmup", "5", "--threads", "1")

# Long runs: a 300-step race measures early training, where gaps between methods and
# their ranking still move. The tiny model for 2,000 steps on tokens it never sees twice
# (2.2M training tokens: one epoch of 2,148 steps at 2 ranks x 8 x 64), 3 seeds; the ~4M
# `small` model for 1,500 steps (3.3M tokens at 2 ranks x 8 x 128), 1 seed.
_LONG = ("--model", "tiny", "--dataset", "stdlib", "--max-tokens", "2200000",
         "--seq-len", "64", "--batch-size", "8", "--max-steps", "2000", "--eval-every", "50",
         "--eval-steps", "4", "--log-every", "100", "--timing-warmup", "5", "--threads", "1")
_LONG_SMALL = ("--model", "small", "--dataset", "stdlib", "--max-tokens", "3300000",
               "--seq-len", "128", "--batch-size", "8", "--max-steps", "1500",
               "--eval-every", "100", "--eval-steps", "4", "--log-every", "100",
               "--timing-warmup", "5", "--threads", "1")
_LONG_METHODS = ("torch:none", "torch:fp16", "int8", "ef | powersgd(rank=4)",
                 "ef | topk(ratio=0.01)", "diloco(sync_every=32) | int8")
# The low-bandwidth frontier (docs/benchmarks/frontier.md): SparseLoCo, DiLoCo with 4-bit
# outer gradients, each also with Streaming DiLoCo's alpha-mixing (and DiLoCo with its
# fragments and overlap), and SNOO (16-bit DDP plus DiLoCo's outer step): the matched
# baseline
_FRONTIER_METHODS = ("sparseloco", "sparseloco(alpha=0.5)",
                     "diloco(sync_every=32) | centroid(bits=4) | ans",
                     "diloco(sync_every=32, fragments=2, overlap=4, alpha=0.5) | "
                     "centroid(bits=4) | ans",
                     "snoo(sync_every=32) | fp16")

PRESETS: dict[str, Preset] = {
    "quick": Preset(
        methods=("torch:none", "torch:fp16", "torch:powersgd(rank=4)", "int8",
                 "qsgd | eg", "ef | topk(ratio=0.01)"),
        rates=("100mbit",), ranks=(2,), seeds=1, train=_TINY,
        doc="tiny GPT, 2 ranks, 100 Mbit/s shared link, 6 methods, 1 seed (~3 min "
            "on 2 cores); what `make demo` runs"),
    "full": Preset(
        methods=("torch:none", "torch:fp16", "torch:powersgd(rank=4)", "int8", "qsgd | eg",
                 "ef | powersgd(rank=4)", "ef | topk(ratio=0.1)", "ef | topk(ratio=0.01)",
                 "ef | topk(ratio=0.01) | qsgd(levels=16)", "efsignsgd",
                 "dgc(ratio=0.01)"),
        rates=("100mbit", "1gbit"), ranks=(2, 4), seeds=3, train=_TINY,
        doc="every codec family against PyTorch's hooks, 3 seeds, 100 Mbit/s and 1 Gbit/s, "
            "2 and 4 ranks (132 runs, about an hour on 2 cores)"),
    "long": Preset(
        methods=_LONG_METHODS + _FRONTIER_METHODS, rates=("100mbit",), ranks=(2,), seeds=3,
        train=_LONG,
        doc="tiny GPT for 2,000 steps on non-repeating tokens, 2 ranks, 100 Mbit/s, 11 "
            "methods (the frontier's SparseLoCo, 4-bit DiLoCo and SNOO included), 3 seeds "
            "(about 45 min on 2 cores)"),
    "long-small": Preset(
        methods=_LONG_METHODS, rates=("100mbit",), ranks=(2,), seeds=1, train=_LONG_SMALL,
        doc="the ~4M small model for 1,500 steps, 2 ranks, 100 Mbit/s, 6 methods, 1 seed "
            "(hours on 2 cores)"),
}


@dataclass(frozen=True)
class Run:
    """One training run of the matrix."""

    method: str
    seed: int
    ranks: int
    rate: str | None  # None: unlimited loopback
    train: tuple[str, ...] = field(default=())
    link: str = "shared"  # one of LINK_KINDS
    #: gradzip train --parallel: ddp (hierarchical on nodes=NxL links for gradzip
    #: codecs) or hsdp (FSDP2 sharded within a node)
    parallel: str = "ddp"
    #: the user's training script and its arguments (``--script``), run instead of
    #: ``gradzip train``; empty: the built-in trainer with ``train``'s flags
    script: tuple[str, ...] = field(default=())
    #: gradzip codecs send plain until this step (``--start-step``); 0: from the start
    start_step: int = 0
    #: one trial of ``--tune``: (option, value) pairs given to the trainer or the script
    trial: tuple[tuple[str, str], ...] = ()
    #: ``--ft``: local-update methods run as ``ranks`` torchft replica groups
    ft: bool = False
    #: ``--kill R@S,...``: rank (or replica group) R dies after step S, in order
    kill: str = ""

    @property
    def what(self) -> tuple[str, ...]:
        """What trains: ``train``'s flags, or ``--script PATH ARGS``, and the start step
        (records keep it as ``compare.train``, so reruns find their runs)."""
        from gradzip.compare.trials import trial_flags

        trains = ("--script", *self.script) if self.script else self.train
        faults = (*(["--ft"] if self.uses_ft() else []),
                  *(["--kill", self.kill] if self.kill else []))
        return (*trains, *trial_flags(self.trial), *self._start_flags(), *faults)

    def compressed_from(self) -> int:
        """The step compression starts at for this run's method: ``start_step`` for
        gradzip codecs, 0 for the rest (``torch:powersgd`` has its own start_iter)."""
        from gradzip.comm.method import CodecMethod, parse_method

        codec = isinstance(parse_method(self.method), CodecMethod)
        return self.start_step if codec and self.method.strip() != "none" else 0

    def _start_flags(self) -> list[str]:
        start = self.compressed_from()
        return ["--codec-start-step", str(start)] if start else []

    @property
    def slug(self) -> str:
        """A directory name: the setting, the method made filename-safe, the seed."""
        method = re.sub(r"[^A-Za-z0-9.=]+", "_", self.method).strip("_")
        kind = "" if self.link == "shared" else f"-{self.link}"
        kind += "" if self.parallel == "ddp" else f"-{self.parallel}"
        trial = "".join(f"-{k}={v}" for k, v in self.trial)
        trial = re.sub(r"[^A-Za-z0-9.=-]+", "_", trial)
        return f"{self.rate or 'unlimited'}-w{self.ranks}{kind}/{method}{trial}/seed{self.seed}"

    def link_goes_down(self) -> bool:
        """Whether this run's rate schedule takes the link down (``down``): its ranks
        then start without torchrun's agent (``gradzip.comm.local_ranks``)."""
        return any(part.partition("@")[0].strip() == "down"
                   for part in (self.rate or "").split(">"))

    def uses_ft(self) -> bool:
        """Whether this run's replicas are torchft replica groups (``--ft`` and a
        local-update method whose rounds can commit or roll back)."""
        from gradzip.comm.method import LocalUpdateMethod, parse_method

        return self.ft and isinstance(parse_method(self.method), LocalUpdateMethod)

    def kills(self) -> list[tuple[int, int]]:
        """``kill`` as (rank, step) pairs, in the order they happen."""
        from gradzip.train.restart import kills

        return kills({"GRADZIP_KILL_AT": self.kill})

    def survival(self) -> str | None:
        """How this run survives a dead rank, in words (None: it does not try)."""
        if self.uses_ft():
            return (f"torchft: {self.ranks} replica groups of one process; a dead group "
                    "is started again and heals from a live peer while the others go on")
        if self.kill:
            return (f"torchrun --max-restarts {len(self.kills())}: every worker starts "
                    f"again from the newest checkpoint (--ckpt-every {self._ckpt_every()})")
        return None

    def _ckpt_every(self) -> str:
        """The checkpoint interval of a run restarted by torchrun: the train flags' (or
        the trial's) own ``--ckpt-every``, else ``KILL_CKPT_EVERY``."""
        from gradzip.compare.trials import trial_flags

        flags = [*self.train, *trial_flags(self.trial)]
        value = KILL_CKPT_EVERY
        for i, f in enumerate(flags):
            if f == "--ckpt-every" and i + 1 < len(flags):
                value = flags[i + 1]
            elif f.startswith("--ckpt-every="):
                value = f.partition("=")[2]
        return value

    def _launcher(self) -> list[str]:
        """What starts the ranks: torchrun (with restarts when ranks are killed), the
        rank launcher of a link that goes down, nothing on per-rank links (their own
        launcher) or under ``--ft`` (``gradzip train --ft`` starts its groups)."""
        if self.link != "shared" or self.uses_ft():
            return []  # (replicas: one process)
        if self.link_goes_down():
            return ["-m", "gradzip.comm.local_ranks", "--ranks", str(self.ranks), "--",
                    sys.executable]
        restarts = ["--max-restarts", str(len(self.kills()))] if self.kill else []
        return ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(self.ranks), *restarts]

    def _survival_flags(self) -> list[str]:
        if self.uses_ft():
            return ["--ft", str(self.ranks), "--ft-max-restarts",
                    str(max(3, len(self.kills())))]
        if self.kill:
            return ["--ckpt-every", KILL_CKPT_EVERY]
        return []

    def argv(self, out: Path, cache: Path) -> list[str]:
        """``torchrun ... gradzip train`` for this run (DDP over gloo), or ``torchrun
        ... SCRIPT ARGS``; on per-rank links the rank launcher of ``comm.rank_links``
        starts each rank instead of torchrun; under ``--ft`` ``gradzip train --ft W``
        starts the replica groups."""
        torchrun = self._launcher()
        from gradzip.compare.trials import trial_flags

        if self.script:
            return [sys.executable, *torchrun, *self.script, *trial_flags(self.trial)]
        # the survival flags first: a --ckpt-every of the train flags or a trial wins
        return [sys.executable, *torchrun, "-m", "gradzip", "train", *self._survival_flags(),
                *self.train, *trial_flags(self.trial),
                "--parallel", self.parallel, *self._node_flags(), *self._replica_flags(),
                *method_flags(self.method), *self._start_flags(), "--seed", str(self.seed),
                "--cache-dir", str(cache), "--out", str(out), "--no-progress",
                "--no-tensorboard"]


    def env(self, out: Path) -> dict[str, str]:
        """The environment of a run: ``GRADZIP_KILL_AT`` when ranks are killed; of a
        ``--script`` run (``gradzip.integrations.script``) also method, seed, run
        directory and, on ``nodes=NxL`` links, ranks per node."""
        if not self.script:
            return {"GRADZIP_KILL_AT": self.kill} if self.kill else {}
        from gradzip.integrations import script

        nodes = nodes_of(self.link)
        return {script.ENV_METHOD: self.method, script.ENV_SEED: str(self.seed),
                script.ENV_RUN_DIR: str(Path(out).resolve()),
                script.ENV_NODE_SIZE: str(nodes[1]) if nodes else "",
                script.ENV_START_STEP: str(self.compressed_from())}

    def _replica_flags(self) -> list[str]:
        """On a ``replicas`` link: the ranks as replicas of one process, the link
        modelled at this run's rate."""
        if self.link != "replicas":
            return []
        if self.rate is None:
            raise ValueError("a replicas link is modelled at a rate: give --rate")
        return ["--replicas", str(self.ranks), "--replica-link", self.rate]

    def _node_flags(self) -> list[str]:
        """On ``nodes=NxL`` links: L ranks per node, and DDP's gradzip codecs
        compressed between nodes only (``--hierarchical``)."""
        nodes = nodes_of(self.link)
        if nodes is None:
            return []
        flags = ["--node-size", str(nodes[1])]
        from gradzip.comm.method import AutoMethod, CodecMethod, parse_method

        if self.parallel == "ddp" and isinstance(parse_method(self.method),
                                                 CodecMethod | AutoMethod):
            flags.append("--hierarchical")
        return flags


def plan(methods: list[str], rates: list[str | None], ranks: list[int], seeds: int,
         train: tuple[str, ...], links: tuple[str, ...] = ("shared",),
         parallel: str = "ddp", script: tuple[str, ...] = (),
         trials: list[tuple[tuple[str, str], ...]] | None = None) -> list[Run]:
    """Every run: for each link setting, every seed of every method in every trial of
    ``--tune`` (slowest link first). A ``nodes=NxL`` link has N x L ranks, whatever
    ``ranks`` says."""
    return [Run(m, s, w, r, train, k, parallel, script, trial=t) for r in rates
            for k in links for w in _ranks_of(k, ranks) for s in range(seeds)
            for m in methods for t in (trials or [()])]


def _ranks_of(link: str, ranks: list[int]) -> list[int]:
    nodes = nodes_of(link)
    return ranks if nodes is None else [nodes[0] * nodes[1]]
