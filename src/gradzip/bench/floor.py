"""``gradzip bench floor``: which tensors' steps make W replicas' averaging lose to DDP.

Averaging W replicas' AdamW steps every step (``diloco(sync_every=1, lr=1,
momentum=0)``) sends a full model a step and still ends far behind DDP's AdamW on the
same global batch (docs/benchmarks/frontier.md, "The floor against W"). With one
inner step the only difference from DDP is the optimizer's denominator: each replica
divides its first moment by its own gradient's second moment, where DDP divides by
the mean gradient's. This benchmark trains W replicas of a preset model in one
process and chooses, per group of tensors, how each replica steps:

- ``mean``: the group's gradient is averaged over the replicas every step and one
  AdamW steps on it (DDP for that group; its tensors stay equal on every replica);
- ``own``: each replica's AdamW on its own gradient (what local-update methods do);
- ``global``: each replica's ``adamw_global`` (``gradzip.train.global_adamw``);
- ``pooled``: each replica's first moment over a denominator the replicas share,
  Adafactor's factored second moment pooled over them and refreshed every
  ``--stats-every`` steps (``pooled_adamw.py``: rows + columns numbers a refresh).

The groups are ``embedding`` (the token, and any position, embedding: tied to the
output layer in the presets) and ``hidden`` (every other tensor). A variant is
``HIDDEN/EMBEDDING``; ``mean/mean`` is DDP and is always run as the reference. Every
``--sync-every`` steps the replicas' unshared tensors are averaged (outer SGD at
``--outer-lr``, default 1, with ``--outer-momentum`` Nesterov's momentum as DiLoCo
takes it, default none), so ``--sync-every 1`` is the every-step floor and larger
values add local steps as DiLoCo takes them (nothing compressed); ``--inner-lr-scale``
shortens those local steps, and ``--sync-moments`` also averages the replicas' AdamW
moments at each average (``m``: first moments, ``mv``: both), so that no replica
leaves an average along its own past gradients.

The schedule (warm-up, cosine, floor) and AdamW's settings are the preset's, as
``gradzip train`` would run it; gradients are not clipped (the floor is the same
with and without: docs/benchmarks/frontier.md). Validation is the loss of the
replicas' mean weights on ``--eval-batches`` fixed batches of the validation split.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from gradzip.bench.pooled_adamw import STATS, PooledFactoredAdamW, PooledOptions
from gradzip.train.components import build_model, decay_groups
from gradzip.train.config import JobConfig
from gradzip.train.configure import resolve
from gradzip.train.data import BatchLoader
from gradzip.train.global_adamw import GlobalAdamW
from gradzip.train.loop import load_data, lr_at
from gradzip.train.parallel import DistInfo

RULES = ("mean", "own", "global", "pooled")
GROUPS = ("hidden", "embedding")
DDP = "mean/mean"
DEFAULT_VARIANTS = "own/own;global/global;own/mean;global/mean"
#: what ``--sync-moments`` averages at each average: nothing, first moments, both
SYNC_MOMENTS = ("", "m", "mv")
MOMENT_KEYS = {"m": ("exp_avg", "m"), "mv": ("exp_avg", "m", "exp_avg_sq")}


@dataclass(frozen=True)
class Variant:
    """How each group of tensors steps: ``hidden`` and ``embedding``, each a rule."""

    hidden: str
    embedding: str

    @classmethod
    def parse(cls, text: str) -> Variant:
        parts = [p.strip() for p in text.split("/")]
        if len(parts) != 2 or any(p not in RULES for p in parts):
            raise ValueError(f"variant {text!r}: give HIDDEN/EMBEDDING, each one of "
                             f"{', '.join(RULES)} (e.g. own/mean)")
        return cls(*parts)

    @property
    def label(self) -> str:
        return f"{self.hidden}/{self.embedding}"

    def rule(self, name: str) -> str:
        """The rule of the tensor called ``name``."""
        return self.embedding if group_of(name) == "embedding" else self.hidden


def group_of(name: str) -> str:
    """``embedding`` for the token and position embeddings, else ``hidden``."""
    return "embedding" if name.split(".")[0] in ("tok_emb", "pos_emb") else "hidden"


def parse_variants(text: str) -> list[Variant]:
    """The ``;``-separated variants, DDP first (added when missing), no repeats."""
    variants = [Variant.parse(DDP)]
    for part in filter(None, (p.strip() for p in text.split(";"))):
        v = Variant.parse(part)
        if v not in variants:
            variants.append(v)
    return variants


class Replicas:
    """W copies of a model's weights stepped by ``variant``'s rules: ``mean`` tensors
    are one tensor shared by every copy, stepped once on the copies' mean gradient."""

    def __init__(self, model: nn.Module, variant: Variant, world: int,
                 cfg: JobConfig, *, pooled: PooledOptions = PooledOptions(),
                 outer_lr: float = 1.0, inner_lr_scale: float = 1.0,
                 outer_momentum: float = 0.0, sync_moments: str = "") -> None:
        if sync_moments not in SYNC_MOMENTS:
            raise ValueError(f"sync_moments must be one of {SYNC_MOMENTS}, got {sync_moments!r}")
        self.model, self.world, self.cfg, self.pooled = model, world, cfg, pooled
        self.outer_lr, self.inner_lr_scale = outer_lr, inner_lr_scale
        self.outer_momentum, self.sync_moments = outer_momentum, sync_moments
        #: each unshared tensor's outer momentum buffer (Nesterov's, as DiLoCo's outer SGD)
        self.buffers: dict[int, torch.Tensor] = {}
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        self.names = [n for n, _ in named]
        self.rules = [variant.rule(n) for n in self.names]
        shared = [p.clone().requires_grad_(True) if r == "mean" else None
                  for (_, p), r in zip(named, self.rules, strict=True)]
        self.weights = [[s if s is not None else p.clone().requires_grad_(True)
                         for s, (_, p) in zip(shared, named, strict=True)]
                        for _ in range(world)]
        self.shared = [s for s in shared if s is not None]
        #: each unshared tensor as of the last average (the outer step's origin)
        self.anchors = {i: p.clone() for i, ((_, p), r) in enumerate(zip(named, self.rules,
                                                                          strict=True))
                        if r != "mean"}
        self.optimizers = self._optimizers()
        #: the one AdamW over the shared tensors (DDP's), which the inner lr scale spares
        self.ddp_optimizer = self.optimizers[0] if self.shared else None

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """One AdamW over the shared tensors (first), per replica one over its ``own``
        and one over its ``global`` ones, and one ``PooledFactoredAdamW`` over every
        replica's ``pooled`` ones."""
        o = self.cfg.optim
        optims: list[torch.optim.Optimizer] = []
        for rule in ("mean", "own", "global"):
            copies = [self.weights[0]] if rule == "mean" else self.weights
            for weights in copies:
                params = [w for w, r in zip(weights, self.rules, strict=True) if r == rule]
                if not params:
                    continue
                groups = [g for g in decay_groups(params, o.weight_decay) if g["params"]]
                kw: dict[str, Any] = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps}
                optims.append(GlobalAdamW(groups, replicas=self.world, **kw) if rule == "global"
                              else torch.optim.AdamW(groups, **kw))
        pooled = [[w for w, r in zip(weights, self.rules, strict=True) if r == "pooled"]
                  for weights in self.weights]
        if pooled[0]:
            optims.append(PooledFactoredAdamW(
                pooled, weight_decays=[o.weight_decay if p.dim() >= 2 else 0.0
                                       for p in pooled[0]],
                lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **asdict(self.pooled)))
        return optims

    def loss(self, replica: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        weights = dict(zip(self.names, self.weights[replica], strict=True))
        return functional_call(self.model, weights, (x, y))[1]

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> float:
        """Every replica's gradient on its batch, the shared tensors' mean gradient,
        then every optimizer's step at ``lr``; returns the mean training loss."""
        total = 0.0
        for w in self.shared:
            w.grad = torch.zeros_like(w)
        for r, (x, y) in enumerate(batches):
            loss = self.loss(r, x, y)
            grads = torch.autograd.grad(loss, self.weights[r])
            for w, g, rule in zip(self.weights[r], grads, self.rules, strict=True):
                if rule == "mean":
                    assert w.grad is not None
                    w.grad.add_(g, alpha=1 / self.world)
                else:
                    w.grad = g
            total += float(loss.detach())
        for opt in self.optimizers:
            shared = opt is self.ddp_optimizer
            for group in opt.param_groups:
                group["lr"] = lr if shared else lr * self.inner_lr_scale
            opt.step()
        return total / self.world

    @torch.no_grad()
    def average(self) -> None:
        """Outer SGD step: each unshared tensor becomes its last average plus
        ``outer_lr`` times the replicas' mean move since (with lr 1 and no momentum: the
        mean itself), or, with ``outer_momentum``, times Nesterov's step along that move
        (torch's SGD with ``nesterov=True`` on the negated move, DiLoCo's outer step);
        with ``sync_moments`` the replicas' AdamW moments are averaged as well."""
        for i, anchor in self.anchors.items():
            mean = torch.stack([w[i] for w in self.weights]).mean(0)
            if self.outer_momentum:
                move = mean - anchor
                buf = self.buffers.setdefault(i, torch.zeros_like(move))
                buf.mul_(self.outer_momentum).add_(move)
                mean = anchor + self.outer_lr * (move + self.outer_momentum * buf)
            elif self.outer_lr != 1.0:
                mean = anchor + self.outer_lr * (mean - anchor)
            anchor.copy_(mean)
            for w in self.weights:
                w[i].copy_(mean)
            if self.sync_moments:
                self._average_moments(i)

    def _average_moments(self, i: int) -> None:
        """Make every replica's AdamW moments of tensor ``i`` their mean: the first
        (``exp_avg``; the pooled rule's ``m``), and with ``mv`` the second
        (``exp_avg_sq``) too."""
        keys = MOMENT_KEYS[self.sync_moments]
        states = [self.state_of(w[i]) for w in self.weights]
        for key in keys:
            held = [s[key] for s in states if key in s]
            if len(held) == len(states):
                mean = torch.stack(held).mean(0)
                for t in held:
                    t.copy_(mean)

    def state_of(self, p: torch.Tensor) -> dict[str, Any]:
        """The optimizer state of ``p`` (empty for a tensor no optimizer has stepped)."""
        for opt in self.optimizers:
            if p in opt.state:
                return opt.state[p]
        return {}

    @torch.no_grad()
    def mean_weights(self) -> dict[str, torch.Tensor]:
        return {n: torch.stack([w[i] for w in self.weights]).mean(0)
                for i, n in enumerate(self.names)}


@dataclass
class Result:
    """One variant's run."""

    variant: str
    final_val_loss: float
    evals: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    vs_ddp: float | None = None


def evaluate(model: nn.Module, weights: dict[str, torch.Tensor],
             batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    with torch.no_grad():
        return sum(float(functional_call(model, weights, (x, y))[1])
                   for x, y in batches) / len(batches)


def train_variant(variant: Variant, args: argparse.Namespace, cfg: JobConfig,
                  data: Any, val: list[tuple[torch.Tensor, torch.Tensor]]) -> Result:
    """Train W replicas from the seed's initialization under ``variant``."""
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    model = build_model(cfg.model)
    reps = Replicas(model, variant, args.replicas, cfg, pooled=pooled_options(args),
                    outer_lr=args.outer_lr, inner_lr_scale=args.inner_lr_scale,
                    outer_momentum=args.outer_momentum, sync_moments=args.sync_moments)
    loaders = [BatchLoader(data.train, batch_size=args.batch_size, seq_len=cfg.data.seq_len,
                           rank=r, world_size=args.replicas, seed=args.seed, prefetch=0)
               for r in range(args.replicas)]
    result, start = Result(variant.label, float("nan")), time.perf_counter()
    for step in tqdm(range(1, args.steps + 1), desc=variant.label, unit="step",
                     disable=args.quiet):
        reps.step([next(loader) for loader in loaders], lr_at(step, cfg.optim, args.steps))
        if step % args.sync_every == 0:
            reps.average()
        if step % args.eval_every == 0 or step == args.steps:
            loss = evaluate(model, reps.mean_weights(), val)
            result.evals.append({"step": step, "val_loss": loss})
    result.final_val_loss = result.evals[-1]["val_loss"]
    result.seconds = time.perf_counter() - start
    for loader in loaders:
        loader.close()
    return result


def job_config(args: argparse.Namespace) -> JobConfig:
    return resolve({"model": {"name": args.model},
                    "data": {"batch_size": args.batch_size, "max_tokens": args.max_tokens,
                             "cache_dir": args.cache_dir},
                    "train": {"max_steps": args.steps, "seed": args.seed}})


def check_counts(args: argparse.Namespace) -> None:
    """Every count the benchmark takes is at least 1 (the warm-up: at least 0)."""
    for name in ("replicas", "batch_size", "steps", "sync_every", "stats_every", "eval_every",
                 "eval_batches"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, "
                             f"got {getattr(args, name)}")
    if args.stats_warmup < 0:
        raise ValueError(f"--stats-warmup must be 0 or more, got {args.stats_warmup}")
    for name in ("outer_lr", "inner_lr_scale"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be above 0, "
                             f"got {getattr(args, name)}")
    if not 0 <= args.outer_momentum < 1:
        raise ValueError(f"--outer-momentum must be in [0, 1), got {args.outer_momentum}")


def pooled_options(args: argparse.Namespace) -> PooledOptions:
    """The pooled rule's options the command line asked for."""
    return PooledOptions(every=args.stats_every, warmup=args.stats_warmup,
                         stat=args.pooled_stat, noise_corrected=args.noise_corrected,
                         floor_own=args.floor_own, carry=args.stats_carry)


def check_pooled_flags(args: argparse.Namespace, variants: list[Variant]) -> None:
    """The pooled rule's flags are refused when no variant uses the rule: they would
    change nothing, and the records would say they were used."""
    if any("pooled" in (v.hidden, v.embedding) for v in variants):
        return
    asked = pooled_options(args)
    changed = [f for f in fields(PooledOptions) if getattr(asked, f.name) != f.default]
    if changed:
        flags = {"every": "--stats-every", "warmup": "--stats-warmup",
                 "stat": "--pooled-stat", "noise_corrected": "--noise-corrected",
                 "floor_own": "--floor-own", "carry": "--stats-carry"}
        raise ValueError(f"only the pooled rule reads {', '.join(flags[f.name] for f in changed)}"
                         f", and no variant in --variants uses it (add one, e.g. "
                         f"--variants \"mean/pooled\", or drop the flag)")


def run(args: argparse.Namespace) -> int:
    check_counts(args)
    variants = parse_variants(args.variants)
    check_pooled_flags(args, variants)
    torch.set_flush_denormal(True)
    cfg = job_config(args)
    data = load_data(cfg, DistInfo(rank=0, world_size=1, local_rank=0,
                                   device=torch.device("cpu")))
    cfg.model.vocab_size = cfg.model.vocab_size or data.tokenizer.vocab_size
    val_loader = BatchLoader(data.val, batch_size=16, seq_len=cfg.data.seq_len, rank=0,
                             world_size=1, seed=args.seed, prefetch=0)
    val = [next(val_loader) for _ in range(args.eval_batches)]
    val_loader.close()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [train_variant(v, args, cfg, data, val) for v in variants]
    ddp = results[0].final_val_loss
    for r in results:
        r.vs_ddp = r.final_val_loss / ddp - 1
    write_results(out / "results.jsonl", results, args)
    print_table(results, args)
    return 0


def write_results(path: Path, results: list[Result], args: argparse.Namespace) -> None:
    """One JSON line per variant (written then renamed: never half a file)."""
    meta = {"benchmark": "floor", "args": {k: v for k, v in vars(args).items()
                                           if k != "func" and not callable(v)},
            "torch": torch.__version__, "machine": platform.machine(),
            "date": time.strftime("%Y-%m-%d")}
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({**meta, **asdict(r)}) + "\n" for r in results))
    tmp.replace(path)


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    print(f"\n{args.model}, W = {args.replicas} replicas x {args.batch_size} sequences, "
          f"{args.steps} steps, averaged every {args.sync_every}; HIDDEN/EMBEDDING")
    print(f"{'variant':16s} {'final val loss':>15s} {'vs DDP':>8s} {'min':>6s}")
    for r in results:
        gap = "" if r.variant == DDP else f"{100 * (r.vs_ddp or 0):+.2f}%"
        print(f"{r.variant:16s} {r.final_val_loss:15.4f} {gap:>8s} {r.seconds / 60:6.1f}")


