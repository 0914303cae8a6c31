"""Training configuration: one dataclass per concern, a docstring per field.

Three modules, one concern each:

* this one: the sections (model, data, optimizer, loop, run directory) and
  ``JobConfig``; the field docstrings are the ``--help`` text (``field_docs`` reads
  them from this file's source, so documentation and CLI cannot drift apart);
* ``checks.py``: what values can work (``JobConfig.validate``), each check on plain
  values, the run's ``Method`` among them;
* ``configure.py``: how a run's configuration is resolved in layers (defaults, model
  preset, config file, flags; or a saved ``config.json`` on ``--resume``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    """adamw; sgd: plain SGD without momentum (for codecs that step with their own
    momentum, as DeMo does: --codec demo needs --optimizer sgd --grad-clip 0); muon: Muon
    on the hidden weight matrices, AdamW on embeddings and norms, one --lr (as MuLoCo
    runs DiLoCo's inner steps; not with --parallel fsdp or hsdp); adamw_global: AdamW
    whose step is sized for the mean of the ranks' steps (each divides by its estimate
    of the mean gradient's second moment, not its own; with --outer only)."""
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
    """none (one process), ddp (DistributedDataParallel), fsdp (FSDP2 fully_shard per block)
    or hsdp (FSDP2 sharded within a node, replicated across nodes; --codec compresses the
    replicate link between nodes)."""
    node_size: int = 0
    """Ranks per node (consecutive ranks, as torchrun places them): HSDP's shard groups,
    and the nodes of --hierarchical; 0 = torchrun's LOCAL_WORLD_SIZE. Must divide the
    world size."""
    hierarchical: bool = False
    """With --parallel ddp and a --codec: reduce each bucket within a node uncompressed,
    compress only between nodes (each rank sends 1/node-size of it), then share within
    the node; records report the intra_node and inter_node links."""
    codec: str = "none"
    """Gradient codec spec, e.g. "ef | topk(ratio=0.01)", or a JSON policy
    ({"codec": ..., "groups": [...], "start_step": N}); none = uncompressed all-reduce;
    auto (or auto(candidates="fp16; int8")) = the 16-bit reduction unless a candidate
    measures faster on this link (DDP, --hierarchical, FSDP, HSDP)."""
    codec_groups: str = ""
    """Per-parameter codecs, "PATTERNS=SPEC;...", e.g. "*.bias,*norm*,*emb*=none": matching
    parameter names (first match wins) take that codec; the rest take --codec."""
    codec_start_step: int = 0
    """Optimizer steps communicated uncompressed before --codec starts (PowerSGD's start
    iteration, DGC's warm-up)."""
    outer: str = "none"
    """Local updates instead of per-step gradient sync: diloco (DiLoCo: every
    --sync-every steps, an outer Nesterov step on the averaged pseudo-gradient), average
    (post-local SGD, the control) or sparseloco (SparseLoCo's outer step: lr 1, no
    momentum; give its codec with --outer-codec, see `gradzip compare`'s sparseloco(...));
    the model is then not wrapped by DDP. snoo: DDP every step (--codec) plus a Nesterov
    outer step every --sync-every steps, the matched baseline. none = synchronize every
    step. Needs --parallel ddp."""
    sync_every: int = 32
    """With --outer: inner steps between synchronizations (DiLoCo's H)."""
    sync_ramp: int = 0
    """With --outer (one fragment, no overlap): inner steps over which H ramps up from 1
    (a synchronization every step, as DDP) to --sync-every, each interval growing with the
    step it starts at; 0 = H from the start."""
    outer_lr: float = 0.7
    """With --outer diloco: the outer SGD learning rate."""
    outer_momentum: float = 0.9
    """With --outer diloco: the outer Nesterov momentum."""
    outer_codec: str = "none"
    """With --outer: the codec spec the pseudo-gradients cross the link with (e.g. int8);
    none = the fp32 all-reduce."""
    outer_alpha: float = -1.0
    """With --outer: Streaming DiLoCo's mixing after an outer step, weights = alpha * local
    + (1 - alpha) * synchronized (the paper: 0.5); -1 = no mixing: the synchronized
    weights plus the local change since the exchange began (--overlap-steps)."""
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
    comm_timeout: float = 600.0
    """Seconds a collective may take (the process group's timeout): past it every rank
    stops with a one-line error, a checkpoint of the last completed step and a record,
    instead of hanging (a link that is down, a peer that is gone)."""
    replicas: int = 0
    """Run W ranks as W replicas in this one process (one thread and one CPU thread each,
    with --parallel ddp, on the CPU): the same training, codecs and link bytes as W gloo
    ranks; each step's time is one replica's CPU time plus the link model's time for its
    bytes (--replica-link, --replica-latency-us); 0 = off."""
    replica_link: str = "1gbit"
    """With --replicas: the modelled link of every replica (a tc rate: 100mbit, 1gbit, ...)."""
    replica_latency_us: float = 50.0
    """With --replicas: the modelled latency of one collective, microseconds."""


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
    ckpt_every: str = field(default="0", metadata={"int_ok": True, "metavar": "N|TIME"})
    """Save a checkpoint every N steps, or every span of training time (30s, 10m, 1h;
    checked at each logged step), and always at the end; 0 = only at the end."""
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
        from gradzip.train.configure import apply_overrides

        cfg = cls()
        apply_overrides(cfg, d, origin="config")
        return cfg

    def validate(self) -> None:
        """Raise ValueError naming the option for any value that cannot work.

        Values only (no files, devices or packages: ``gradzip.commands.train`` checks
        those), so a bad option fails at once, under --print-config too, before any data
        is prepared or anything is written.
        """
        from gradzip.train.checks import validate

        validate(self)

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
