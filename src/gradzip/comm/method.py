"""``Method``: how gradients cross the link, parsed once where text enters.

One grammar for the three kinds (``gradzip compare --methods`` and the records use it;
``gradzip train``'s flags say the same):

* ``CodecMethod`` — gradzip's hooks with a codec policy, every step:
  ``"ef | topk(ratio=0.01)"``, or a JSON policy (per-parameter codecs, a start step);
  ``"none"`` is the plain all-reduce through gradzip's hook.
* ``TorchHookMethod`` — PyTorch's own DDP comm hook: ``"torch:none"``, ``"torch:fp16"``,
  ``"torch:bf16"``, ``"torch:powersgd(rank=4, start_iter=2)"``.
* ``LocalUpdateMethod`` — local steps, synchronized every H steps, the pseudo-gradients
  through an optional codec: ``"diloco(sync_every=32, lr=0.7, momentum=0.9) | int8"``,
  ``"average(sync_every=8)"`` (post-local SGD, the control), and
  ``"sparseloco(sync_every=30, k=64, chunk=4096, bits=2, ef_decay=0.95)"`` (SparseLoCo:
  outer SGD with lr 1 and no momentum on error-fed, chunked top-k, 2-bit pseudo-gradients;
  its codec is spelled out in the canonical text).
* ``SnooMethod`` — ``"snoo(sync_every=32, lr=0.7, momentum=0.9)"``: DDP every step (an
  optional ``| CODEC``) plus a Nesterov outer step on the K-step pseudo-gradient (SNOO,
  DiLoCo's one-worker form): the matched baseline for local-update methods.

``parse_method`` is called at the edge (the CLI's flags, compare's ``--methods``,
``attach``); everything after takes the object, whose codecs are already built (their
specs are not parsed again). ``check`` validates it against plain values of the run
(the parallel kind, the optimizer, clipping, the model's blocks), ``to_json`` is what a
results record stores, ``str`` the canonical text and ``train_flags`` the ``gradzip
train`` flags that run it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

from gradzip.codecs.chain import Codec
from gradzip.codecs.registry import SpecError
from gradzip.codecs.sharedtopk import SELECTIONS
from gradzip.comm.attach import refuse_flat, unit_group
from gradzip.comm.auto import AutoOptions, is_auto
from gradzip.comm.outer import OUTER_KINDS, check_options
from gradzip.comm.policy import Policy
from gradzip.comm.torch_hooks import HOOKS, PREFIX, parse_torch_method

#: parallel kinds a per-step gradzip codec runs on (``none``: one process, nothing to send)
CODEC_PARALLEL = ("ddp", "fsdp", "hsdp")
_LOCAL = re.compile(r"^\s*(\w+)\s*\((.*?)\)\s*(?:\|\s*(.+))?$|^\s*(\w+)\s*(?:\|\s*(.+))?$",
                    re.DOTALL)
#: ``diloco(...)`` keys -> (LocalUpdateMethod field, type, ``gradzip train`` flag)
LOCAL_KEYS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "sync_every": ("sync_every", int, "--sync-every"),
    "lr": ("lr", float, "--outer-lr"),
    "momentum": ("momentum", float, "--outer-momentum"),
    "fragments": ("fragments", int, "--fragments"),
    "overlap": ("overlap_steps", int, "--overlap-steps"),
    "alpha": ("alpha", float, "--outer-alpha"),
    "inner": ("inner", lambda v: _inner_optimizer(v), "--optimizer"),
    "ramp": ("ramp", int, "--sync-ramp"),
}
#: inner optimizers a local-update method may name (``inner=muon``: MuLoCo;
#: ``inner=adamw_global``: AdamW sized for the mean of the replicas' steps); unnamed, the
#: trainer's --optimizer (AdamW, first here)
INNER_OPTIMIZERS = ("adamw", "muon", "adamw_global")


def _inner_optimizer(value: str) -> str | None:
    """``inner=``'s optimizer; None for AdamW, the default (one spelling per method)."""
    if value not in INNER_OPTIMIZERS:
        raise ValueError(f"inner must be one of {', '.join(INNER_OPTIMIZERS)}, got {value!r}")
    return None if value == "adamw" else value