def register(sub: Any) -> None:
    p = sub.add_parser("floor", help="which tensors make averaging W replicas' AdamW steps "
                       "lose to DDP", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="model preset (default: small)")
    p.add_argument("--replicas", type=int, default=8, help="W (default: 8)")
    p.add_argument("--batch-size", type=int, default=2,
                   help="sequences per replica a step (default: 2)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
    p.add_argument("--sync-every", type=int, default=1,
                   help="average the unshared tensors every this many steps (default: 1)")
    p.add_argument("--stats-every", type=int, default=1,
                   help="the pooled rule's statistics are refreshed every this many steps "
                   "(default: 1)")
    p.add_argument("--pooled-stat", choices=STATS, default="factored",
                   help="what the pooled rule's replicas pool: factored (row and column "
                   "means of g^2), row (row means), full (every coordinate's: the bound) "
                   "(default: factored)")
    p.add_argument("--noise-corrected", action="store_true",
                   help="the pooled rule removes the replicas' gradient noise from the "
                   "pooled second moment, as adamw_global does from its own")
    p.add_argument("--stats-warmup", type=int, default=0,
                   help="the pooled rule's statistics are also refreshed at each of the "
                   "first this many steps (default: 0)")
    p.add_argument("--stats-carry", action="store_true",
                   help="between refreshes each replica carries the pooled second moment "
                   "on with its own squared gradients, as AdamW does")
    p.add_argument("--outer-lr", type=float, default=1.0,
                   help="at each average the unshared tensors move this many times the "
                   "replicas' mean move since the last (default: 1, the mean)")
    p.add_argument("--outer-momentum", type=float, default=0.0,
                   help="Nesterov momentum of the outer step, as DiLoCo's (0.9 with "
                   "--outer-lr 0.7 there) (default: 0, none)")
    p.add_argument("--sync-moments", choices=("m", "mv"), default="",
                   help="at each average also average the replicas' AdamW moments: m the "
                   "first, mv both (default: neither)")
    p.add_argument("--inner-lr-scale", type=float, default=1.0,
                   help="the replicas' own steps (every rule but mean) take the "
                   "schedule's lr times this (default: 1)")
    p.add_argument("--floor-own", action="store_true",
                   help="the pooled rule divides by at least the replica's own estimate "
                   "(of the statistics --pooled-stat names)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f'";"-separated HIDDEN/EMBEDDING rules of {", ".join(RULES)}; '
                   f'{DDP} (DDP) always runs (default: "{DEFAULT_VARIANTS}")')
    p.add_argument("--max-tokens", type=int, default=3_300_000,
                   help="training tokens prepared from the stdlib corpus "
                   "(default: 3300000, the long-small race's)")
    p.add_argument("--cache-dir", default="runs/.cache/data", help="token cache")
    p.add_argument("--eval-every", type=int, default=50, help="(default: 50)")
    p.add_argument("--eval-batches", type=int, default=16,
                   help="validation batches of 16 sequences (default: 16)")
    p.add_argument("--seed", type=int, default=0, help="initialization and data order")
    p.add_argument("--out", default="runs/bench-floor", help="directory for results.jsonl")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
