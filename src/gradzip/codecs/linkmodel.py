"""The link byte model: what one rank puts on its link for each collective.

"Bytes on the wire" in gradzip are the bytes that cross a rank's network link, not
the bytes handed to a collective. They follow from the size of the tensor this
rank hands in (``nbytes``), the number of ranks ``W`` and the algorithm the backend
runs for that collective (gloo on CPU and NCCL on GPU both run these bandwidth-
optimal algorithms for large messages):

==================  ==========================  ===========================================
collective          bytes this rank sends       why
==================  ==========================  ===========================================
``all_reduce``      2 (W-1)/W x nbytes          ring: reduce-scatter then all-gather, each
                                                passes W-1 chunks of nbytes/W
``all_gather``      (W-1) x nbytes              ring: every other rank needs this rank's
                                                nbytes (forwarded W-1 hops in all)
``reduce_scatter``  (W-1)/W x nbytes            ring: W-1 partial chunks of nbytes/W
``all_to_all``      (W-1)/W x nbytes            chunk j goes to rank j; its own stays home
``broadcast``       (W-1)/W x nbytes            pipelined chain: W-1 of W ranks forward
                                                nbytes (the average over ranks)
==================  ==========================  ===========================================

With W = 1 nothing crosses a link. Transport headers (TCP/IP, gloo's preamble) are
not counted; over messages of kilobytes and more they are a few percent, which is
what the kernel-counted test allows for (tests/test_link_bytes.py).

The baseline of every compression ratio (``bytes_raw``) is the same model applied to
PyTorch's uncompressed collective of the gradient in its own dtype: an
``all_reduce`` for DDP, a ``reduce_scatter`` for FSDP.
"""

from __future__ import annotations

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def link_bytes(op: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank puts on its link when it hands ``nbytes`` to collective ``op``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    w = world_size
    if op == "all_reduce":
        return (2 * (w - 1) * nbytes) // w
    if op == "all_gather":
        return (w - 1) * nbytes
    if op in ("reduce_scatter", "all_to_all", "broadcast"):
        return ((w - 1) * nbytes) // w
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(COLLECTIVES)}")