#: separates the codecs of a method's fragments: ``diloco(fragments=2) | int8 / fp16``
FRAGMENT_SEPARATOR = " / "
#: ``sparseloco(...)`` keys that build its codec -> type (without an explicit ``| CODEC``)
def _value_quantizer(text: str) -> str:
    """``values=``: how SparseLoCo's kept values are quantized."""
    if text not in VALUE_QUANTIZERS:
        raise ValueError(f"values must be one of {', '.join(VALUE_QUANTIZERS)}, got {text!r}")
    return text


def _selection(text: str) -> str:
    """``select=``: who picks ``aggregate=shared``'s positions (``sharedtopk``)."""
    if text not in SELECTIONS:
        raise ValueError(f"select must be one of {', '.join(SELECTIONS)}, got {text!r}")
    return text


def _aggregation(text: str) -> str:
    """``aggregate=``: how SparseLoCo's payloads cross the link."""
    if text not in SPARSELOCO_AGGREGATIONS:
        raise ValueError(f"aggregate must be one of {', '.join(SPARSELOCO_AGGREGATIONS)}, "
                         f"got {text!r}")
    return text


#: ``sparseloco(aggregate=...)``: all-gathered as the paper does (``gather``: each rank
#: sends (W-1) payloads' worth), or reduced in two phases (each rank's chunk summed by
#: its owner and sent on re-encoded: about two payloads' worth at any W, and a second
#: lossy step), or whichever the link byte model says sends less (``auto``), or
#: ``shared``: positions every rank shares (the union of each rank's top ceil(k/W), or
#: with ``select=leader`` one rotating rank's), the values all-reduced in
#: 16 bits (``sharedtopk``: one position and 2 (W-1)/W values per
#: kept entry at any W, no second lossy step; ``bits=8`` sums int8 against a scale
#: per chunk shared by every rank instead; ``tile`` and ``values`` do not apply)
SPARSELOCO_AGGREGATIONS = ("gather", "two_phase", "auto", "shared")
#: ``sparseloco(...)`` keys that describe the gathered payload, refused with ``shared``
GATHER_ONLY_KEYS = ("tile", "values")
#: ``sparseloco(aggregate=shared, bits=...)``: the bits of a summed value -> sharedtopk's
SHARED_VALUE_BITS = {16: "fp16", 8: "int8"}
#: ``sparseloco(values=...)``: gradzip's equal-count bins (``centroid``, the default) or
#: templar's bins over a multiple of the std with a table of bin means (``stdbins``)
VALUE_QUANTIZERS = ("centroid", "stdbins")
SPARSELOCO_KEYS: dict[str, Callable[[str], Any]] = {
    "k": int, "density": float, "chunk": int, "tile": int, "bits": int, "ef_decay": float,
    "values": _value_quantizer, "aggregate": _aggregation, "select": _selection}
#: ``snoo(...)`` keys: its own outer step, no fragments
SNOO_KEYS = ("sync_every", "lr", "momentum")
#: the defaults each kind starts from (SparseLoCo's public configuration: H=30, outer
#: lr 1, no momentum, 64 of every 4096 entries, 2 bits, error feedback decay 0.95)
DEFAULTS: dict[str, dict[str, Any]] = {
    "diloco": {}, "average": {}, "snoo": {},
    "sparseloco": {"sync_every": 30, "lr": 1.0, "momentum": 0.0},
}
SPARSELOCO_CODEC = {"k": 64, "density": None, "chunk": 4096, "tile": None, "bits": 2,
                    "ef_decay": 0.95, "values": "centroid", "aggregate": "gather",
                    "select": "each"}


