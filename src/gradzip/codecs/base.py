"""Stage kinds and the explicit codec state.

A codec is a chain of stages (see ``chain.py``). There are three kinds:

* ``Compressor`` — lossy (or identity): tensor -> Payload -> tensor. The first
  compressor sees the gradient; a later one compresses the previous payload's
  ``values`` field (``topk | qsgd`` quantizes the kept values).
* ``LosslessCoder`` — exact: re-codes integer fields of the payload (Exp-Golomb,
  ANS, zstd). Never changes what decodes.
* ``Wrapper`` — wraps everything after it (error feedback).

State lives in a ``CodecState`` — plain dicts of ints and tensors keyed by
(stage index, caller key) — so it pickles, checkpoints and restores exactly.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from gradzip.codecs.nonfinite import nonfinite_flag
from gradzip.codecs.payload import Payload
from gradzip.codecs.registry import Param, SpecError

if TYPE_CHECKING:
    from gradzip.collectives.communicator import Communicator


#: shapes of the tensors inside a flat bucket, back to back (numels sum to the bucket's)
Shapes = Sequence[torch.Size]


def _format_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    return str(v)


class Stage(ABC):  # noqa: B024 - abstract through its kinds
    """One named step of a codec chain, built from validated parameters."""

    name: ClassVar[str] = "?"
    PARAMS: ClassVar[tuple[Param, ...]] = ()
    #: one-line description for ``gradzip codecs list``
    summary: ClassVar[str] = ""

    def __init__(self, **params: Any) -> None:
        known = {p.name: p for p in self.PARAMS}
        for k in params:
            if k not in known:
                allowed = ", ".join(known) or "none"
                raise SpecError(f"{self.name}: unknown parameter {k!r}; allowed: {allowed}")
        self.params: dict[str, Any] = {}
        for p in self.PARAMS:
            value = params.get(p.name, p.default)
            self.params[p.name] = p.coerce(self.name, value) if p.name in params else value
        self.validate()

    def validate(self) -> None:
        """Cross-parameter checks; raise SpecError with a clear message."""

    @property
    def spec(self) -> str:
        changed = [
            f"{p.name}={_format_value(self.params[p.name])}"
            for p in self.PARAMS
            if self.params[p.name] != p.default
        ]
        return f"{self.name}({', '.join(changed)})" if changed else self.name

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **self.params}

    def __repr__(self) -> str:
        return self.spec


class Slot:
    """The state of one stage for one key: a dict that persists, a step count, RNG."""

    def __init__(self, state: CodecState, stage: int, key: str, record: dict[str, Any]):
        self._state, self._stage, self.key = state, stage, key
        self._record = record
        #: what a multi-round stage's ``reduce`` put on the wire from this rank, as a
        #: payload (for the statistics: its index and value bytes and kept values);
        #: None where it does not say. This call's only: never saved.
        self.sent: Payload | None = None

    @property
    def data(self) -> dict[str, Any]:
        """Persistent per-key storage (residuals, momentum, warm-start matrices)."""
        return self._record["data"]

    @property
    def step(self) -> int:
        """How many times this stage has encoded this key."""
        return self._record["step"]

    def advance(self) -> None:
        self._record["step"] += 1

    def seed(self, shared: bool) -> int:
        """A deterministic 63-bit seed for this (stage, key, step).

        ``shared`` seeds are the same on every rank (random-k's indices);
        private ones also mix in the rank (independent stochastic rounding).
        """
        rank = -1 if shared else self._state.rank
        text = f"{self._state.seed}/{self._stage}/{self.key}/{self.step}/{rank}"
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def generator(self, device: torch.device | str, shared: bool = False) -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(self.seed(shared))
        return g


class CodecState:
    """All mutable state of one codec instance, keyed by (stage, key)."""

    def __init__(self, seed: int = 0, rank: int = 0) -> None:
        self.seed = seed
        self.rank = rank
        self.records: dict[tuple[int, str], dict[str, Any]] = {}
        #: records loaded from a checkpoint and not yet placed on their data's device
        #: (checkpoints load on the CPU; a GPU run's residuals belong beside its
        #: gradients, and a stage that mixed the two would fail or sync)
        self.unplaced: set[tuple[int, str]] = set()

    def slot(self, stage: int, key: str, device: torch.device | None = None) -> Slot:
        """The state of ``stage`` for ``key``; on its first use after a load, its
        tensors move to ``device`` (the data's)."""
        record = self.records.setdefault((stage, key), {"step": 0, "data": {}})
        if device is not None and (stage, key) in self.unplaced:
            self.unplaced.discard((stage, key))
            record["data"] = _placed(record["data"], device)
        return Slot(self, stage, key, record)

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "rank": self.rank,
            # copies: stages update their state in place (the ef residual), and a
            # snapshot must not change after it is taken
            "records": {f"{s}:{k}": _snapshot(r) for (s, k), r in self.records.items()},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seed = int(sd["seed"])
        self.rank = int(sd["rank"])
        records = {}
        for name, rec in sd["records"].items():
            stage, key = name.split(":", 1)
            records[(int(stage), key)] = rec
        self.records = records
        self.unplaced = set(records)

    def keys(self) -> list[str]:
        return sorted({k for _, k in self.records})


def _placed(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it on ``device`` (dicts and lists walked)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _placed(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_placed(v, device) for v in value]
    return value


def _snapshot(value: Any) -> Any:
    """A copy of ``value`` whose tensors do not share storage with it."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    return value


class Compressor(Stage):
    """A lossy (or identity) stage: tensor -> Payload -> tensor.

    The class flags below describe the stage with its default parameters (what
    ``gradzip codecs list`` shows); a stage whose flags depend on its parameters
    (``int8(stochastic=true)``, ``signsgd(vote=false)``) sets them per instance.
    """

    #: decode(sum of payloads) == sum of decodes, so payloads may be all-reduced
    summable: ClassVar[bool] = False
    #: E[decode(encode(x))] == x
    unbiased: ClassVar[bool] = False
    #: receives the input in its own dtype instead of float32 (``none``)
    keeps_dtype: ClassVar[bool] = False
    #: name of a float field a following compressor may compress further
    values_field: ClassVar[str | None] = None
    #: overrides ``reduce`` to talk to peers in several rounds
    multi_round: ClassVar[bool] = False
    #: keeps its own error-feedback memory (DGC, EF-signSGD): ``ef`` must not wrap it
    own_feedback: ClassVar[bool] = False

    #: keeps state indexed by coordinate (error-feedback residuals, DGC's momentum, a
    #: PowerSGD Q or GradiVeQ basis tied to the tensor's layout): it must see the whole
    #: tensor, so it may only be the first compressor of a chain. After a sparsifier
    #: it would get a different set of kept values every step, and position i of its
    #: memory would belong to a different coordinate each time (or its size would
    #: change and it would fail).
    positional_state: ClassVar[bool] = False
    #: decodes to a fixed magnitude whatever the input's size (``signsgd``'s +-1): the
    #: residual ``ef`` keeps would be in different units from the gradient, so ``ef``
    #: must not wrap it (a stage that sets this offers ``scale=l1`` instead)
    fixed_magnitude: ClassVar[bool] = False

    #: computes its statistics (scales, norms, column means) per tensor when told the
    #: shapes of the tensors inside a flat bucket (``encode_tensors``)
    per_tensor: ClassVar[bool] = False
    #: compresses only matrices: on a flat tensor (an FSDP shard) it would send the
    #: gradient uncompressed, so the sharded paths refuse it when attached
    needs_matrices: ClassVar[bool] = False
    #: its payload's tensors (names, dtypes, shapes) and metadata depend on the input's
    #: shape and the stage's parameters only, never on the values: every rank's payload
    #: for the same tensor has one layout, so it can cross as a fixed-length buffer (no
    #: size exchange, no framing; ``aggregation.fixed``); the contract tests check it
    fixed_layout: ClassVar[bool] = False

    @abstractmethod
    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        """Compress ``x`` (float32 unless ``keeps_dtype``) into a payload."""

    def encode_flagged(self, x: torch.Tensor, slot: Slot) -> tuple[Payload, torch.Tensor]:
        """``encode`` and whether ``x`` held NaN/Inf (a 0-d bool tensor on its device,
        no host read): one ``aminmax`` pass first. A stage that can tell from a pass
        it makes anyway overrides it (the casts)."""
        flag = nonfinite_flag(x)
        return self.encode(x, slot), flag

    @abstractmethod
    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        """Rebuild a float32 tensor of ``shape`` from a payload (any rank's)."""

    def decode_into(self, p: Payload, out: torch.Tensor, slot: Slot | None) -> None:
        """Decode into ``out`` (its shape and dtype); casts override it to convert in
        one pass instead of decoding to fp32 and copying (the hooks' fast path)."""
        decoded = self.decode(p, out.shape, slot)
        if decoded.data_ptr() != out.data_ptr():
            out.copy_(decoded)

    def encode_tensors(self, x: torch.Tensor, slot: Slot, shapes: Shapes) -> Payload:
        """Compress a flat bucket ``x`` that holds tensors of ``shapes`` back to back.

        A DDP bucket or an FSDP shard is one flat tensor, but a paper's statistics are
        per tensor (TernGrad's scale, 1-bit SGD's column means): ``per_tensor`` codecs
        override this to keep that granularity in one vectorized pass. The default
        compresses the bucket as a whole.
        """
        return self.encode(x, slot)

    def decode_tensors(self, p: Payload, shape: torch.Size, slot: Slot | None,
                       shapes: Shapes) -> torch.Tensor:
        """The inverse of ``encode_tensors`` (the same ``shapes`` on every rank)."""
        return self.decode(p, shape, slot)

    def reduce(
        self, x: torch.Tensor, slot: Slot, comm: Communicator, want_local: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Multi-round aggregation: (mean over ranks, this rank's own estimate)."""
        raise TypeError(f"{self.name} has no multi-round reduce")

    def reduce_tensors(
        self, x: torch.Tensor, slot: Slot, comm: Communicator, want_local: bool,
        shapes: Shapes,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``reduce`` of a flat bucket holding tensors of ``shapes`` (default: as a whole)."""
        return self.reduce(x, slot, comm, want_local)


class LosslessCoder(Stage):
    """An exact stage that re-codes payload tensors (integers unless it accepts more)."""

    def accepts(self, t: torch.Tensor) -> bool:
        return not t.dtype.is_floating_point and t.dtype != torch.bool

    @abstractmethod
    def encode_field(self, t: torch.Tensor, slot: Slot | None = None) -> Payload:
        """Code one tensor exactly into a payload.

        ``slot`` is the chain's state for this stage and key; ``None`` when the coder is
        used on its own (benchmarks, the ``lossless`` float codec's planes).
        """

    @abstractmethod
    def decode_field(self, p: Payload, device: torch.device | None = None) -> torch.Tensor:
        """Rebuild the exact tensor ``encode_field`` was given.

        ``device``: where the caller wants it; a coder that decodes on a device may
        decode there (``ans``'s lanes format), the others decode on the host."""


Encode = Callable[[torch.Tensor], Payload]
Decode = Callable[[Payload], torch.Tensor]
Reduce = Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]]


class Wrapper(Stage):
    """A stage around the rest of the chain (error feedback)."""

    @abstractmethod
    def encode(self, x: torch.Tensor, slot: Slot, inner: Encode, inner_decode: Decode) -> Payload:
        """Encode ``x`` through ``inner`` (the rest of the chain)."""

    def reduce(
        self, x: torch.Tensor, slot: Slot, inner: Reduce, want_local: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Aggregate through ``inner`` (the rest of the chain's reduce)."""
        raise TypeError(f"{self.name} cannot wrap a reduce")
