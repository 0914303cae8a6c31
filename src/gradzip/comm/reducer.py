"""``Reducer``: runs one codec over a ``TorchCommunicator`` and records what it cost.

Both integrations use it: the DDP hook reduces whole buckets to their mean
(``reduce_mean``, which is ``gradzip.aggregation.reduce`` — summable payloads all-reduced,
multi-round codecs' own protocol, everything else gathered or aggregated in two
phases), and the FSDP paths reduce-scatter (``reduce_scatter``: each rank encodes
one payload per destination chunk; summable payloads are reduce-scattered leaf by
leaf, the rest are exchanged with ``all_to_all``, decoded and summed).

Encode and decode time, and the payloads ``index_bytes`` and ``density`` are read
from, reach the reducer as the codec's ``CodecObserver``. Bytes and
collective time come from the communicator's counters.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gradzip.aggregation import reduce, reduce_scatter
from gradzip.aggregation.hierarchical import hierarchical_mean
from gradzip.codecs.base import Shapes
from gradzip.codecs.chain import Codec, CodecObserver
from gradzip.codecs.payload import Payload
from gradzip.collectives.linkmodel import link_bytes
from gradzip.comm.communicator import TorchCommunicator
from gradzip.comm.eventtimes import EventTimings, event_pair
from gradzip.comm.stats import CommStats, Reduction

#: field names (or ``_``-separated parts of them) that carry positions: the sparse
#: payloads' ``deltas`` / ``bitmap`` (codecs/indices.py) and generic index names
_INDEX_NAMES = ("index", "indices", "idx", "deltas", "bitmap", "positions")


def _is_index_name(name: str) -> bool:
    return any(part in _INDEX_NAMES for part in name.lower().replace("-", "_").split("_"))


def index_bytes(p: Payload, inside: bool = False) -> int:
    """Payload bytes held in index fields (any path component naming indices)."""
    total = 0
    for name, value in p.fields.items():
        hit = inside or _is_index_name(name)
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size() if hit else 0
        elif isinstance(value, bytes | bytearray | memoryview):
            total += len(value) if hit else 0
        elif isinstance(value, Payload):
            total += index_bytes(value, hit)
    return total


class Reducer(CodecObserver):
    """One codec plus its stats; reduces tensors through a communicator."""

    def __init__(self, codec: Codec, stats: CommStats, diagnose: bool = False,
                 link: str = "") -> None:
        self.codec = codec
        self.stats = stats
        self.diagnose = diagnose
        #: the link its reductions cross, where there are several (HSDP's dimensions)
        self.link = link
        self._encode_s = 0.0
        self._decode_s = 0.0
        self._payloads: list[tuple[int, Payload]] = []
        self._paths: list[str] = []
        #: where a reduction timed by CUDA events waits for them (a hook on the
        #: autograd thread: ``TorchCommunicator.on_events``); None: host clocks
        self.timings: EventTimings | None = None
        self._span_start: Any = None
        codec.observer = self

    # ------------------------------------------------------------ observer
    def encoded(self, numel: int, payload: Payload, seconds: float) -> None:
        self._encode_s += seconds
        self._payloads.append((numel, payload))

    def decoded(self, seconds: float) -> None:
        self._decode_s += seconds

    def aggregated(self, path: str) -> None:
        self._paths.append(path)

    @property
    def device_clock(self) -> bool:
        """No event waits inside a reduction timed by events (``_begin``): its codec
        times are split from the span's events when the step settles."""
        return self._span_start is None

    def sent_values(self, numel: int, p: Payload) -> int:
        """Values this payload carries for a tensor of ``numel`` entries."""
        first = self.codec.compressors[0][1]
        name = first.values_field
        value = p.fields.get(name) if name else None
        if isinstance(value, torch.Tensor):
            return value.numel()
        if isinstance(value, Payload):
            n = value.meta.get("n")
            if isinstance(n, int):
                return n
        return numel

    def _made_bytes(self, p: Payload) -> int:
        """A payload's bytes as they travel: serialised (framing included), or for a
        multi-round stage, which sends its tensors raw through collectives, theirs."""
        if not self.codec.multi_round:
            return p.wire_bytes
        return sum(t.numel() * t.element_size() for _, t in p.leaves())

    def _begin(self, comm: TorchCommunicator, x: torch.Tensor) -> float:
        comm.counter.reset()
        comm.events.clear()
        self._encode_s = self._decode_s = 0.0
        self._payloads = []
        self._paths = []
        self._span_start = None
        if self.timings is not None and comm.on_events(x):
            self._span_start = event_pair()[0]
        return time.perf_counter()

    def _finish(self, comm: TorchCommunicator, x: torch.Tensor, start: float,
                plain: bool = False, baseline: str = "all_reduce") -> None:
        """Record one reduction of ``x``; ``baseline`` is PyTorch's collective for it."""
        numel = x.numel()
        total = time.perf_counter() - start
        c = comm.counter
        comm_s = sum(c.seconds.values())
        encode_s = self._encode_s
        if self.codec.multi_round and not plain:
            # the protocol interleaves compute with collectives: report all of it as encode
            encode_s = max(total - comm_s - self._decode_s, 0.0)
        if plain or not self._payloads:
            sent = numel
            idx = made = 0
        else:
            sent = sum(self.sent_values(n, p) for n, p in self._payloads)
            idx = sum(index_bytes(p) for _, p in self._payloads)
            made = sum(self._made_bytes(p) for _, p in self._payloads)
        reduction = Reduction(
            numel=numel, sent_values=sent, index_bytes=idx, payload_bytes=made,
            bytes_raw=link_bytes(baseline, numel * x.element_size(), comm.world_size,
                                 c.backend),
            bytes_handed=c.total_handed,
            encode_s=encode_s, decode_s=self._decode_s,
            seconds_by_op=dict(c.seconds), bytes_by_op=dict(c.wire), calls_by_op=dict(c.calls),
            paths=["plain"] if plain else list(self._paths),
            extra_collective_s=max(comm_s - c.longest, 0.0), link=self.link,
        )
        self._payloads = []
        if self._span_start is not None and self.timings is not None and comm.events:
            end = torch.cuda.Event(enable_timing=True)
            end.record()  # the host times above are the enqueue's: the events say
            self.timings.later(reduction, self.stats, span=(self._span_start, end),
                               comms=list(comm.events))
        else:
            self.stats.record(reduction)
        self._span_start = None

    def _record_residual(self, key: str) -> None:
        sq = self.codec.residual_sq(key)  # read with the step's others, as it closes
        if sq is not None:
            ready = None
            if sq.device.type == "cuda":  # made on this stream; read on another, later
                ready = torch.cuda.Event()
                ready.record()
            self.stats.record_residual_sq(key, sq, ready)

    def _exact_mean(self, x: torch.Tensor, comm: TorchCommunicator) -> torch.Tensor:
        """Diagnostic only: the uncompressed fp32 mean, outside the byte counters."""
        import torch.distributed as dist

        ref = x.detach().float().clone()
        dist.all_reduce(ref, group=comm.group)
        return ref.div_(comm.world_size)

    def _compare(self, est: torch.Tensor, ref: torch.Tensor, nbytes: int) -> None:
        est = est.detach().float().reshape(-1)
        ref = ref.reshape(-1)
        self.stats.record_diagnostic(
            err_sq=float((est - ref).pow(2).sum()), ref_sq=float(ref.pow(2).sum()),
            est_sq=float(est.pow(2).sum()), dot=float((est * ref).sum()), nbytes=nbytes,
        )

    # ------------------------------------------------------------ all-reduce
    def reduce_plain(self, x: torch.Tensor, comm: TorchCommunicator) -> torch.Tensor:
        """Uncompressed mean, in place, exactly as PyTorch's ``allreduce_hook`` does it."""
        start = self._begin(comm, x)
        x.div_(comm.world_size)
        out = comm.all_reduce([x], op="sum")[0]
        if out is not x:
            x.copy_(out)
        self._finish(comm, x, start, plain=True)
        if self.diagnose:
            self._compare(x, x.float(), 0)
        return x

    def reduce_mean(self, x: torch.Tensor, key: str, comm: TorchCommunicator,
                    shapes: Shapes | None = None) -> torch.Tensor:
        """Mean of ``x`` over ranks through the codec (``gradzip.aggregation.reduce``);
        ``shapes`` are the tensors inside a flat bucket."""
        ref = self._exact_mean(x, comm) if self.diagnose else None
        start = self._begin(comm, x)
        mean, _ = reduce(self.codec, x, key, comm, shapes=shapes)
        self._finish(comm, x, start)
        self._record_residual(key)
        if ref is not None:
            self._compare(mean, ref, link_bytes("all_reduce", 4 * x.numel(), comm.world_size,
                                                comm.counter.backend))
        return mean

    def reduce_each(self, buffer: torch.Tensor, shapes: Shapes, key: str,
                    comm: TorchCommunicator) -> torch.Tensor:
        """Each tensor of a flat bucket reduced on its own, in place (key ``{key}/p{j}``).

        Multi-round codecs need each parameter's matrix (PowerSGD), as PyTorch's
        ``powerSGD_hook`` does; the bucket is still one reduction in the stats, with
        PyTorch's one all-reduce of the bucket as its baseline.
        """
        ref = self._exact_mean(buffer, comm) if self.diagnose else None
        start = self._begin(comm, buffer)
        offset = 0
        for j, shape in enumerate(shapes):
            view = buffer[offset:offset + shape.numel()].view(shape)
            view.copy_(reduce(self.codec, view, f"{key}/p{j}", comm)[0])
            offset += shape.numel()
        self._finish(comm, buffer, start)
        self._record_residual(key)
        if ref is not None:
            self._compare(buffer, ref, link_bytes("all_reduce", 4 * buffer.numel(),
                                                  comm.world_size, comm.counter.backend))
        return buffer

    # ------------------------------------------------------------ reduce-scatter
    def reduce_scatter(
        self,
        inp: torch.Tensor,
        out: torch.Tensor,
        comm: TorchCommunicator,
        key: str,
        divisor: float = 1.0,
        factor: float = 1.0,
        plain: bool = False,
        shapes: Shapes | None = None,
    ) -> None:
        """out = this rank's chunk of sum_r(inp_r / divisor * factor), through the codec.

        ``inp`` holds ``world_size`` contiguous chunks of ``out.numel()`` entries
        (FSDP's layout); ``aggregation.reduce_scatter`` does the work, or, with ``plain``,
        PyTorch's uncompressed reduce-scatter. ``shapes``: the tensors in a chunk.
        """
        world, n = comm.world_size, out.numel()
        if inp.numel() != world * n:
            raise ValueError(
                f"reduce-scatter input has {inp.numel()} entries, expected {world} x {n}"
            )
        flat = inp.detach().reshape(world, n)
        scale = factor / divisor
        ref = None
        if self.diagnose:
            ref = self._exact_mean(flat, comm)[comm.rank] * (comm.world_size * scale)
        start = self._begin(comm, inp)
        chunks = flat * scale if scale != 1.0 else flat
        if plain:
            result = comm.reduce_scatter_sum(chunks)
        else:
            result = reduce_scatter(self.codec, chunks, key, comm, shapes=shapes)
        out.copy_(result.reshape(out.shape))
        self._finish(comm, inp, start, plain=plain, baseline="reduce_scatter")
        self._record_residual(key)
        if ref is not None:
            self._compare(out, ref, link_bytes("all_reduce", 4 * inp.numel(), comm.world_size,
                                                comm.counter.backend))