def sparseloco_codec(k: int | None = 64, density: float | None = None, chunk: int = 4096,
                     bits: int = 2, ef_decay: float = 0.95, tile: int | None = None,
                     values: str = "centroid", aggregate: str = "gather",
                     select: str = "each") -> str:
    """SparseLoCo's pseudo-gradient codec as a gradzip chain: error feedback decayed by
    ``ef_decay``, the top ``k`` (or ``density`` x ``chunk``) of every ``chunk`` entries
    (or, with ``tile``, of every tile x tile block of each matrix, as templar selects),
    their values in ``bits`` bits (``centroid``, or with ``values=stdbins`` templar's
    bins over 6 standard deviations), indices and values entropy-coded (``ans``),
    payloads all-gathered as the paper does (no second lossy step; ``aggregate``:
    ``SPARSELOCO_AGGREGATIONS``; ``shared`` builds ``ef | sharedtopk`` instead, whose
    positions ``select`` picks)."""
    if aggregate == "shared":
        if bits not in SHARED_VALUE_BITS and bits != SPARSELOCO_CODEC["bits"]:
            raise ValueError(f"aggregate=shared sums values in "
                             f"{' or '.join(map(str, SHARED_VALUE_BITS))} bits, got {bits}")
        kept = k if density is None else max(1, round(density * chunk))
        summed = SHARED_VALUE_BITS.get(bits, "fp16")  # the gather's default 2: fp16
        return (f"ef(beta={ef_decay:g}) | sharedtopk(k={kept}, chunk={chunk}, "
                f"values={summed}, select={select})")
    keep = f"ratio={density:g}" if density is not None else f"k={k}"
    where = f"tile={tile}" if tile is not None else f"chunk={chunk}"
    quantize = f"centroid(bits={bits})" if values == "centroid" else f"stdbins(bins={2**bits})"
    return (f"ef(beta={ef_decay:g}) | topk({keep}, {where}) | {quantize} "
            f"| ans | aggregate={aggregate}")


@dataclass(frozen=True)
class CodecMethod:
    """Every step through gradzip's hook (DDP or FSDP2), with a codec policy."""

    policy: Policy
    #: the text ``none``: gradzip need not be in the path at all (FSDP2 then keeps its
    #: own reduce-scatter); a policy that names ``none`` still attaches gradzip's hook
    plain: bool = False
    kind: ClassVar[str] = "codec"

    def __str__(self) -> str:
        return str(self.policy)

    @property
    def codecs(self) -> list[Codec]:
        """The policy's codecs by group (0: the default), built once when parsed."""
        return self.policy.codecs

    @property
    def steps_plainly(self) -> bool:
        """A codec (DeMo) that sends the sign of its own momentum: the optimizer's step
        must be plain SGD without clipping, or the signs would be rescaled."""
        return any(s.name == "demo" for c in self.codecs for s in c.stages)

    def to_json(self) -> Any:
        """The codec's canonical JSON, or the policy's (groups, start step); None for
        ``none``."""
        if self.plain or str(self.policy) == "none":
            return None
        if not self.policy.groups and not self.policy.start_step:
            return self.codecs[0].to_json()
        return self.policy.to_json()

    def check(self, *, parallel: str, optimizer: str, grad_clip: float,
              fsdp_units: dict[str, list[str]] | None = None, **_: Any) -> None:
        """What the run's plain values allow (ValueError naming the flag): a parallel
        kind that communicates, DeMo's plain step, and on FSDP2 (``fsdp_units``: each
        ``fully_shard`` unit's parameter names) what ``attach`` would refuse there."""
        if self.plain:
            return
        if parallel not in CODEC_PARALLEL:
            raise ValueError("--codec compresses communication between ranks: it needs "
                             "--parallel ddp or fsdp (ddp also runs as a single process)")
        if parallel in ("fsdp", "hsdp") and fsdp_units is not None:
            used = {unit_group(self.policy, unit, names) for unit, names in fsdp_units.items()}
            refuse_flat([self.codecs[g] for g in sorted(used)], "FSDP2")
        if self.steps_plainly and (optimizer != "sgd" or grad_clip):
            raise ValueError("--codec demo sends the sign of its own momentum's top DCT "
                             "components: the step must be plain, so use --optimizer sgd "
                             "--grad-clip 0 (AdamW or clipping would rescale the signs)")

    def train_flags(self) -> list[str]:
        flags = ["--codec", str(self)]
        if self.steps_plainly:  # as DeMo runs
            flags += ["--optimizer", "sgd", "--grad-clip", "0"]
        return flags


