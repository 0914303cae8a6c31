"""``Codec``: a validated chain of stages: encode, decode, and the body API reductions use.

Rules of a chain (checked when it is built, so a bad spec fails before training):

* a wrapper (``ef``) may only stand first;
* then one or more compressors: each after the first compresses the previous
  payload's ``values`` field (``topk | qsgd`` quantizes the kept values);
* then any lossless coders, which re-code integer fields exactly;
* a multi-round compressor (PowerSGD, ...) talks to peers itself and stands alone
  (an ``ef`` before it is allowed);
* a compressor with per-coordinate state (``positional_state``: DGC, EF-signSGD)
  stands first among the compressors, where it sees the whole tensor;
* ``ef`` never wraps a stage with its own memory (``own_feedback``) or one that
  decodes a fixed +-1 (``fixed_magnitude``: ``signsgd``'s default).

A chain that starts with a lossless coder gets an implicit ``none`` in front
(``zstd`` means "zstd on the raw bytes").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradzip.codecs.base import (
    CodecState,
    Compressor,
    LosslessCoder,
    Shapes,
    Slot,
    Stage,
    Wrapper,
)
from gradzip.codecs.clock import Clock
from gradzip.codecs.limits import DEFAULT_MAX_NUMEL, check_declared, decode_budget
from gradzip.codecs.nonfinite import NonFiniteGradientError, nonfinite_flag
from gradzip.codecs.payload import DTYPE_CODE, DTYPES, Payload, PayloadError
from gradzip.codecs.registry import SpecError, lookup
from gradzip.codecs.spec import parse_options
from gradzip.codecs.validation import own_payload
from gradzip.collectives.communicator import Communicator

NONFINITE_POLICIES = ("error", "propagate")
#: ``aggregate=`` settings of a chain; ``auto`` lets the link byte model choose per
#: tensor size and world size (the reductions themselves: ``gradzip.aggregation``)
AGGREGATIONS = ("auto", "gather", "two_phase")
#: (mean over ranks, this rank's own decoded contribution or None)
Reduced = tuple[torch.Tensor, torch.Tensor | None]
#: a reduction of the chain's body: (input, want_local) -> Reduced
ReduceBody = Callable[[torch.Tensor, bool], Reduced]
_CODED = "@"  # meta key marking a field re-coded by lossless stage N


class CodecObserver:
    """Told what a codec's encode and decode calls did (the hooks' stats use it).

    Every call through the chain's stages reports here when an observer is set:
    ``encoded`` with the input's size, the payload and the seconds spent, ``decoded``
    with the seconds. Multi-round codecs interleave compute with collectives, so
    the reducer measures those as a whole.
    """

    def encoded(self, numel: int, payload: Payload, seconds: float) -> None:
        """One encode of ``numel`` values produced ``payload`` in ``seconds``."""

    def decoded(self, seconds: float) -> None:
        """One decode took ``seconds``."""

    def aggregated(self, path: str) -> None:
        """One reduction went through aggregation ``path`` (``gradzip.aggregation``)."""

    @property
    def device_clock(self) -> bool:
        """Whether calls on a GPU are timed by events the codec waits for (``Clock``).
        False where waiting would stall the caller (a hook on the autograd thread that
        times the whole reduction by events itself): the host's time is reported."""
        return True


