"""The reductions a hook calls: the mean of a tensor, or FSDP's shard of the sum,
over the ranks of a ``Communicator``, through a codec.

These own what every strategy shares: input checks, the non-finite policy (a rank whose
input was NaN/Inf still takes part, on zeros, and tells its peers in a collective; see
``nonfinite.py``), error feedback around the whole reduction, the choice of path
(``choose.py``) and reporting it to the codec's observer.
"""

from __future__ import annotations

import torch

from gradzip.aggregation import fixed
from gradzip.aggregation.choose import path_for
from gradzip.aggregation.nonfinite import propagated
from gradzip.aggregation.strategies import STRATEGIES, Gather, ReduceScatter
from gradzip.codecs.base import Shapes
from gradzip.codecs.chain import Codec, Reduced, checked_shapes, saturating_cast
from gradzip.codecs.nonfinite import agreed_nonfinite_error, host_reads_free, nonfinite_flag
from gradzip.collectives.communicator import Communicator


def reduce(codec: Codec, x: torch.Tensor, key: str, comm: Communicator,
           want_local: bool = False, shapes: Shapes | None = None) -> Reduced:
    """Average ``x`` over the ranks of ``comm`` through ``codec``.

    Returns (mean, local) where ``local`` is this rank's own decoded contribution when
    ``want_local`` (error feedback needs it), else None. Summable codecs all-reduce
    their payload tensors (input pre-divided by the world size, as PyTorch's built-in
    hooks do); multi-round codecs run their own protocol; everything else is gathered
    or aggregated in two phases (the chain's ``aggregate=``; ``choose.py``).
    ``shapes``: the tensors inside a flat bucket, for ``per_tensor`` compressors.
    """
    if fixed_gather(codec, x, comm, shapes):
        return _reduce_fixed(codec, x, key, comm, want_local, shapes)
    finite = Codec.is_finite(x)
    x = x.detach()
    shapes = checked_shapes(shapes, x.numel())
    if propagated(codec, finite, key, comm, x.device):
        nan = torch.full_like(x, float("nan"))  # NaN everywhere, no state touched
        return nan, (nan if want_local else None)
    if not finite:  # 'error': this rank still takes part (its peers wait for it) and
        x = torch.zeros_like(x)  # says so in a collective; no NaN reaches its state
    carry = codec.multi_round and codec.nonfinite == "error" and comm.world_size > 1
    if carry:  # the flag rides on the protocol's first collective (carry_flag)
        comm.carry_flag(not finite, lambda: agreed_nonfinite_error(key), x.device)
        finite = True  # the protocol runs on the zeros above; the flag says the rest
    try:
        mean, local = codec.reduce_with_feedback(
            x, key, lambda t, wl: _body(codec, t, key, comm, wl, shapes, finite), want_local)
        if carry:
            comm.settle_flag()
    finally:
        comm.drop_flag()
    if local is not None:
        local = saturating_cast(local, x.dtype)
    return saturating_cast(mean, x.dtype), local


def fixed_gather(codec: Codec, x: torch.Tensor, comm: Communicator,
                 shapes: Shapes | None) -> bool:
    """Whether ``reduce`` gathers ``x``'s payloads as fixed-length buffers, with no host
    read (``fixed.py``): a fixed layout, the 'error' policy, the gather path
    (two-phase's chunks differ in size between owners: it keeps the byte path)."""
    return (codec.fixed_layout and codec.nonfinite == "error"
            and isinstance(x, torch.Tensor) and x.numel() > 0
            and path_for(codec, x, comm.world_size, checked_shapes(shapes, x.numel()),
                         comm.counter.backend, comm) == "gather")


def _zeroed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x``, or zeros where it held NaN/Inf; whether it did, a 0-d bool on its device),
    without a host read where one would stall a GPU."""
    Codec.check_input_type(x)
    x = x.detach()
    bad = nonfinite_flag(x)
    if host_reads_free(x) and not bool(bad):
        return x, bad
    return torch.where(bad, torch.zeros((), dtype=x.dtype, device=x.device), x), bad


def _reduce_fixed(codec: Codec, x: torch.Tensor, key: str, comm: Communicator,
                  want_local: bool, shapes: Shapes | None) -> Reduced:
    """``reduce`` over the fixed-layout gather: a non-finite rank sends zeros and says
    so in its buffer; every rank raises when the flags are read (``Communicator.watch``)."""
    x, bad = _zeroed(x)
    shapes = checked_shapes(shapes, x.numel())
    if codec.observer is not None:
        codec.observer.aggregated(Gather.name)
    mean, local = codec.reduce_with_feedback(
        x, key, lambda t, wl: fixed.gather_mean(codec, t, key, comm, wl, shapes, bad),
        want_local)
    if local is not None:
        local = saturating_cast(local, x.dtype)
    return saturating_cast(mean, x.dtype), local


def _body(codec: Codec, x: torch.Tensor, key: str, comm: Communicator, want_local: bool,
          shapes: Shapes | None, finite: bool) -> Reduced:
    """The chain's body (inside its error feedback) through the path chosen for ``x``."""
    if comm.world_size == 1 and not finite and codec.nonfinite == "error":
        raise agreed_nonfinite_error(key)
    path = path_for(codec, x, comm.world_size, shapes, comm.counter.backend, comm)
    if codec.observer is not None:
        codec.observer.aggregated(path)
    return STRATEGIES[path].mean(codec, x, key, comm, want_local, shapes, finite)


def reduce_scatter(codec: Codec, chunks: torch.Tensor, key: str, comm: Communicator,
                   shapes: Shapes | None = None) -> torch.Tensor:
    """This rank's chunk of the sum over ranks of ``chunks`` (``[world_size, n]``).

    FSDP's reduce-scatter: chunk j is compressed for rank j (state key ``{key}/to{j}``).
    Multi-round codecs reduce the whole flat tensor with their own protocol and keep
    this rank's chunk. ``shapes``: the tensors in a chunk.
    """
    world, n = comm.world_size, chunks.shape[1]
    if codec.multi_round:  # ``reduce`` agrees on finiteness and reports the path
        mean, _ = reduce(codec, chunks.reshape(-1), key, comm)
        return mean.reshape(world, n)[comm.rank] * world
    if codec.fixed_layout and codec.nonfinite == "error":
        # no host read: the sums or the fixed-length exchange (``fixed.py``), the flags
        # read through ``comm.watch``
        chunks, bad = _zeroed(chunks)
        if codec.observer is not None:
            codec.observer.aggregated(ReduceScatter.name)
        checked = checked_shapes(shapes, n)
        out = (ReduceScatter().shard_on_device(codec, chunks, key, comm, checked, bad)
               if codec.summable else fixed.scatter_sum(codec, chunks, key, comm, checked, bad))
        return saturating_cast(out, chunks.dtype)
    finite = Codec.is_finite(chunks)
    if propagated(codec, finite, key, comm, chunks.device):
        return torch.full((n,), float("nan"), dtype=chunks.dtype, device=chunks.device)
    if not finite:  # as in ``reduce``: zeros, and the news in a collective
        chunks = torch.zeros_like(chunks)
    if world == 1 and not finite and codec.nonfinite == "error":
        raise agreed_nonfinite_error(key)
    if codec.observer is not None:
        codec.observer.aggregated(ReduceScatter.name)
    out = ReduceScatter().shard(codec, chunks.detach(), key, comm, shapes, finite)
    return saturating_cast(out, chunks.dtype)