@dataclass(frozen=True)
class TorchHookMethod:
    """PyTorch's own DDP comm hook, measured with gradzip's ``CommStats``."""

    text: str  # as given: records and compare's runs are named by it
    hook: str  # none, fp16, bf16, powersgd
    params: dict[str, int] = field(default_factory=dict)
    kind: ClassVar[str] = "torch"

    @classmethod
    def parse(cls, text: str) -> TorchHookMethod:
        hook, params = parse_torch_method(text)
        return cls(text.strip(), hook, params)

    def __str__(self) -> str:
        return self.text

    def to_json(self) -> dict[str, Any]:
        return {"torch_hook": HOOKS[self.hook], **self.params}

    def check(self, *, parallel: str, **_: Any) -> None:
        if parallel != "ddp":
            raise ValueError(f"--codec {self} is a PyTorch DDP comm hook: it needs "
                             f"--parallel ddp (got {parallel})")

    def train_flags(self) -> list[str]:
        return ["--codec", str(self)]


@dataclass(frozen=True)
class AutoMethod:
    """``auto``: on DDP, FSDP2 or HSDP's replicate link, the 16-bit reduction unless a
    candidate codec is measurably faster on this run's link and hardware
    (``comm/auto.py``)."""

    options: AutoOptions
    kind: ClassVar[str] = "auto"

    def __str__(self) -> str:
        return str(self.options)

    @property
    def codecs(self) -> list[Codec]:
        """Every candidate's codec (to compile their kernels before a run is timed)."""
        return [Codec.from_spec(c) for c in self.options.candidates]

    def to_json(self) -> dict[str, Any]:
        return self.options.to_json()

    def check(self, *, parallel: str, **_: Any) -> None:
        if parallel not in ("ddp", "fsdp", "hsdp"):
            raise ValueError(f"--codec {self} chooses among whole codecs on a link that "
                             f"communicates: --parallel ddp, fsdp or hsdp (got {parallel})")
        if parallel != "ddp":  # FSDP hands the codecs flat shards
            refuse_flat(self.codecs, "FSDP2")

    def train_flags(self) -> list[str]:
        return ["--codec", str(self)]


