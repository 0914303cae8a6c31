"""Training configuration: dataclasses with a docstring per field, presets in files.

A run's configuration is resolved in layers, later ones winning:

1. the dataclass defaults below (every default has a comment saying why);
2. the model preset ``presets/<model>.json`` (it may also set data and optimizer fields);
3. a config file (``--config run.toml`` or ``.json``, same sections as below);
4. command-line flags, e.g. ``--model small --lr 3e-4``.

With ``--resume`` the saved ``config.json`` of the run replaces layers 1-2, so a resumed
run keeps its settings unless a flag says otherwise (typically ``--max-steps``).
The resolved configuration is written to ``<out>/config.json``, which is itself a
valid config file; its paths are absolute, so it means the same files from any directory.

The field docstrings are the ``--help`` text: ``field_docs`` reads them from this
file's source, so documentation and CLI cannot drift apart.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRESET_DIR = Path(__file__).parent / "presets"
BUILTIN_SOURCE = "stdlib"  # the one source name that is not a path (data.sources.open_source)


@dataclass
class ModelConfig:
    """The GPT architecture (see ``gradzip.train.model``)."""

    name: str = field(default="tiny", metadata={"flag": "--model"})
    """Preset the model starts from: presets/NAME.json (tiny, small, gpt2-124m, llama-120m)."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_kv_head: int = 0
    """Key/value heads for grouped-query attention; 0 = n_head (plain multi-head)."""
    dim: int = 64
    """Width of the residual stream (embedding size)."""
    ffn_dim: int = 0
    """Hidden size of the MLP; 0 = 4*dim for GELU, 8/3*dim (rounded up to 64) for SwiGLU."""
    norm: str = "rmsnorm"
    """rmsnorm (Llama) or layernorm (GPT-2)."""
    pos: str = "rope"
    """Position encoding: rope (rotary, Llama) or learned (absolute embeddings, GPT-2)."""
    mlp: str = "swiglu"
    """swiglu (Llama) or gelu (GPT-2)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head (saves vocab*dim parameters)."""
    bias: bool = False
    """Biases in linear layers and norms (GPT-2 has them; modern models drop them)."""
    max_seq_len: int = 64
    """Longest sequence the model accepts (size of learned positions / RoPE table)."""
    vocab_size: int = field(default=0, metadata={"flag": "--model-vocab-size"})
    """Output vocabulary; 0 = the tokenizer's (the usual choice; set when resolving)."""
    dropout: float = 0.0
    """Dropout on attention and residual outputs; 0 because short runs do not overfit."""
    rope_theta: float = 10000.0
    """RoPE base frequency (10000 as in the RoFormer paper and Llama 2)."""
    norm_eps: float = 1e-5
    """Epsilon of the normalization layers."""
    init_std: float = 0.02
    """Std of the normal weight init (GPT-2); residual projections get std/sqrt(2*n_layer)."""


@dataclass
class DataOptions:
    """What to train on and how it is batched (see ``gradzip.train.data``)."""

    sources: list[str] = field(default_factory=lambda: ["stdlib"],
                               metadata={"flag": "--dataset", "path": "source"})
    """Text sources: "stdlib" (Python's standard library, no download), a text file or
    directory, *.jsonl, *.json (an array of {id, title, text} records, streamed) or a Hugging
    Face datasets directory. SOURCE:WEIGHT mixes sources by token share (a.jsonl:3 b.txt:1)."""
    cache_dir: str = field(default="runs/.cache/data", metadata={"path": True})
    """Where tokenized shards and the trained tokenizer are cached between runs."""
    tokenizer: str = field(default="", metadata={"path": True})
    """A tokenizer.json file or a directory holding one; empty = train a byte-level BPE on
    the training split of the sources (cached)."""
    vocab_size: int = 4096
    """Vocabulary size of a trained tokenizer (small enough for CPU models)."""
    val_fraction: float = 0.05
    """Share of files / records (1 MiB blocks of big text files) held out for validation,
    chosen by a hash of their name: the same split on every machine and every run."""
    max_tokens: int = 0
    """Cap on training tokens (validation gets the matching val_fraction share); the tiny
    preset sets 1M so a first run tokenizes in seconds. 0 = all of the sources."""
    seq_len: int = 128
    """Tokens per training sequence (context length)."""
    batch_size: int = 8
    """Sequences per micro-batch per rank."""
    prefetch: int = 2
    """Batches the loader prepares ahead of the step."""


