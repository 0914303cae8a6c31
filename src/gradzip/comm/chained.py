"""The future-chained path: summable single-stage codecs without the communication thread.

PyTorch's ``allreduce_hook`` and ``fp16_compress_hook`` launch an asynchronous
all-reduce from the autograd thread and finish in a future callback. For a codec that
is one summable compressor (``none``, ``fp16``, ``bf16``, ``randomk``) with no error
feedback and no lossless stage, gradzip can do exactly that: encode ``x / W`` on the
autograd thread (for ``none`` the payload is the bucket itself, divided in place),
all-reduce the payload tensors asynchronously, decode in the callback. No hand-off to
the communication thread, no copy of the bucket, one collective per payload tensor,
and the same ``CommStats`` as the threaded path.

Every other codec (multi-round protocols, gathers, error feedback, several policy
groups) runs on ``CommWorker`` as sequential code; a model uses one path for all its
buckets, so collectives are issued in the same order on every rank.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from gradzip.codecs.chain import Codec
from gradzip.codecs.nonfinite import agreed_nonfinite_error, host_reads_free
from gradzip.codecs.payload import Payload
from gradzip.collectives.linkmodel import link_bytes
from gradzip.comm.communicator import TorchCommunicator
from gradzip.comm.divide import divide_checked
from gradzip.comm.eventtimes import EventTimings, event_pair
from gradzip.comm.pending import PendingChecks
from gradzip.comm.reducer import Reducer
from gradzip.comm.stats import Reduction


def chainable(codec: Codec) -> bool:
    """Whether ``codec`` runs on the future-chained path (see the module docstring)."""
    simple = (codec.wrapper is None and not codec.coders and len(codec.compressors) == 1
              and codec.summable and codec.aggregate == "auto")
    # with nonfinite='propagate', NaN/Inf must reach every rank whole: a cast may
    # saturate inf and random-k may not sample it, so only ``none`` sends them as is
    return simple and (codec.nonfinite == "error" or codec.compressors[0][1].name == "none")


def reduce_async(reducer: Reducer, comm: TorchCommunicator, buffer: torch.Tensor, key: str,
                 shapes: list[torch.Size] | None, plain: bool,
                 checks: PendingChecks, timings: EventTimings,
                 last: bool = False) -> torch.futures.Future:
    """Mean of ``buffer`` over ranks, in place, as a future (``plain``: uncompressed).

    The future is the collective's own (``work.get_future().then``), as PyTorch's
    ``default_hooks`` chain it: on CUDA its callback runs on a stream that waits for
    NCCL, so the decode never reads the sum before it is written. (A future made by
    ``collect_all`` carries no CUDA events: the decode would race the all-reduce.)
    On CUDA the encode, the all-reduce and the decode are timed by events, recorded
    when the step settles (``timings``): host clocks there would time the enqueue.
    """
    codec, world = reducer.codec, comm.world_size
    start = time.perf_counter()
    encoding = event_pair() if buffer.device.type == "cuda" else None
    payload, leaves, heads, bad = _summands(codec, buffer, key, shapes, plain, world)
    encode_s = time.perf_counter() - start
    reducing = event_pair() if encoding is not None else None  # [0]: the all-reduce starts
    works = [dist.all_reduce(t, group=comm.group, async_op=True) for t in leaves]
    handed = sum(t.numel() * t.element_size() for t in leaves)
    # The callback runs on gloo's thread and must not hold the process group: if it
    # dropped the last reference there, the group's destructor would join its own
    # thread ("Resource deadlock avoided"). It captures plain values only.
    backend = comm.counter.backend

    def finish(_: torch.futures.Future) -> torch.Tensor:
        for work in works[:-1]:  # same group, same stream: done before the last one;
            work.wait()          # on CUDA this only orders the streams
        decode_start = time.perf_counter()
        decoding = event_pair() if reducing is not None else None  # [0]: the sum landed
        if bad is not None and heads:
            if host_reads_free(heads[0]):  # one read of one value, no tensor ops
                if not math.isfinite(heads[0].item()):
                    raise agreed_nonfinite_error(key)
            else:
                checks.watch(~torch.isfinite(heads[0]).all(),
                             lambda: agreed_nonfinite_error(key))
        if last:  # the step's last bucket: read its flags before any optimizer step (on
            checks.raise_ready()  # CUDA a wait for the step's all-reduces, at backward's end)
        if payload is not None:  # casts convert straight into the bucket
            codec.compressors[0][1].decode_into(payload, buffer, None)
        done = time.perf_counter()
        reduction = Reduction(
            numel=buffer.numel(), bytes_handed=handed,
            sent_values=(buffer.numel() if payload is None
                         else reducer.sent_values(buffer.numel(), payload)),
            bytes_raw=link_bytes("all_reduce", buffer.numel() * buffer.element_size(),
                                 world, backend),
            encode_s=0.0 if plain else encode_s, decode_s=done - decode_start,
            seconds_by_op={"all_reduce": decode_start - start - encode_s},
            bytes_by_op={"all_reduce": sum(link_bytes("all_reduce", t.numel() * t.element_size(),
                                                      world, backend) for t in leaves)},
            calls_by_op={"all_reduce": len(leaves)},
            paths=["plain" if plain else "all_reduce"],
            span=(start + encode_s, decode_start), link=reducer.link,
        )
        if encoding is None or reducing is None or decoding is None:
            reducer.stats.record(reduction)
        else:
            decoding[1].record()
            summing = (reducing[0], decoding[0])
            timings.later(reduction, reducer.stats, span=summing, comm=summing,
                          encode=None if plain else (encoding[0], reducing[0]),
                          decode=decoding)
        return buffer

    return works[-1].get_future().then(finish)


def _summands(codec: Codec, buffer: torch.Tensor, key: str,
              shapes: list[torch.Size] | None, plain: bool, world: int,
              ) -> tuple[Payload | None, list[torch.Tensor], list[torch.Tensor],
                         torch.Tensor | None]:
    """What this rank all-reduces: (the payload, None if ``plain``; its tensors, each
    divided by ``world``; their first values; the non-finite flag, None unchecked).

    'error': a non-finite bucket must stop every rank, and none may skip the
    all-reduce (its peers would wait in it). The flag stays on the device: a non-finite
    rank puts NaN in the first value it sends, every rank sees it in the sum. Under
    'propagate' only ``none`` runs here (``chainable``) and NaN/Inf cross its all-reduce
    whole, as with DDP's own."""
    bad = None
    if plain:
        return None, [buffer.div_(world)], [], None
    identity = codec.compressors[0][1].name == "none"
    if identity and codec.nonfinite == "error" and buffer.numel() > 0:
        bad = divide_checked(buffer, world)  # the check inside the division's pass
        if bad is not None:  # ``none``'s payload is the bucket itself, now divided
            payload = codec.encode_stages(buffer, key, shapes)
            leaves = [t for _, t in payload.leaves()]
            heads = [t.view(-1)[:1] for t in leaves]
            _poison_head(heads[0], bad)
            return payload, leaves, heads, bad
    if codec.nonfinite == "error" and buffer.numel() > 0:
        payload, bad = codec.encode_checked(buffer, key, shapes)
    else:
        payload = codec.encode_stages(buffer, key, shapes)
    leaves = [t for _, t in payload.leaves()]
    if all(t.dtype.is_floating_point for t in leaves):
        for t in leaves:  # the average, as PyTorch's fp16 hook: cast, then divide
            t.div_(world)  # (``none``'s leaf is the bucket itself)
    else:  # integer leaves do not divide: divide the input and encode again
        payload = codec.encode_stages(buffer.div_(world), key, shapes)
        leaves = [t for _, t in payload.leaves()]
    heads = [t.view(-1)[:1] for t in leaves if t.numel() and t.dtype.is_floating_point]
    if bad is not None and heads:
        _poison_head(heads[0], bad)
    return payload, leaves, heads, bad


def _poison_head(head: torch.Tensor, bad: torch.Tensor) -> None:
    """NaN into the first value sent if this rank's bucket was non-finite: on the
    device without a read, or, where a read is free, only when it was."""
    if host_reads_free(bad):
        if bool(bad):
            head.fill_(float("nan"))
        return
    head.copy_(torch.where(bad, torch.full_like(head, float("nan")), head))