@dataclass(frozen=True)
class LocalUpdateMethod:
    """Local steps on every rank, synchronized every ``sync_every`` steps: DiLoCo (an
    outer Nesterov step on the averaged pseudo-gradient) or plain averaging."""

    outer: str = "diloco"
    sync_every: int = 32
    lr: float = 0.7
    momentum: float = 0.9
    fragments: int = 1
    overlap_steps: int = 0
    #: the pseudo-gradients' codec; None: the fp32 all-reduce
    codec: CodecMethod | None = None
    #: one codec per fragment (``int8 / centroid(bits=4)``: fragment 0's, then 1's, ...);
    #: empty: ``codec`` for every fragment
    per_fragment: tuple[CodecMethod | None, ...] = ()
    #: Streaming DiLoCo's mixing after an outer step: weights <- alpha * local + (1 -
    #: alpha) * synchronized; None: the synchronized weights plus the local change since
    #: the exchange began (all of it: the same as alpha = 0 without overlap)
    alpha: float | None = None
    #: the inner optimizer (``muon``: MuLoCo); None: the trainer's --optimizer (AdamW)
    inner: str | None = None
    #: inner steps over which H ramps up from 1 to ``sync_every`` (0: no ramp)
    ramp: int = 0
    kind: ClassVar[str] = "local"

    def __post_init__(self) -> None:
        check_options(self.sync_every, self.lr, self.momentum, self.outer, self.fragments,
                      self.overlap_steps, self.alpha, self.ramp)
        if self.per_fragment and len(self.per_fragment) != self.fragments:
            raise ValueError(f"{len(self.per_fragment)} codecs separated by ' / ' for "
                             f"{self.fragments} fragment(s): give one per fragment")

    @property
    def codec_text(self) -> str:
        """The pseudo-gradients' codec as ``--outer-codec`` takes it (``none``: fp32)."""
        if self.per_fragment:
            return FRAGMENT_SEPARATOR.join(str(c) if c is not None else "none"
                                           for c in self.per_fragment)
        return str(self.codec) if self.codec is not None else "none"

    def __str__(self) -> str:
        params = [f"sync_every={self.sync_every}"]
        if self.outer != "average":
            params += [f"lr={self.lr:g}", f"momentum={self.momentum:g}"]
        if self.fragments > 1:
            params.append(f"fragments={self.fragments}")
        if self.overlap_steps:
            params.append(f"overlap={self.overlap_steps}")
        if self.alpha is not None:
            params.append(f"alpha={self.alpha:g}")
        if self.inner is not None and self.inner != "adamw":
            params.append(f"inner={self.inner}")
        if self.ramp:
            params.append(f"ramp={self.ramp}")
        name = f"{self.outer}({', '.join(params)})"
        return name if self.codec_text == "none" else f"{name} | {self.codec_text}"

    @property
    def codecs(self) -> list[Codec]:
        every = self.per_fragment or (self.codec,)
        return [c for m in every if m is not None for c in m.codecs]

    def to_json(self) -> dict[str, Any]:
        def one(c: CodecMethod | None) -> Any:
            return c.to_json() if c is not None else None

        codec = [one(c) for c in self.per_fragment] if self.per_fragment else one(self.codec)
        return {"outer": self.outer, "sync_every": self.sync_every, "lr": self.lr,
                "momentum": self.momentum, "fragments": self.fragments,
                "overlap_steps": self.overlap_steps, "alpha": self.alpha,
                "inner": self.inner, "ramp": self.ramp, "codec": codec}

    def check(self, *, parallel: str, blocks: int | None = None, **_: Any) -> None:
        if parallel != "ddp":
            raise ValueError(f"--outer {self.outer} runs data-parallel processes without "
                             "DDP: use --parallel ddp (FSDP2 is not supported with --outer)")
        if blocks is not None and blocks % self.fragments:
            raise ValueError(f"--fragments {self.fragments} does not divide the model's "
                             f"{blocks} blocks (--n-layer): choose a divisor of {blocks}")

    def options(self) -> dict[str, Any]:
        """``DiLoCo``'s keywords (``gradzip.comm.outer``)."""
        return {"sync_every": self.sync_every, "outer_lr": self.lr,
                "outer_momentum": self.momentum, "outer": self.outer,
                "codec": ([c.codecs[0] if c is not None else None for c in self.per_fragment]
                          if self.per_fragment else
                          self.codec.codecs[0] if self.codec is not None else None),
                "fragments": self.fragments, "overlap_steps": self.overlap_steps,
                "alpha": self.alpha, "sync_ramp": self.ramp}

    def train_flags(self) -> list[str]:
        flags = ["--outer", self.outer, "--outer-codec", self.codec_text]
        for attr, _, flag in LOCAL_KEYS.values():
            value = getattr(self, attr)
            if value is not None and not (attr == "ramp" and value == 0):
                flags += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        return flags