class HierarchicalReducer:
    """One codec's reductions over nodes of several ranks
    (``gradzip.aggregation.hierarchical``): the chunk's mean across nodes through the
    codec, recorded as link ``inter_node``; the uncompressed scatter and gather inside
    the node, recorded as link ``intra_node``."""

    def __init__(self, codec: Codec, stats: CommStats, node: TorchCommunicator,
                 cross: TorchCommunicator, diagnose: bool = False) -> None:
        self.inter = Reducer(codec, stats, diagnose, link="inter_node")
        self.codec = codec
        self.stats = stats
        self.node = node
        self.cross = cross

    def reduce_mean(self, x: torch.Tensor, key: str,
                    shapes: Shapes | None = None) -> torch.Tensor:
        """The mean of ``x`` over every rank, compressed between nodes only."""
        self.node.counter.reset()
        mean = hierarchical_mean(
            self.codec, x, key, self.node, self.cross, shapes,
            across=lambda piece, k, s: self.inter.reduce_mean(piece, k, self.cross, shapes=s))
        self._record_intra(x)
        return mean

    def _record_intra(self, x: torch.Tensor) -> None:
        """The node's reduce-scatter and all-gather, against themselves uncompressed."""
        c, local, size = self.node.counter, self.node.world_size, x.element_size()
        chunk = -(-x.numel() // local)
        raw = (link_bytes("reduce_scatter", chunk * local * size, local, c.backend)
               + link_bytes("all_gather", chunk * size, local, c.backend))
        self.stats.record(Reduction(
            numel=x.numel(), sent_values=x.numel(), bytes_raw=raw,
            bytes_handed=c.total_handed, seconds_by_op=dict(c.seconds),
            bytes_by_op=dict(c.wire), calls_by_op=dict(c.calls), link="intra_node"))