@dataclass
class OptimConfig:
    """AdamW (or plain SGD) with a cosine schedule, warm-up and a floor."""

    optimizer: str = "adamw"
    """adamw, or sgd: plain SGD without momentum (for codecs that step with their own
    momentum, as DeMo does: --codec demo needs --optimizer sgd --grad-clip 0)."""
    lr: float = 1e-3
    """Peak learning rate, reached after warm-up."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine decay as a fraction of lr (Chinchilla-style 10%)."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to lr (Adam's early updates are noisy)."""
    decay_steps: int = 0
    """Step at which the cosine reaches the floor; 0 = max_steps. Set it to run a schedule
    in pieces (train to 10 with decay_steps 20, resume to 20)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not norms, biases)."""
    beta1: float = 0.9
    """Adam beta1: decay of the gradient's moving average (the usual 0.9)."""
    beta2: float = 0.95
    """Adam beta2 (0.95 rather than 0.999 is steadier for LLMs)."""
    eps: float = 1e-8
    """Adam epsilon, added to the root of the second moment (guards against dividing by 0)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 = no clipping."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; gradients are synchronized only on the last one."""


@dataclass
class TrainConfig:
    """The loop: how long, where, in which precision, with which parallelism and codec."""

    max_steps: int = 100
    """Optimizer steps to train for (a resumed run continues up to this step)."""
    max_time: float = 0.0
    """Stop after this many seconds of training (checked every step); 0 = no limit."""
    seed: int = 0
    """Seed for model init, data order and codec randomness."""
    device: str = "auto"
    """auto (cuda if available), cpu or cuda."""
    dtype: str = "fp32"
    """fp32, bf16 (autocast, CPU or GPU) or fp16 (autocast + grad scaler, CUDA only)."""
    parallel: str = "none"
    """none (one process), ddp (DistributedDataParallel) or fsdp (FSDP2 fully_shard per block)."""
    codec: str = "none"
    """Gradient codec spec, e.g. "ef | topk(ratio=0.01)", or a JSON policy
    ({"codec": ..., "groups": [...], "start_step": N}); none = uncompressed all-reduce."""
    codec_groups: str = ""
    """Per-parameter codecs, "PATTERNS=SPEC;...", e.g. "*.bias,*norm*,*emb*=none": matching
    parameter names (first match wins) take that codec; the rest take --codec."""
    codec_start_step: int = 0
    """Optimizer steps communicated uncompressed before --codec starts (PowerSGD's start
    iteration, DGC's warm-up)."""
    outer: str = "none"
    """Local updates instead of per-step gradient sync: diloco (DiLoCo: every
    --sync-every steps, an outer Nesterov step on the averaged pseudo-gradient) or average
    (post-local SGD, the control); none = synchronize every step. Needs --parallel ddp;
    the model is then not wrapped by DDP."""
    sync_every: int = 32
    """With --outer: inner steps between synchronizations (DiLoCo's H)."""
    outer_lr: float = 0.7
    """With --outer diloco: the outer SGD learning rate."""
    outer_momentum: float = 0.9
    """With --outer diloco: the outer Nesterov momentum."""
    outer_codec: str = "none"
    """With --outer: the codec spec the pseudo-gradients cross the link with (e.g. int8);
    none = the fp32 all-reduce."""
    fragments: int = 1
    """With --outer: Streaming DiLoCo's fragments: the model's blocks in this many groups,
    each synchronized every --sync-every steps at staggered offsets (must divide the
    number of blocks and be <= --sync-every)."""
    overlap_steps: int = 0
    """With --outer: Streaming DiLoCo's overlap: a fragment's exchange runs in the
    background and is applied this many inner steps after it starts (0: at once; must be
    < --sync-every)."""
    diagnose: bool = False
    """Measure each step's compression error (grad_rel_error, grad_cos_sim); costs time."""
    nonfinite: str = "auto"
    """NaN/Inf gradients in the codec: error (stop the step, naming the tensor), propagate
    (send them on, so fp16's GradScaler sees them and skips the step) or auto (propagate
    with --dtype fp16, else error)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB (PyTorch's default)."""
    eval_every: int = 50
    """Evaluate validation loss every N steps (and at the end); 0 = only at the end."""
    eval_steps: int = 10
    """Validation batches per evaluation and rank; always the same batches (fixed seed), so
    every evaluation of every run is on identical data."""
    target_loss: float = 0.0
    """Record time_to_target_s, the training time until val loss first reaches this; 0 = off."""
    ppl_budget_s: float = 0.0
    """Evaluate once training time first reaches this many seconds and record that val
    perplexity as ppl_at_fixed_time (compare codecs at equal time); 0 = off."""
    threads: int = 0
    """torch CPU threads per process; 0 = torch's default."""


