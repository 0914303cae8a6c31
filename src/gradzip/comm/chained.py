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

import time

import torch
import torch.distributed as dist

from gradzip.codecs.chain import Codec
from gradzip.codecs.linkmodel import link_bytes
from gradzip.comm.communicator import TorchCommunicator
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
                 shapes: list[torch.Size] | None, plain: bool) -> torch.futures.Future:
    """Mean of ``buffer`` over ranks, in place, as a future (``plain``: uncompressed)."""
    codec, world = reducer.codec, comm.world_size
    start = time.perf_counter()
    # Under 'propagate' only ``none`` runs here (``chainable``), and NaN/Inf cross its
    # all-reduce whole, as with DDP's own: no check needed. Under 'error' it is one pass.
    if not plain and codec.nonfinite == "error":
        try:  # the 'error' policy raises here, before sending, through the future
            codec._check_input(buffer, key)
        except ValueError as e:
            failed: torch.futures.Future = torch.futures.Future()
            failed.set_exception(e)
            return failed
    if plain:
        leaves = [buffer.div_(world)]
        payload = None
    else:
        payload = codec._encode_stages(buffer, key, shapes)  # no observer: stats below
        leaves = [t for _, t in payload.leaves()]
        if all(t.dtype.is_floating_point for t in leaves):
            for t in leaves:  # the average, as PyTorch's fp16 hook: cast, then divide
                t.div_(world)  # (``none``'s leaf is the bucket itself)
        else:  # integer leaves do not divide: divide the input and encode again
            payload = codec._encode_stages(buffer.div_(world), key, shapes)
            leaves = [t for _, t in payload.leaves()]
    encode_s = time.perf_counter() - start
    works = [dist.all_reduce(t, group=comm.group, async_op=True) for t in leaves]
    handed = sum(t.numel() * t.element_size() for t in leaves)
    # The callback runs on gloo's thread and must not hold the process group: if it
    # dropped the last reference there, the group's destructor would join its own
    # thread ("Resource deadlock avoided"). It captures plain values only.
    backend = comm.counter.backend

    def finish(_: torch.futures.Future) -> torch.Tensor:
        decode_start = time.perf_counter()
        if payload is not None:  # casts convert straight into the bucket
            codec.compressors[0][1].decode_into(payload, buffer, None)
        done = time.perf_counter()
        reducer.stats.record(Reduction(
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
            span=(start + encode_s, decode_start),
        ))
        return buffer

    return torch.futures.collect_all([w.get_future() for w in works]).then(finish)
