"""What values a run can work with, checked before anything is prepared or written.

Each check takes the plain values of its concern (an architecture, an optimizer, the
loop's options, the run directory's); the run's ``Method`` (``gradzip.comm.method``) is
parsed here from its flags and checked against the parallel kind, the optimizer and
the model's blocks and FSDP2 units. ``validate`` is ``JobConfig.validate``. The few
settings derived from options (the codec's NaN policy, the capture schedule, the
profiled steps) live here too, beside the checks that read them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gradzip.train.config import (
    DataOptions,
    JobConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from gradzip.train.restart import Every


def validate(cfg: JobConfig) -> None:
    """Raise ValueError naming the option for any value of ``cfg`` that cannot work."""
    _check_model(cfg.model)
    _check_data(cfg.data, cfg.model)
    _check_optim(cfg.optim)
    _check_train(cfg.train, cfg.run)
    method = method_of(cfg.train, cfg.optim.optimizer)  # parsed once: errors name the flag
    check_method(method, parallel=cfg.train.parallel, optimizer=cfg.optim.optimizer,
                 grad_clip=cfg.optim.grad_clip, model=cfg.model)
    _check_capture(cfg, method)
    if cfg.optim.optimizer == "adamw_global" and method.kind != "local":
        raise ValueError("--optimizer adamw_global sizes each rank's step for the mean of "
                         "the ranks' steps: it needs a local-update --outer (diloco, "
                         "average, sparseloco); with a per-step gradient sum use adamw")
    if cfg.optim.optimizer == "muon" and cfg.train.parallel in ("fsdp", "hsdp"):
        raise ValueError("--optimizer muon runs on whole matrices: use --parallel ddp (FSDP2 "
                         "shards them, and Muon's Newton-Schulz step needs each one whole)")
    if cfg.train.hierarchical and (cfg.train.parallel != "ddp"
                                   or method.kind not in ("codec", "auto")):
        raise ValueError("--hierarchical compresses DDP's buckets between nodes: it needs "
                         "--parallel ddp and a gradzip --codec or auto (for FSDP2 across "
                         "nodes use --parallel hsdp)")


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
    _choice("--optimizer", o.optimizer, ("adamw", "sgd", "muon", "adamw_global"))
    if o.optimizer == "adamw_global" and o.beta1 == 0:
        raise ValueError("--optimizer adamw_global tells noise from signal by how much of it "
                         "Adam's first moment averages away: it needs --beta1 > 0")
    if o.optimizer == "muon":
        from gradzip.train.muon import require_muon

        require_muon()
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
    _choice("--parallel", t.parallel, ("none", "ddp", "fsdp", "hsdp"))
    _choice("--nonfinite", t.nonfinite, ("auto", "error", "propagate"))
    _choice("--outer", t.outer, ("none", "diloco", "average", "sparseloco", "snoo"))
    _at_least(1, [("--max-steps", t.max_steps), ("--eval-steps", t.eval_steps),
                  ("--log-every", r.log_every), ("--keep-ckpts", r.keep_ckpts)])
    _at_least(0, [("--node-size", t.node_size)])
    _at_least(0, [("--max-time", t.max_time), ("--eval-every", t.eval_every),
                  ("--threads", t.threads),
                  ("--target-loss", t.target_loss), ("--timing-warmup", r.timing_warmup),
                  ("--codec-start-step", t.codec_start_step),
                  ("--ppl-budget-s", t.ppl_budget_s)])
    Every.parse(r.ckpt_every)  # steps or a time, else a clear error
    if not 0 <= t.seed < 2**32:  # NumPy's seed range
        raise ValueError(f"--seed must be in [0, 2**32), got {t.seed}")
    if t.bucket_cap_mb <= 0:
        raise ValueError(f"--bucket-cap-mb must be > 0, got {t.bucket_cap_mb}")
    if t.comm_timeout <= 0:
        raise ValueError(f"--comm-timeout must be > 0 seconds, got {t.comm_timeout}")
    if t.dtype == "fp16" and t.device == "cpu":
        raise ValueError("--dtype fp16 needs CUDA (its grad scaler); use bf16 on CPU")
    _check_replicas(t)
    first, _ = parse_profile_steps(r.profile_steps)
    if r.profile and first > t.max_steps:
        raise ValueError(f"--profile-steps {r.profile_steps} starts after --max-steps "
                         f"{t.max_steps}: nothing would be profiled")


def _check_replicas(t: TrainConfig) -> None:
    """--replicas: threads of one process standing in for gloo ranks of DDP on the CPU."""
    from gradzip.comm.netns import rate_bits_per_second

    _at_least(0, [("--replicas", t.replicas), ("--replica-latency-us", t.replica_latency_us)])
    rate_bits_per_second(t.replica_link)  # else a clear error
    if not t.replicas:
        return
    if t.parallel != "ddp":
        raise ValueError(f"--replicas runs data-parallel replicas: use --parallel ddp (with "
                         f"any codec or --outer), not {t.parallel}")
    if t.device == "cuda":
        raise ValueError("--replicas runs on the CPU (each replica's time is its CPU time): "
                         "use --device cpu")
    if t.threads > 1:
        raise ValueError(f"--replicas gives each replica one torch thread (its CPU time is "
                         f"then its compute): drop --threads {t.threads}")


def _check_capture(cfg: JobConfig, method: Any) -> None:
    """Capture options: parseable, and a path that communicates through gradzip."""
    r, t = cfg.run, cfg.train
    if not r.capture:
        if r.capture_every or r.capture_steps or r.capture_budget or r.capture_aggregated:
            raise ValueError("--capture-every/-steps/-budget/-aggregated need --capture DIR")
        return
    if t.parallel not in ("ddp", "fsdp"):
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


def method_of(t: TrainConfig, optimizer: str = "adamw") -> Any:
    """The run's ``gradzip.comm.method.Method`` from its flags (--codec, --codec-groups,
    --codec-start-step, --outer and its options; a local-update method names a Muon
    ``--optimizer``, its inner one), parsed once; errors name the flag."""
    from gradzip.comm.method import INNER_OPTIMIZERS, local_method, parse_method

    if t.outer == "snoo":
        return _snoo_method(t)
    if t.outer != "none":
        if t.codec != "none":
            raise ValueError("--outer synchronizes rarely instead of every step: give the "
                             "pseudo-gradients' codec with --outer-codec, not --codec")
        if t.codec_groups or t.codec_start_step:
            raise ValueError("--codec-groups and --codec-start-step shape the per-step "
                             "codec; --outer takes --outer-codec")
        return local_method(t.outer, sync_every=t.sync_every, lr=t.outer_lr,
                            momentum=t.outer_momentum, fragments=t.fragments,
                            overlap_steps=t.overlap_steps, codec=t.outer_codec,
                            alpha=t.outer_alpha if t.outer_alpha >= 0 else None,
                            inner=optimizer if optimizer in INNER_OPTIMIZERS[1:] else None,
                            ramp=t.sync_ramp)
    if t.sync_ramp:
        raise ValueError("--sync-ramp ramps the H of --outer diloco, average or sparseloco: "
                         "add one, or drop --sync-ramp")
    if t.codec == "none" and (t.codec_groups or t.codec_start_step):
        raise ValueError("--codec-groups and --codec-start-step need a --codec")
    return parse_method(t.codec, groups=codec_groups(t.codec_groups),
                        start_step=t.codec_start_step or None)


def _snoo_method(t: TrainConfig) -> Any:
    """``--outer snoo``: DDP every step with --codec, an outer Nesterov step every
    --sync-every steps; the options of the other outer kinds are refused."""
    from gradzip.comm.method import CodecMethod, SnooMethod, parse_method

    if t.outer_codec != "none" or t.fragments != 1 or t.overlap_steps or t.outer_alpha >= 0 \
            or t.sync_ramp:
        raise ValueError("--outer snoo communicates every step with --codec (its outer step "
                         "sends nothing): --outer-codec, --fragments, --overlap-steps, "
                         "--outer-alpha and --sync-ramp do not apply")
    step = parse_method(t.codec, groups=codec_groups(t.codec_groups),
                        start_step=t.codec_start_step or None)
    if not isinstance(step, CodecMethod):
        raise ValueError(f"--outer snoo takes a gradzip --codec (fp16, int8, ...), not {step}")
    return SnooMethod(t.sync_every, t.outer_lr, t.outer_momentum,
                      None if step.plain else step)


def check_method(method: Any, *, parallel: str, optimizer: str, grad_clip: float,
                 model: ModelConfig) -> None:
    """Whether ``method`` can run with these values; on FSDP2 also against the units
    ``parallel.apply_fsdp`` makes of the model (``CodecMethod.check``)."""
    units = (_fsdp_units(model) if parallel in ("fsdp", "hsdp") and method.kind == "codec"
             else None)
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