@dataclass
class RunConfig:
    """The run directory: checkpoints, logs, results, profiling."""

    out: str = field(default="runs/train", metadata={"path": True})
    """Run directory (config, logs, results.jsonl, TensorBoard, checkpoints, traces)."""
    run_name: str = ""
    """Name in the results record; empty = the run directory's name."""
    resume: bool = False
    """Continue the run in --out from its latest checkpoint; its saved config.json replaces
    defaults and preset, and flags given now override it (typically --max-steps)."""
    allow_schedule_change: bool = False
    """Let --resume move the end of the lr schedule (decay_steps, else max_steps): the lr
    then jumps to where the new cosine is at that step. Without it such a resume is refused;
    a later resume must ask again (it is not taken from the saved config)."""
    ckpt_every: int = 0
    """Save a checkpoint every N steps (always at the end); 0 = only at the end."""
    keep_ckpts: int = 2
    """Keep the last K checkpoints; older ones are deleted."""
    log_every: int = 10
    """Print and record metrics every N steps."""
    timing_warmup: int = 3
    """Steps excluded from step-time statistics (allocator and cache warm-up)."""
    tensorboard: bool = True
    """Write TensorBoard scalars to <out>/tb."""
    wandb: bool = False
    """Log to Weights & Biases (rank 0; offline without WANDB_API_KEY; needs wandb installed)."""
    wandb_project: str = "gradzip"
    """W&B project name."""
    results_file: str = field(default="", metadata={"path": True})
    """A shared results.jsonl to append this run's record to as well; empty = only <out>."""
    profile: bool = False
    """Record torch.profiler traces of --profile-steps into <out>/profile."""
    profile_steps: str = "5:7"
    """Profiled steps A:B (inclusive)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    capture: str = field(default="", metadata={"path": True})
    """Capture the communicated gradient buckets into an HDF5 archive in this directory
    (`gradzip archive ls DIR`); empty = no capture. Needs --parallel ddp or fsdp."""
    capture_every: int = 0
    """Capture every N-th step (0 = every step, unless --capture-steps lists them)."""
    capture_steps: str = ""
    """Capture only these steps, comma-separated (e.g. 1,100,1000)."""
    capture_budget: str = ""
    """Stop capturing once this many bytes were captured (e.g. 10GB); empty = no limit."""
    capture_aggregated: bool = False
    """Also capture the aggregated (post-communication) gradient of each bucket."""


@dataclass
class JobConfig:
    """Everything a training run needs, one section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataOptions = field(default_factory=DataOptions)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobConfig:
        cfg = cls()
        apply_overrides(cfg, d, origin="config")
        return cfg

    def validate(self) -> None:
        """Raise ValueError naming the option for any value that cannot work.

        Values only (no files, devices or packages: ``gradzip.commands.train`` checks
        those), so a bad option fails at once, under --print-config too, before any data
        is prepared or anything is written.
        """
        _check_model(self.model)
        _check_data(self.data, self.model)
        _check_optim(self.optim)
        _check_train(self.train, self.run)
        method = method_of(self.train)  # parsed here, once: its errors name the flag
        check_method(method, parallel=self.train.parallel, optimizer=self.optim.optimizer,
                     grad_clip=self.optim.grad_clip, model=self.model)
        _check_capture(self, method)

    def schedule_horizon(self) -> int:
        """The step at which the cosine lr reaches its floor: decay_steps, else max_steps."""
        return self.optim.decay_steps or self.train.max_steps

    def resolve_paths(self) -> None:
        """Make every path option (fields with ``metadata["path"]``) absolute.

        Relative paths mean the current directory when the run is configured; the saved
        config.json must mean the same files when ``--resume`` or ``gradzip eval --ckpt``
        read it from elsewhere. Empty values (unset) and "stdlib" stay as they are.
        """
        for section, cls in SECTIONS.items():
            values = getattr(self, section)
            for f in dataclasses.fields(cls):
                kind, value = f.metadata.get("path"), getattr(values, f.name)
                if kind == "source":
                    setattr(values, f.name, [_absolute_source(s) for s in value])
                elif kind:
                    setattr(values, f.name, _absolute(value))


