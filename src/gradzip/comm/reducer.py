"""``Reducer``: runs one codec over a ``TorchCommunicator`` and records what it cost.

Both integrations use it: the DDP hook reduces whole buckets to their mean
(``reduce_mean``, which is ``Codec.reduce`` — summable payloads all-reduced,
multi-round codecs' own protocol, everything else all-gathered), and the FSDP
paths reduce-scatter (``reduce_scatter``: each rank encodes one payload per
destination chunk; summable payloads are reduce-scattered leaf by leaf, the rest
are exchanged with ``all_to_all``, decoded and summed).

Encode and decode time, and the payloads ``index_bytes`` and ``density`` are read
from, reach the reducer as the codec's ``CodecObserver``. Bytes and
collective time come from the communicator's counters.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gradzip.codecs.chain import Codec, CodecObserver
from gradzip.codecs.linkmodel import link_bytes
from gradzip.codecs.payload import Payload
from gradzip.comm.communicator import TorchCommunicator
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
        elif isinstance(value, bytes | bytearray):
            total += len(value) if hit else 0
        elif isinstance(value, Payload):
            total += index_bytes(value, hit)
    return total


class Reducer(CodecObserver):
    """One codec plus its stats; reduces tensors through a communicator."""

    def __init__(self, codec: Codec, stats: CommStats, diagnose: bool = False) -> None:
        self.codec = codec
        self.stats = stats
        self.diagnose = diagnose
        self._encode_s = 0.0
        self._decode_s = 0.0
        self._payloads: list[tuple[int, Payload]] = []
        self._paths: list[str] = []
        codec.observer = self

    # ------------------------------------------------------------ observer
    def encoded(self, numel: int, payload: Payload, seconds: float) -> None:
        self._encode_s += seconds
        self._payloads.append((numel, payload))

    def decoded(self, seconds: float) -> None:
        self._decode_s += seconds

    def aggregated(self, path: str) -> None:
        self._paths.append(path)

    def _sent_values(self, numel: int, p: Payload) -> int:
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

    def _begin(self, comm: TorchCommunicator) -> float:
        comm.counter.reset()
        self._encode_s = self._decode_s = 0.0
        self._payloads = []
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
            idx = 0
        else:
            sent = sum(self._sent_values(n, p) for n, p in self._payloads)
            idx = sum(index_bytes(p) for _, p in self._payloads)
        self.stats.record(Reduction(
            numel=numel, sent_values=sent, index_bytes=idx,
            bytes_raw=link_bytes(baseline, numel * x.element_size(), comm.world_size),
            bytes_handed=c.total_handed,
            encode_s=encode_s, decode_s=self._decode_s,
            seconds_by_op=dict(c.seconds), bytes_by_op=dict(c.wire), calls_by_op=dict(c.calls),
        ))
        self._payloads = []

    def _record_residual(self, key: str) -> None:
        if self.codec.wrapper is None:
            return
        record = self.codec.state.records.get((0, key))
        residual = record["data"].get("residual") if record else None
        if isinstance(residual, torch.Tensor):
            self.stats.record_residual(key, float(residual.float().norm()))

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
        start = self._begin(comm)
        x.div_(comm.world_size)
        out = comm.all_reduce([x], op="sum")[0]
        if out is not x:
            x.copy_(out)
        self._finish(comm, x, start, plain=True)
        if self.diagnose:
            self._compare(x, x.float(), 0)
        return x

    def reduce_mean(self, x: torch.Tensor, key: str, comm: TorchCommunicator) -> torch.Tensor:
        """Mean of ``x`` over ranks through the codec (``Codec.reduce``)."""
        ref = self._exact_mean(x, comm) if self.diagnose else None
        start = self._begin(comm)
        mean, _ = self.codec.reduce(x, key, comm)
        self._finish(comm, x, start)
        self._record_residual(key)
        if ref is not None:
            self._compare(mean, ref, link_bytes("all_reduce", 4 * x.numel(), comm.world_size))
        return mean

    # ------------------------------------------------------------ reduce-scatter
    def reduce_scatter(
        self,
        inp: torch.Tensor,
        out: torch.Tensor,
        comm: TorchCommunicator,
        key: str,
        divisor: float = 1.0,
        factor: float = 1.0,
    ) -> None:
        """out = this rank's chunk of sum_r(inp_r / divisor * factor), through the codec.

        ``inp`` holds ``world_size`` contiguous chunks of ``out.numel()`` entries
        (FSDP's layout); chunk j is encoded for rank j with its own codec state
        (key ``{key}/to{j}``).
        """
        world, n = comm.world_size, out.numel()
        if inp.numel() != world * n:
            raise ValueError(
                f"reduce-scatter input has {inp.numel()} entries, expected {world} x {n}"
            )
        flat = inp.detach().reshape(world, n)
        ref = None
        if self.diagnose:
            ref = self._exact_mean(flat, comm)[comm.rank] * (comm.world_size * factor / divisor)
        start = self._begin(comm)
        codec = self.codec
        if codec.nonfinite == "propagate":
            flag = torch.tensor([0.0 if bool(torch.isfinite(flat).all()) else 1.0],
                                device=flat.device)
            if float(comm.all_reduce([flag], op="max")[0]) > 0:
                out.fill_(float("nan"))
                self._finish(comm, inp, start, baseline="reduce_scatter")
                return
        if codec.multi_round:
            mean, _ = codec.reduce(flat.reshape(-1), key, comm)
            result = mean.reshape(world, n)[comm.rank]
            scale = world * factor / divisor
            result = result * scale if scale != 1.0 else result
        else:
            def scaled(j: int) -> torch.Tensor:
                c = flat[j]
                c = c / divisor if divisor != 1.0 else c
                return c * factor if factor != 1.0 else c

            payloads = [codec.encode(scaled(j), key=f"{key}/to{j}") for j in range(world)]
            if codec.summable:
                result = self._scatter_summable(payloads, comm)
            else:
                result = self._scatter_bytes(payloads, comm, n, out.device)
        out.copy_(result.reshape(out.shape))
        self._finish(comm, inp, start, baseline="reduce_scatter")
        for j in range(world):
            self._record_residual(f"{key}/to{j}")
        if ref is not None:
            self._compare(out, ref, link_bytes("all_reduce", 4 * inp.numel(), comm.world_size))

    def _scatter_summable(self, payloads: list[Payload], comm: TorchCommunicator
                          ) -> torch.Tensor:
        per_chunk = [[t for _, t in p.leaves()] for p in payloads]
        summed: list[torch.Tensor] = []
        for i in range(len(per_chunk[0])):
            stacked = torch.stack([leaves[i] for leaves in per_chunk])
            summed.append(comm.reduce_scatter_sum(stacked))
        mine = payloads[comm.rank]
        return self.codec.decode(mine.with_leaves(summed))

    def _scatter_bytes(self, payloads: list[Payload], comm: TorchCommunicator, n: int,
                       device: Any) -> torch.Tensor:
        blobs = comm.all_to_all_bytes([p.to_tensor(device=device) for p in payloads])
        total: torch.Tensor | None = None
        for blob in blobs:  # rank order on every rank: deterministic sums
            part = self.codec.decode(Payload.deserialize(blob)).to(device)
            total = part if total is None else total + part
        assert total is not None
        return total