@dataclass(frozen=True)
class SnooMethod:
    """SNOO (Kallusky et al., 2025): DDP every step, plus every ``sync_every`` steps a
    Nesterov outer step on the K-step pseudo-gradient (the weights' change since the
    last outer step). All ranks hold the same weights, so the outer step communicates
    nothing: its bytes are DDP's. DiLoCo's one-worker form, the baseline a local-update
    method must beat to credit its outer optimizer rather than its rare syncs."""

    sync_every: int = 32
    lr: float = 0.7
    momentum: float = 0.9
    #: the per-step codec; None: the plain all-reduce through gradzip's hook
    codec: CodecMethod | None = None
    kind: ClassVar[str] = "snoo"

    def __post_init__(self) -> None:
        check_options(self.sync_every, self.lr, self.momentum, "diloco")

    def __str__(self) -> str:
        name = f"snoo(sync_every={self.sync_every}, lr={self.lr:g}, momentum={self.momentum:g})"
        return name if self.codec is None else f"{name} | {self.codec}"

    @property
    def codecs(self) -> list[Codec]:
        return self.codec.codecs if self.codec is not None else []

    @property
    def step_method(self) -> CodecMethod:
        """What crosses the link every step."""
        return self.codec if self.codec is not None else CodecMethod(Policy.parse("none"))

    def to_json(self) -> dict[str, Any]:
        return {"outer": "snoo", "sync_every": self.sync_every, "lr": self.lr,
                "momentum": self.momentum, "codec": self.step_method.to_json()}

    def check(self, *, parallel: str, **values: Any) -> None:
        if parallel != "ddp":
            raise ValueError(f"--outer snoo runs DDP with an outer step: use --parallel ddp "
                             f"(got {parallel})")
        self.step_method.check(parallel=parallel, **values)

    def train_flags(self) -> list[str]:
        return ["--outer", "snoo", "--sync-every", str(self.sync_every),
                "--outer-lr", f"{self.lr:g}", "--outer-momentum", f"{self.momentum:g}",
                *self.step_method.train_flags()]


Method = CodecMethod | TorchHookMethod | LocalUpdateMethod | SnooMethod | AutoMethod


def parse_method(text: str | Policy | Codec | dict[str, Any] | list[Any], *,
                 groups: dict[str, str] | None = None,
                 start_step: int | None = None) -> Method:
    """The method a text names (``SpecError``/``ValueError`` saying what is wrong).

    ``groups`` and ``start_step`` refine a codec policy (``gradzip.attach``'s keywords,
    ``--codec-groups`` and ``--codec-start-step``); other kinds refuse them.
    """
    if isinstance(text, str) and text.strip().startswith(PREFIX):
        _refuse_policy_options(text, groups, start_step)
        return TorchHookMethod.parse(text)
    if is_auto(text):
        _refuse_policy_options(str(text), groups, start_step)
        return AutoMethod(AutoOptions.parse(cast(str, text)))
    if isinstance(text, str) and (local := _local(text)) is not None:
        _refuse_policy_options(text, groups, start_step)
        return local
    plain = isinstance(text, str) and text.strip() == "none" and not groups \
        and not start_step
    return CodecMethod(Policy.parse(text).with_overrides(groups, start_step), plain)


def _refuse_policy_options(text: str, groups: dict[str, str] | None,
                           start_step: int | None) -> None:
    if groups or start_step:
        raise ValueError(f"--codec-groups and --codec-start-step are gradzip policies; "
                         f"{text.strip()} takes its own options")


def _local(text: str) -> LocalUpdateMethod | SnooMethod | None:
    """``diloco(...) | CODEC``, ``average(...)``, ``sparseloco(...)`` or ``snoo(...) |
    CODEC``; None when ``text`` names none of them."""
    m = _LOCAL.match(text)
    if not m:
        return None
    outer, params, codec = (m.group(1), m.group(2), m.group(3)) if m.group(1) \
        else (m.group(4), "", m.group(5))
    if outer not in (*OUTER_KINDS, "snoo"):
        return None
    values, sparse = _local_params(text.strip(), outer, params)
    spec = (codec or "none").strip()
    if sparse and codec:
        raise ValueError(f"method {text.strip()!r}: give sparseloco either its options "
                         f"({', '.join(sparse)}) or an explicit codec after '|', not both")
    if outer == "sparseloco" and not codec:
        spec = sparseloco_codec(**{**SPARSELOCO_CODEC, **sparse})
    if outer == "snoo":
        return SnooMethod(codec=None if spec == "none" else CodecMethod(Policy.parse(spec)),
                          **values)
    pseudo, per_fragment = pseudo_codecs(spec)
    return LocalUpdateMethod(outer=outer, codec=pseudo, per_fragment=per_fragment, **values)