def _absolute(path: str) -> str:
    """``path`` made absolute (``~`` expanded, symlinks resolved); "" stays "" (unset)."""
    return str(Path(path).expanduser().resolve()) if path else path


def _absolute_source(spec: str) -> str:
    """A data source spec with its path made absolute, its ``:WEIGHT`` kept as typed;
    the built-in "stdlib" is a name, not a path (``open_source`` reads it first)."""
    from gradzip.train.data.sources import parse_spec

    name, _ = parse_spec(spec)
    if name == BUILTIN_SOURCE:
        return spec
    return _absolute(name) + spec[len(name):]


def _at_least(minimum: float, options: list[tuple[str, float]]) -> None:
    """Raise for the first ``(flag, value)`` below ``minimum``."""
    for flag, value in options:
        if value < minimum:
            raise ValueError(f"{flag} must be >= {minimum}, got {value}")


def _check_model(m: ModelConfig) -> None:
    """Architecture values GPT(...) would reject, or build into something broken."""
    _choice("--norm", m.norm, ("rmsnorm", "layernorm"))
    _choice("--pos", m.pos, ("rope", "learned"))
    _choice("--mlp", m.mlp, ("swiglu", "gelu"))
    _at_least(1, [("--n-layer", m.n_layer), ("--n-head", m.n_head), ("--dim", m.dim),
                  ("--max-seq-len", m.max_seq_len)])
    _at_least(0, [("--n-kv-head", m.n_kv_head), ("--ffn-dim", m.ffn_dim),
                  ("--model-vocab-size", m.vocab_size), ("--init-std", m.init_std)])
    if m.dim % m.n_head:
        raise ValueError(f"--dim {m.dim} must be divisible by --n-head {m.n_head}")
    kv = m.n_kv_head or m.n_head
    if m.n_head % kv:
        raise ValueError(f"--n-head {m.n_head} must be divisible by --n-kv-head {kv}")
    if m.pos == "rope" and (m.dim // m.n_head) % 2:
        raise ValueError("RoPE needs an even head size (dim / n_head)")
    if not 0 <= m.dropout < 1 or m.norm_eps <= 0 or m.rope_theta <= 0:
        raise ValueError("--dropout must be in [0, 1), --norm-eps and --rope-theta > 0")


def _check_data(d: DataOptions, m: ModelConfig) -> None:
    """Data values the preparation step would reject after creating its cache."""
    from gradzip.train.data.sources import parse_spec

    if not d.sources:
        raise ValueError("--dataset needs at least one source (e.g. stdlib)")
    for spec in d.sources:
        parse_spec(spec)  # a bad :WEIGHT
    _at_least(1, [("--seq-len", d.seq_len), ("--batch-size", d.batch_size)])
    _at_least(0, [("--max-tokens", d.max_tokens), ("--prefetch", d.prefetch)])
    if not d.tokenizer and d.vocab_size < 257:
        raise ValueError(f"--vocab-size must be >= 257 (256 bytes + end of text), "
                         f"got {d.vocab_size}")
    if d.seq_len > m.max_seq_len:
        raise ValueError(f"--seq-len {d.seq_len} exceeds the model's --max-seq-len "
                         f"{m.max_seq_len}")
    if not 0 <= d.val_fraction < 1:  # 0: no validation data, the run does not evaluate
        raise ValueError(f"--val-fraction must be in [0, 1), got {d.val_fraction}")


def _check_optim(o: OptimConfig) -> None:
    """Optimizer values AdamW or the schedule would reject once the model is built."""
    _choice("--optimizer", o.optimizer, ("adamw", "sgd"))
    if o.lr <= 0 or not 0 <= o.min_lr_ratio <= 1:
        raise ValueError("--lr must be > 0 and --min-lr-ratio in [0, 1]")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        raise ValueError(f"--beta1 and --beta2 must be in [0, 1), got {o.beta1}, {o.beta2}")
    _at_least(1, [("--grad-accum", o.grad_accum)])
    _at_least(0, [("--warmup-steps", o.warmup_steps), ("--decay-steps", o.decay_steps),
                  ("--weight-decay", o.weight_decay), ("--eps", o.eps),
                  ("--grad-clip", o.grad_clip)])


def _check_train(t: TrainConfig, r: RunConfig) -> None:
    """Loop and run-directory values (the files and devices are checked before the run)."""
    _choice("--device", t.device, ("auto", "cpu", "cuda"))
    _choice("--dtype", t.dtype, ("fp32", "bf16", "fp16"))
    _choice("--parallel", t.parallel, ("none", "ddp", "fsdp"))
    _choice("--nonfinite", t.nonfinite, ("auto", "error", "propagate"))
    _at_least(1, [("--max-steps", t.max_steps), ("--eval-steps", t.eval_steps),
                  ("--log-every", r.log_every), ("--keep-ckpts", r.keep_ckpts)])
    _at_least(0, [("--max-time", t.max_time), ("--eval-every", t.eval_every),
                  ("--ckpt-every", r.ckpt_every), ("--threads", t.threads),
                  ("--target-loss", t.target_loss), ("--timing-warmup", r.timing_warmup),
                  ("--codec-start-step", t.codec_start_step),
                  ("--ppl-budget-s", t.ppl_budget_s)])
    if not 0 <= t.seed < 2**32:  # NumPy's seed range
        raise ValueError(f"--seed must be in [0, 2**32), got {t.seed}")
    if t.bucket_cap_mb <= 0:
        raise ValueError(f"--bucket-cap-mb must be > 0, got {t.bucket_cap_mb}")
    if t.dtype == "fp16" and t.device == "cpu":
        raise ValueError("--dtype fp16 needs CUDA (its grad scaler); use bf16 on CPU")
    first, _ = parse_profile_steps(r.profile_steps)
    if r.profile and first > t.max_steps:
        raise ValueError(f"--profile-steps {r.profile_steps} starts after --max-steps "
                         f"{t.max_steps}: nothing would be profiled")


def _check_capture(cfg: JobConfig, method: Any) -> None:
    """Capture options: parseable, and a path that communicates through gradzip."""
    r, t = cfg.run, cfg.train
    if not r.capture:
        if r.capture_every or r.capture_steps or r.capture_budget or r.capture_aggregated:
            raise ValueError("--capture-every/-steps/-budget/-aggregated need --capture DIR")
        return
    if t.parallel == "none":
        raise ValueError("--capture records what ranks communicate: use --parallel ddp or "
                         "fsdp (under torchrun, or one process)")
    if method.kind != "codec":
        raise ValueError(f"--capture wraps gradzip's per-step hooks, not {method}; use a "
                         "gradzip codec (`none` for the plain all-reduce)")
    _at_least(0, [("--capture-every", r.capture_every)])
    capture_schedule(r)


def capture_schedule(r: RunConfig) -> dict[str, Any]:
    """The ``gradzip.capture.Capture`` keywords of the --capture-* options."""
    from gradzip.capture.layout import parse_size

    try:
        steps = ([int(s) for s in r.capture_steps.split(",") if s.strip()]
                 if r.capture_steps else None)
    except ValueError:
        raise ValueError(f"--capture-steps must be step numbers separated by ',', got "
                         f"{r.capture_steps!r}") from None
    try:
        budget = parse_size(r.capture_budget) if r.capture_budget else None
    except ValueError as e:
        raise ValueError(f"--capture-budget: {e}") from None
    return {"every": r.capture_every or None, "steps": steps, "budget": budget,
            "aggregated": r.capture_aggregated}


def method_of(t: TrainConfig) -> Any:
    """The run's ``gradzip.comm.method.Method`` from its flags (--codec, --codec-groups,
    --codec-start-step, --outer and its options), parsed once; errors name the flag."""
    from gradzip.comm.method import local_method, parse_method

    if t.outer != "none":
        if t.codec != "none":
            raise ValueError("--outer synchronizes rarely instead of every step: give the "
                             "pseudo-gradients' codec with --outer-codec, not --codec")
        if t.codec_groups or t.codec_start_step:
            raise ValueError("--codec-groups and --codec-start-step shape the per-step "
                             "codec; --outer takes --outer-codec")
        return local_method(t.outer, sync_every=t.sync_every, lr=t.outer_lr,
                            momentum=t.outer_momentum, fragments=t.fragments,
                            overlap_steps=t.overlap_steps, codec=t.outer_codec)
    if t.codec == "none" and (t.codec_groups or t.codec_start_step):
        raise ValueError("--codec-groups and --codec-start-step need a --codec")
    return parse_method(t.codec, groups=codec_groups(t.codec_groups),
                        start_step=t.codec_start_step or None)


def check_method(method: Any, *, parallel: str, optimizer: str, grad_clip: float,
                 model: ModelConfig) -> None:
    """Whether ``method`` can run with these values; on FSDP2 also against the units
    ``parallel.apply_fsdp`` makes of the model (``CodecMethod.check``)."""
    units = _fsdp_units(model) if parallel == "fsdp" and method.kind == "codec" else None
    method.check(parallel=parallel, optimizer=optimizer, grad_clip=grad_clip,
                 blocks=model.n_layer, fsdp_units=units)


def _fsdp_units(m: ModelConfig) -> dict[str, list[str]]:
    """The model's parameter names by ``fully_shard`` unit."""
    units: dict[str, list[str]] = {}
    for name in _parameter_names(m):
        units.setdefault(fsdp_unit_of(name), []).append(name)
    return units


def fsdp_unit_of(param: str) -> str:
    """The ``fully_shard`` unit holding a GPT parameter, as ``parallel.apply_fsdp`` wraps
    them: each transformer block ("blocks.3"), the rest in the root ("")."""
    parts = param.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else ""


def _parameter_names(m: ModelConfig) -> list[str]:
    """GPT's parameter names for ``m``, from a model on the meta device (no memory)."""
    import torch

    from gradzip.train.model import GPT

    with torch.device("meta"):
        model = GPT(dataclasses.replace(m, vocab_size=m.vocab_size or 1))
    return [name for name, _ in model.named_parameters()]


def nonfinite_policy(t: TrainConfig) -> str:
    """The codec's NaN/Inf policy: ``auto`` propagates when a GradScaler will skip the step."""
    if t.nonfinite != "auto":
        return t.nonfinite
    return "propagate" if t.dtype == "fp16" else "error"


def codec_groups(groups: str) -> dict[str, str]:
    """``--codec-groups`` "PATTERNS=SPEC;..." as ``{patterns: spec}``, in order."""
    table = {}
    for item in filter(None, (g.strip() for g in groups.split(";"))):
        patterns, sep, spec = item.partition("=")
        if not sep or not patterns.strip() or not spec.strip():
            raise ValueError(f"--codec-groups: {item!r} is not PATTERNS=SPEC "
                             "(e.g. '*.bias,*norm*=none')")
        table[patterns.strip()] = spec.strip()
    return table


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")


def parse_profile_steps(text: str) -> tuple[int, int]:
    """``"5:7"`` -> (5, 7): the first and last profiled step, inclusive."""
    try:
        a, b = (int(s) for s in text.split(":"))
    except ValueError:
        raise ValueError(f"--profile-steps must look like A:B (e.g. 5:7), got {text!r}") from None
    if not 1 <= a <= b:
        raise ValueError(f"--profile-steps A:B needs 1 <= A <= B, got {text!r}")
    return a, b


# --------------------------------------------------------------------- sections and fields
SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataOptions, "optim": OptimConfig,
    "train": TrainConfig, "run": RunConfig,
}


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from the source."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (frozen app): help texts are then empty
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def fields_of(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """(field, resolved type) pairs of a section dataclass."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _coerce(section: str, name: str, value: Any, typ: Any) -> Any:
    """Check a value from a file against the field type (ints may stand for floats)."""
    where = f"{section}.{name}"
    if typing.get_origin(typ) is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where} must be a list of strings, got {value!r}")
        return list(value)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (typ is bool) or not isinstance(value, typ):
        raise ValueError(f"{where} must be {typ.__name__}, got {value!r}")
    return value


def apply_overrides(cfg: JobConfig, overrides: dict[str, Any], origin: str) -> None:
    """Set ``{section: {field: value}}`` on cfg, with clear errors for unknown names."""
    for section, values in overrides.items():
        if section.startswith("_"):  # "_doc" and other comments in preset files
            continue
        if section not in SECTIONS:
            raise ValueError(f"{origin}: unknown section {section!r}; "
                             f"expected one of {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ValueError(f"{origin}: section {section!r} must be a table/object")
        target = getattr(cfg, section)
        known = {f.name: t for f, t in fields_of(SECTIONS[section])}
        for name, value in values.items():
            if name not in known:
                raise ValueError(f"{origin}: unknown option {section}.{name}; "
                                 f"known: {', '.join(known)}")
            setattr(target, name, _coerce(section, name, value, known[name]))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A .toml or .json config file as ``{section: {field: value}}``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        if path.suffix == ".toml":
            return tomllib.loads(path.read_text())
        if path.suffix == ".json":
            return json.loads(path.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot parse config file {path}: {e}") from None
    raise ValueError(f"config file must end in .toml or .json: {path}")


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def read_preset(name: str) -> dict[str, Any]:
    path = PRESET_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(presets())}")
    return json.loads(path.read_text())


def resolve(
    cli: dict[str, dict[str, Any]] | None = None,
    config_file: str | Path | None = None,
    base: dict[str, Any] | None = None,
) -> JobConfig:
    """Build the run's configuration: defaults or ``base``, preset, file, then CLI.

    ``base`` is a saved, already resolved configuration (resume): it stands in for the
    defaults and the preset, so the model preset is not re-applied over it. Paths come
    out absolute (``JobConfig.resolve_paths``) and every value is checked (``validate``).
    """
    cli = cli or {}
    from_file = read_config_file(config_file) if config_file else {}
    cfg = JobConfig()
    if base is not None:
        apply_overrides(cfg, base, origin="saved config")
    else:
        name = (cli.get("model", {}).get("name") or from_file.get("model", {}).get("name")
                or cfg.model.name)
        apply_overrides(cfg, read_preset(name), origin=f"preset {name}")
        cfg.model.name = name
    apply_overrides(cfg, from_file, origin=str(config_file))
    apply_overrides(cfg, cli, origin="command line")
    cfg.resolve_paths()
    cfg.validate()
    return cfg