class Codec:
    """A gradient codec: a chain of stages plus its state.

    >>> c = Codec.from_spec("ef | topk(ratio=0.01)")
    >>> p = c.encode(torch.randn(1000), key="w")
    >>> c.decode(p).shape
    torch.Size([1000])
    """

    def __init__(
        self,
        stages: list[Stage],
        *,
        seed: int = 0,
        rank: int = 0,
        nonfinite: str = "error",
        aggregate: str = "auto",
    ) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if aggregate not in AGGREGATIONS:
            raise SpecError(f"aggregate must be one of {', '.join(AGGREGATIONS)}, "
                            f"got {aggregate!r}")
        #: how non-summable payloads are aggregated: auto (by the link byte model),
        #: gather or two_phase (``gradzip.aggregation``)
        self.aggregate = aggregate
        self.stages = self._validated(list(stages))
        self.state = CodecState(seed=seed, rank=rank)
        self.nonfinite = nonfinite
        self.wrapper: Wrapper | None = (
            self.stages[0] if isinstance(self.stages[0], Wrapper) else None
        )
        first = 1 if self.wrapper else 0
        self.compressors: list[tuple[int, Compressor]] = [
            (i, s) for i, s in enumerate(self.stages) if isinstance(s, Compressor)
        ]
        self.coders: list[tuple[int, LosslessCoder]] = [
            (i, s) for i, s in enumerate(self.stages) if isinstance(s, LosslessCoder)
        ]
        self._first = first
        #: told about every encode/decode (timings, payloads); None: nobody listens
        self.observer: CodecObserver | None = None

    # ------------------------------------------------------------ building
    @classmethod
    def from_spec(cls, spec: str | list[Any] | dict[str, Any], **kwargs: Any) -> Codec:
        """Build from a spec string or its JSON form; chain options in the spec
        (``| aggregate=two_phase``) apply unless given as keyword arguments."""
        chain, options = parse_options(spec)
        stages = [lookup(name)(**params) for name, params in chain]
        return cls(stages, **{**options, **kwargs})

    @staticmethod
    def _validated(stages: list[Stage]) -> list[Stage]:
        if not stages:
            raise SpecError("a codec needs at least one stage")
        for i, s in enumerate(stages):
            if isinstance(s, Wrapper) and i != 0:
                raise SpecError(f"'{s.name}' wraps the whole chain and must come first")
        body = stages[1:] if isinstance(stages[0], Wrapper) else stages
        if not body or isinstance(body[0], LosslessCoder):
            body.insert(0, lookup("none")())
        seen_lossless: LosslessCoder | None = None
        prev: Compressor | None = None
        for s in body:
            if isinstance(s, LosslessCoder):
                seen_lossless = s
            elif isinstance(s, Compressor):
                if seen_lossless is not None:
                    raise SpecError(
                        f"lossy stage '{s.name}' cannot follow lossless stage "
                        f"'{seen_lossless.name}'; put lossless coders last"
                    )
                if prev is not None:
                    if prev.multi_round or s.multi_round:
                        multi = prev if prev.multi_round else s
                        raise SpecError(
                            f"'{multi.name}' exchanges data with peers in several rounds "
                            "and cannot be chained with other compressors"
                        )
                    if prev.values_field is None:
                        raise SpecError(
                            f"'{s.name}' cannot follow '{prev.name}': its payload has no "
                            "float values to compress further (sparsifiers such as topk do)"
                        )
                prev = s
            else:
                raise SpecError(f"'{s.name}' cannot appear in the middle of a chain")
        if prev is not None and prev.multi_round and seen_lossless is not None:
            hint = {"terngrad": "terngrad(shared=false)", "int8": "int8 (shared=off)",
                    "signsgd": "signsgd(vote=false)"}.get(prev.name)
            raise SpecError(
                f"'{prev.name}' is multi-round and cannot be followed by lossless coders"
                + (f"; its single-round form can: {hint}" if hint else "")
            )
        if isinstance(stages[0], Wrapper):
            for s in body:
                if isinstance(s, Compressor) and s.own_feedback:
                    raise SpecError(
                        f"'{stages[0].name}' cannot wrap '{s.name}', which keeps its own "
                        f"error-feedback memory; use '{s.name}' without '{stages[0].name}'"
                    )
            _refuse_fixed_magnitude(stages[0], body)
        _refuse_positional_state_after_first(body)
        head = [stages[0]] if isinstance(stages[0], Wrapper) else []
        return head + body

    # ------------------------------------------------------------ properties
    @property
    def summable(self) -> bool:
        """Payloads from different ranks may be summed element-wise (all-reduce)."""
        return not self.coders and all(c.summable for _, c in self.compressors)

    @property
    def unbiased(self) -> bool:
        """E[decode(encode(x))] == x for every single call (error feedback is not)."""
        return self.wrapper is None and all(c.unbiased for _, c in self.compressors)

    @property
    def multi_round(self) -> bool:
        return any(c.multi_round for _, c in self.compressors)

    @property
    def fixed_layout(self) -> bool:
        """Every rank's payload for a tensor of one shape has the same layout (the
        compressors' ``fixed_layout``; a lossless coder's output length depends on the
        values, a multi-round stage talks to its peers itself)."""
        return (not self.coders and not self.multi_round
                and all(c.fixed_layout for _, c in self.compressors))

    def __str__(self) -> str:
        text = " | ".join(s.spec for s in self.stages)
        return text if self.aggregate == "auto" else f"{text} | aggregate={self.aggregate}"

    def __repr__(self) -> str:
        return f"gradzip.codec({str(self)!r})"

    def to_json(self) -> list[dict[str, Any]] | dict[str, Any]:
        """The JSON form: a list of stages, or ``{"chain": [...], "aggregate": ...}``."""
        chain = [s.to_json() for s in self.stages]
        return chain if self.aggregate == "auto" else {"chain": chain, "aggregate": self.aggregate}

    def state_dict(self) -> dict[str, Any]:
        return {"spec": str(self), "state": self.state.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("spec") != str(self):
            raise ValueError(
                f"codec state was saved for {sd.get('spec')!r}, this codec is {str(self)!r}"
            )
        self.state.load_state_dict(sd["state"])

    # ------------------------------------------------------------ encode
    def _check_input(self, x: torch.Tensor, key: str) -> bool:
        """True if ``x`` is finite; raises for bad input under the 'error' policy."""
        finite = self.is_finite(x)
        if not finite and self.nonfinite == "error":
            bad = int((~torch.isfinite(x)).sum())
            raise NonFiniteGradientError(
                f"tensor {key!r} has {bad} non-finite values (NaN/Inf) of {x.numel()}; "
                "fix the loss or pass nonfinite='propagate' to send NaN through "
                "(so a GradScaler can skip the step)"
            )
        return finite

    @staticmethod
    def is_finite(x: torch.Tensor) -> bool:
        """Validate ``x`` and say whether it is finite (one host read; none on meta)."""
        Codec.check_input_type(x)
        if x.numel() == 0 or x.device.type == "meta":  # meta: shapes only, no values
            return True
        return not bool(nonfinite_flag(x.detach()))  # one pass, one host read

    @staticmethod
    def check_input_type(x: torch.Tensor) -> None:
        """Raise a clear ``TypeError`` unless ``x`` is a tensor of a supported float dtype."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"codec input must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"codec input must be a floating-point tensor, got {x.dtype}")
        if x.dtype not in DTYPE_CODE:
            raise TypeError(f"codec input dtype {x.dtype} is not supported")

    def encode(self, x: torch.Tensor, key: str = "", shapes: Shapes | None = None) -> Payload:
        """Compress ``x``; stateful stages update their state for ``key``.

        ``shapes``: ``x`` is a flat bucket of tensors of these shapes, back to back;
        ``per_tensor`` compressors then keep per-tensor statistics (decode needs the same).
        """
        finite = self._check_input(x, key)  # first: it also rejects non-tensors clearly
        x = x.detach()
        shapes = checked_shapes(shapes, x.numel())
        if not finite:
            return Payload({}, {"shape": tuple(x.shape), "dtype": DTYPE_CODE[x.dtype], "nan": 1})
        p = self.encode_with_feedback(x, key, shapes)
        p.meta["shape"] = tuple(x.shape)
        p.meta["dtype"] = DTYPE_CODE[x.dtype]
        return p

    def encode_body(self, x: torch.Tensor, key: str, shapes: Shapes | None = None) -> Payload:
        if self.observer is None:
            return self.encode_stages(x, key, shapes)
        clock = Clock(x.device if self.observer.device_clock else None)
        p = self.encode_stages(x, key, shapes)
        self.observer.encoded(x.numel(), p, clock.seconds())
        return p

    def encode_stages(self, x: torch.Tensor, key: str, shapes: Shapes | None) -> Payload:
        index, first = self.compressors[0]
        slot = self.state.slot(index, key, x.device)
        x = x if first.keeps_dtype else x.float()
        if shapes is not None and first.per_tensor:
            payload = first.encode_tensors(x, slot, shapes)
        else:
            payload = first.encode(x, slot)
        slot.advance()
        # later compressors work on the previous stage's values field, nested
        parent, prev = payload, first
        for index, comp in self.compressors[1:]:
            name = prev.values_field
            assert name is not None
            values = parent.tensor(name)
            slot = self.state.slot(index, key, values.device)
            child = comp.encode(values.float(), slot)
            slot.advance()
            child.meta["n"] = values.numel()
            child.meta["vdtype"] = DTYPE_CODE[values.dtype]
            parent.fields[name] = child
            parent, prev = child, comp
        for index, coder in self.coders:
            slot = self.state.slot(index, key)
            payload = self._recode(payload, index, coder, slot)
            slot.advance()
        return payload

    def encode_checked(self, x: torch.Tensor, key: str,
                       shapes: Shapes | None) -> tuple[Payload, torch.Tensor]:
        """``encode_stages`` and whether ``x`` held NaN/Inf (a 0-d bool on its device).

        A codec of one stage lets the stage tell from a pass it makes anyway
        (``Compressor.encode_flagged``: a cast on the CPU reads its half-size output);
        otherwise one ``aminmax`` pass over ``x`` comes first."""
        index, first = self.compressors[0]
        if len(self.stages) > 1 or x.numel() == 0 or (shapes is not None and first.per_tensor):
            flag = nonfinite_flag(x) if x.numel() else torch.zeros((), dtype=torch.bool)
            return self.encode_stages(x, key, shapes), flag
        slot = self.state.slot(index, key, x.device)
        payload, flag = first.encode_flagged(x if first.keeps_dtype else x.float(), slot)
        slot.advance()
        return payload, flag

    def _recode(self, p: Payload, index: int, coder: LosslessCoder, slot: Slot) -> Payload:
        fields: dict[str, Any] = {}
        for name, value in p.fields.items():
            if isinstance(value, Payload):
                fields[name] = self._recode(value, index, coder, slot)
            elif isinstance(value, torch.Tensor) and value.numel() and coder.accepts(value):
                coded = coder.encode_field(value, slot)
                coded.meta[_CODED] = index
                fields[name] = coded
            else:
                fields[name] = value
        return Payload(fields, dict(p.meta))

    # ------------------------------------------------------------ decode
    def decode(self, p: Payload, key: str | None = None,
               shapes: Shapes | None = None, device: torch.device | str | None = None, *,
               expected: Sequence[int] | None = None,
               max_numel: int = DEFAULT_MAX_NUMEL) -> torch.Tensor:
        """Rebuild the tensor (its shape and dtype) from any rank's payload.

        ``shapes`` must be what ``encode`` was given (the bucket layout is the same on
        every rank, so it never travels). ``device``: where the result goes (default:
        where the payload's tensors are; a payload coded to bytes throughout has none,
        and decodes on the CPU).

        The payload is untrusted: ``expected`` is the shape the caller expects (a
        payload declaring another raises); without it the declared shape may hold at
        most ``max_numel`` values (``limits.DEFAULT_MAX_NUMEL``, 2^27). Decoding then
        allocates O(n + payload bytes) for n values, and any malformed payload raises
        ``PayloadError``.
        """
        shape = p.shape("shape")
        dtype = _dtype(p.int("dtype"))
        if not dtype.is_floating_point:  # encode takes floating tensors only
            raise PayloadError(f"payload names a {dtype} tensor; codecs carry float tensors")
        if expected is not None and tuple(shape) != tuple(expected):
            raise PayloadError(f"payload declares shape {tuple(shape)}, the receiver "
                               f"expects {tuple(expected)}")
        if math.prod(shape) > max_numel:  # Python ints: Size.numel() wraps on overflow
            raise PayloadError(f"payload declares {math.prod(shape)} values, more than "
                               f"max_numel={max_numel}; pass expected= or a larger max_numel "
                               "to decode it")
        if device is not None:
            p = p.to(device)
        if p.meta.get("nan"):
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        shapes = checked_shapes(shapes, shape.numel())
        try:
            body = self.decode_body(p, key, shape, shapes)
        except PayloadError as e:
            if shapes is None and self.compressors and self.compressors[0][1].per_tensor:
                raise PayloadError(
                    f"{e}. {self.compressors[0][1].name} scales per tensor: if encode was "
                    "given shapes=, decode needs the same ones (codec.decode(payload, "
                    "shapes=shapes))") from e
            raise
        out = saturating_cast(body, dtype)
        return out if device is None else out.to(device)

    def decode_body(self, p: Payload, key: str | None, shape: torch.Size,
                     shapes: Shapes | None = None) -> torch.Tensor:
        """Decode a payload for a tensor of ``shape`` (the receiver's, not the wire's):
        every size the payload declares inside is bounded by it (``limits.py``), and
        whatever goes wrong on malformed bytes surfaces as ``PayloadError``."""
        clock = Clock(_device_of(p) if self.observer is not None
                      and self.observer.device_clock else None)
        try:
            with decode_budget(shape.numel()):
                out = self._decode_stages(p, key, shape, shapes)
        except PayloadError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError, OverflowError,
                AssertionError) as e:  # not MemoryError: the bounds must prevent that
            if _out_of_memory(e):  # nor an allocator's failure: it is not the payload's
                raise
            raise PayloadError(f"the payload for {key or 'a tensor'!r} could not be decoded "
                               f"({type(e).__name__}: {e})") from e
        if self.observer is not None:
            self.observer.decoded(clock.seconds())
        return out

    def _decode_stages(self, p: Payload, key: str | None, shape: torch.Size,
                       shapes: Shapes | None) -> torch.Tensor:
        if self.coders:  # lossless coders decode on the host: back to the payload's device
            device = next((t.device for _, t in p.leaves()), torch.device("cpu"))
            for index, coder in reversed(self.coders):
                p = self._undo_recode(p, index, coder, device)
        # walk down the nested values fields, then decode from the innermost out
        chain: list[tuple[Payload, Compressor, int]] = []
        node = p
        for n, (index, comp) in enumerate(self.compressors):
            chain.append((node, comp, index))
            if n + 1 < len(self.compressors):
                assert comp.values_field is not None
                node = node.child(comp.values_field)
        decoded: torch.Tensor | None = None
        for n in range(len(chain) - 1, -1, -1):
            node, comp, index = chain[n]
            if decoded is not None:
                prev_field = comp.values_field
                assert prev_field is not None
                node = Payload({**node.fields, prev_field: decoded}, node.meta)
            slot = (self.state.slot(index, key, _device_of(node)) if key is not None
                    else None)
            if n == 0 and shapes is not None and comp.per_tensor:
                out = comp.decode_tensors(node, shape, slot, shapes)
            else:
                node_shape = shape if n == 0 else torch.Size(
                    (check_declared(node.int("n"), "a nested stage"),))
                out = comp.decode(node, node_shape, slot)
            if n > 0:
                out = out.to(_dtype(node.int("vdtype")))
            decoded = out
        assert decoded is not None
        return decoded

    def _undo_recode(self, p: Payload, index: int, coder: LosslessCoder,
                     device: torch.device) -> Payload:
        fields: dict[str, Any] = {}
        for name, value in p.fields.items():
            if isinstance(value, Payload):
                if value.meta.get(_CODED) == index:
                    fields[name] = coder.decode_field(value, device).to(device)
                else:
                    fields[name] = self._undo_recode(value, index, coder, device)
            else:
                fields[name] = value
        return Payload(fields, dict(p.meta))

    # ------------------------------------------------------------ the body API
    # What a reduction (``gradzip.aggregation``) needs from a chain, besides
    # ``encode_body``/``decode_body``: its wrapper, its multi-round protocol, and the
    # whole chain with error feedback for a payload that is sent on (two-phase's owner).
    def reduce_with_feedback(self, x: torch.Tensor, key: str, body: ReduceBody,
                             want_local: bool) -> Reduced:
        """``body(x, want_local) -> (mean, local)`` inside the chain's wrapper.

        Error feedback adds its residual for ``key`` to ``x`` first and keeps what
        ``local`` says was lost; without a wrapper this is ``body`` on ``x`` as given.
        """
        if self.wrapper is None:
            return body(x, want_local)
        slot = self.state.slot(0, key, x.device)
        out = self.wrapper.reduce(x.float(), slot, body, want_local)
        slot.advance()
        return out

    def reduce_rounds(self, x: torch.Tensor, key: str, comm: Communicator,
                      want_local: bool, shapes: Shapes | None) -> Reduced:
        """The multi-round stage's own protocol over ``comm`` (PowerSGD's P and Q, ...):
        (mean over ranks, this rank's own estimate when ``want_local``)."""
        if not self.multi_round:
            raise TypeError(f"{self} has no multi-round stage")
        index, comp = self.compressors[0]
        slot = self.state.slot(index, key, x.device)
        if shapes is not None:
            out = comp.reduce_tensors(x.float(), slot, comm, want_local, shapes)
        else:
            out = comp.reduce(x.float(), slot, comm, want_local)
        if self.observer is not None and slot.sent is not None:
            # its time is measured with the rounds' (the reducer's multi-round split)
            self.observer.encoded(x.numel(), slot.sent, 0.0)
        slot.advance()
        return out

    def encode_with_feedback(self, x: torch.Tensor, key: str,
                             shapes: Shapes | None) -> Payload:
        """Encode through the whole chain, error feedback included (no input checks)."""
        if self.wrapper is None:
            return self.encode_body(x, key, shapes)
        slot = self.state.slot(0, key, x.device)
        p = self.wrapper.encode(
            x.float(), slot,
            lambda t: self.encode_body(t, key, shapes),
            lambda q: self.decode_own(q, key, x.shape, shapes),
        )
        slot.advance()
        return p

    def decode_own(self, p: Payload, key: str | None, shape: torch.Size,
                   shapes: Shapes | None) -> torch.Tensor:
        """``decode_body`` of a payload this rank just encoded: the checks for bytes
        from the network are skipped (each is a host read on a GPU)."""
        with own_payload():
            return self.decode_body(p, key, shape, shapes)

    # ------------------------------------------------------------ state
    def fresh(self, **kwargs: Any) -> Codec:
        """A new codec of the same chain with empty state, built from the stages'
        parameters (no spec is parsed again). ``seed``, ``rank``, ``nonfinite`` and
        ``aggregate`` are this codec's unless given: one parsed codec serves as the
        prototype of every rank's and every group's."""
        options = {"seed": self.state.seed, "rank": self.state.rank,
                   "nonfinite": self.nonfinite, "aggregate": self.aggregate, **kwargs}
        return Codec([type(s)(**s.params) for s in self.stages], **options)

    def probe(self) -> Codec:
        """A fresh copy of this codec with empty state (for measuring payload sizes)."""
        return self.fresh()

    def _records(self, prefix: str) -> list[tuple[int, str]]:
        return [k for k in self.state.records
                if k[1] == prefix or k[1].startswith(prefix + "/")]

    def residual_norm(self, prefix: str) -> float | None:
        """L2 norm over the error-feedback memories of ``prefix`` and its sub-keys
        (``ef``'s residual, or a stage's own: DGC, EF-signSGD); None if there is none."""
        sq = self.residual_sq(prefix)
        return float(sq) ** 0.5 if sq is not None else None

    def residual_sq(self, prefix: str) -> torch.Tensor | None:
        """``residual_norm`` squared, as a 0-d fp32 tensor on the residuals' device (no
        host read: a caller on a GPU reads many at once, later); None if there is none."""
        squares = [residual.float().pow(2).sum() for k in self._records(prefix)
                   if isinstance(residual := self.state.records[k]["data"].get("residual"),
                                 torch.Tensor)]
        if not squares:
            return None
        device = squares[0].device
        return torch.stack([t.to(device) for t in squares]).sum()

    def take_residual(self, key: str, numel: int) -> torch.Tensor | None:
        """Remove and return the error-feedback memory of ``key`` (``ef``'s residual or a
        stage's own) when it holds ``numel`` values, summed over the stages that keep
        one; None when there is none. What a caller that stops using this codec adds to
        its next gradient, so that no dropped mass is lost."""
        total: torch.Tensor | None = None
        for k in self._records(key):
            data = self.state.records[k]["data"]
            residual = data.get("residual")
            if k[1] == key and isinstance(residual, torch.Tensor) \
                    and residual.numel() == numel:
                del data["residual"]
                flat = residual.reshape(-1)
                total = flat.clone() if total is None else total.add_(flat)
        return total

    def drop(self, prefix: str) -> int:
        """Forget all state of ``prefix`` and its sub-keys; returns how many records."""
        keys = self._records(prefix)
        for k in keys:
            del self.state.records[k]
        return len(keys)


def _refuse_fixed_magnitude(wrapper: Wrapper, body: list[Stage]) -> None:
    """Error feedback around a stage that decodes +-1 whatever the gradient's size.

    ``ef`` keeps ``x - decode(encode(x))``; when decode is +-1 in the optimizer's units
    that residual is of the order of 1 however small the gradient, it swamps the next
    gradient and the sign sent flips from step to step: training stalls where the same
    stage without ``ef`` makes progress.
    """
    for s in body:
        if isinstance(s, Compressor) and s.fixed_magnitude:
            scaled = type(s)(**{**s.params, "scale": "l1"}).spec
            raise SpecError(
                f"'{wrapper.name}' cannot wrap '{s.spec}': it decodes to +-1 whatever the "
                "gradient's size, so the residual error feedback keeps dwarfs the gradient "
                "and the sign sent flips every step; use 'efsignsgd' (error feedback with "
                f"the ||x||_1/d scale built in), '{wrapper.name} | {scaled}', "
                f"or '{s.spec}' without '{wrapper.name}'"
            )


def _refuse_positional_state_after_first(body: list[Stage]) -> None:
    """A stage with per-coordinate state (``positional_state``) must see the whole tensor.

    A later compressor gets only the values the one before it kept (``topk``'s k
    values, ``threshold``'s varying count), a different set of coordinates each step:
    memory at position i would be added to another coordinate's value, or the stage
    would fail when the count changes.
    """
    compressors = [s for s in body if isinstance(s, Compressor)]
    for prev, s in zip(compressors, compressors[1:], strict=False):
        if s.positional_state:
            raise SpecError(
                f"'{s.name}' cannot follow '{prev.name}': it keeps state per coordinate "
                f"(residuals, momentum, a basis), but after '{prev.name}' it sees only the "
                "values kept, a different set of coordinates each step, so one coordinate's "
                f"memory would be added to another's; put '{s.name}' first in the chain "
                f"(e.g. '{s.name}' alone), or, for error feedback after a sparsifier, wrap "
                f"a stateless compressor: 'ef | {prev.spec} | qsgd'"
            )


def checked_shapes(shapes: Shapes | None, numel: int) -> tuple[torch.Size, ...] | None:
    """``shapes`` as a tuple of ``torch.Size``, checked to tile ``numel`` values exactly."""
    if shapes is None:
        return None
    sizes = tuple(torch.Size(s) for s in shapes)
    total = sum(s.numel() for s in sizes)
    if total != numel:
        raise ValueError(
            f"tensor shapes {[tuple(s) for s in sizes]} hold {total} values, the flat "
            f"bucket has {numel}; pass the shapes of the tensors inside it, in order"
        )
    return sizes


def saturating_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A decoded tensor in the caller's ``dtype``, saturating instead of overflowing.

    A codec may decode a finite fp16 input to a little more than fp16 can hold
    (``natural`` rounds 40000 up to 65536; a QSGD level is a bucket norm), and the cast
    would turn that into inf. As the ``fp16`` cast does, such values saturate at the
    dtype's largest finite value (NaN stays NaN). Empty results get ordinary strides
    (some decoders build them from NumPy with stride 0, which cannot be serialized).
    """
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=dtype, device=t.device)
    if t.dtype == dtype:
        return t
    if t.dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(t.dtype).max:
        limit = torch.finfo(dtype).max
        t = t.clamp(-limit, limit)
    return t.to(dtype)


def _out_of_memory(e: BaseException) -> bool:
    """An allocation failure (torch raises RuntimeError, or OutOfMemoryError on CUDA)."""
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate" in text \
        or "out of memory" in text


def _dtype(code: int) -> torch.dtype:
    if not 0 <= code < len(DTYPES):
        raise PayloadError(f"payload names unknown dtype code {code}")
    return DTYPES[code]


def _device_of(p: Payload) -> torch.device | None:
    """The device of a payload's tensors (None: it has none)."""
    return next((t.device for _, t in p.leaves()), None)