def pseudo_codecs(spec: str) -> tuple[CodecMethod | None, tuple[CodecMethod | None, ...]]:
    """The pseudo-gradients' codec of ``spec`` (None: fp32), or one per fragment where
    ``spec`` lists several separated by `` / `` (then the first is also the codec)."""
    parts = [p.strip() for p in spec.split(FRAGMENT_SEPARATOR.strip())] \
        if not spec.lstrip().startswith("{") else [spec.strip()]
    codecs = tuple(None if p == "none" else CodecMethod(Policy.parse(p)) for p in parts)
    return codecs[0], codecs if len(codecs) > 1 else ()


def _local_params(text: str, outer: str, params: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The method's own options (LocalUpdateMethod fields) and SparseLoCo's codec keys."""
    allowed = [k for k in LOCAL_KEYS if outer != "snoo" or k in SNOO_KEYS]
    allowed += list(SPARSELOCO_KEYS) if outer == "sparseloco" else []
    values: dict[str, Any] = dict(DEFAULTS[outer])
    sparse: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in params.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or key not in allowed:
            raise ValueError(f"method {text!r}: {outer}(...) takes "
                             f"{', '.join(k + '=' for k in allowed)}, got {item!r}")
        kind = SPARSELOCO_KEYS[key] if key in SPARSELOCO_KEYS else LOCAL_KEYS[key][1]
        try:
            parsed = kind(value)
        except ValueError as e:
            why = f"{key} must be a number, got {value!r}" if kind in (int, float) else e
            raise ValueError(f"method {text!r}: {why}") from None
        if key in SPARSELOCO_KEYS:
            sparse[key] = parsed
        else:
            values[LOCAL_KEYS[key][0]] = parsed
    if sparse.get("aggregate") == "shared":
        _check_shared(text, sparse)
    elif "select" in sparse:
        raise ValueError(f"method {text!r}: select= picks the positions of "
                         "aggregate=shared; add aggregate=shared or leave select out")
    if "density" in sparse:
        sparse.setdefault("k", None)
        if sparse["k"] is not None:
            raise ValueError(f"method {text!r}: give k (per chunk) or density, not both")
    return values, sparse


def _check_shared(text: str, sparse: dict[str, Any]) -> None:
    """``sparseloco(aggregate=shared, ...)`` takes only the keys that mean something to
    values summed at one shared set of positions."""
    if set(GATHER_ONLY_KEYS) & set(sparse):
        given = ", ".join(k + "=" for k in GATHER_ONLY_KEYS if k in sparse)
        raise ValueError(f"method {text!r}: aggregate=shared sums the kept values at one "
                         f"shared set of positions per chunk; {given} describe a gathered "
                         "payload and do not apply")
    if sparse.get("bits", 16) not in SHARED_VALUE_BITS:
        raise ValueError(f"method {text!r}: aggregate=shared sums values in 16 bits "
                         f"(fp16) or 8 (int8 against a shared scale): bits must be one of "
                         f"{', '.join(map(str, SHARED_VALUE_BITS))}, got {sparse['bits']}")


def local_method(outer: str, *, sync_every: int, lr: float, momentum: float,
                 fragments: int, overlap_steps: int, codec: str,
                 alpha: float | None = None, inner: str | None = None,
                 ramp: int = 0) -> LocalUpdateMethod:
    """The local-update method of ``gradzip train``'s --outer flags."""
    pseudo, per_fragment = pseudo_codecs(codec)
    return LocalUpdateMethod(outer, sync_every, lr, momentum, fragments, overlap_steps,
                             pseudo, per_fragment, alpha, inner, ramp)


def every_codec(methods: Iterable[Method]) -> list[Codec]:
    """The codecs the methods use (to compile their kernels before a run is timed)."""
    return [c for m in methods if not isinstance(m, TorchHookMethod) for c in m.codecs]


__all__ = ["AutoMethod", "CodecMethod", "LocalUpdateMethod", "Method", "SnooMethod", "SpecError",
           "TorchHookMethod", "every_codec", "local_method", "parse_method", "sparseloco_codec"]
