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

With W = 1 nothing crosses a link.

The table is the ``ideal`` model, which NCCL's ring algorithms and the simulated
communicator follow. gloo differs in two ways, both measured here with the kernel's
loopback counter inside a fresh network namespace (``python -m
gradzip.bench.linkcount --probe``; 64 B to 1 MiB, W = 2 and 4):

* its ``reduce_scatter`` runs a whole ring all-reduce and keeps one chunk, so it
  sends 2 (W-1)/W x nbytes, like ``all_reduce`` (kernel / ideal model = 2.00);
* every call costs a fixed amount of transport on top of the data: TCP/IP headers
  and ACKs of each message and gloo's preambles and ring notifications, about
  90 bytes a packet. Per rank and call it grows with the ring's W-1 steps:
  ``GLOO_CALL_BYTES[op] x (W-1)``. Codecs that issue many small collectives
  (PowerSGD's P and Q per matrix, sketches) pay it visibly: without it their
  kernel bytes were 15% above the model at W = 4; with it the model is within a
  few percent for every codec (tests/test_link_bytes.py, ``gradzip bench link``).

The baseline of every compression ratio (``bytes_raw``) is the same model applied to
PyTorch's uncompressed collective of the gradient in its own dtype: an
``all_reduce`` per DDP bucket, a ``reduce_scatter`` per FSDP unit.
"""

from __future__ import annotations

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
#: link models: ``ideal`` (bandwidth-optimal rings: NCCL, the simulated group), ``gloo``
BACKENDS = ("ideal", "gloo")

#: gloo over TCP: transport bytes per rank, per call and per ring step (x (W-1)),
#: measured on loopback (all_reduce 1.3 kB at W = 2, 4.1 kB at W = 4; all_gather 0.65
#: and 2.05 kB; all_to_all 0.34 and 1.03 kB; broadcast 0.17 and 0.26 kB)
GLOO_CALL_BYTES = {"all_reduce": 1350, "reduce_scatter": 1350, "all_gather": 670,
                   "all_to_all": 340, "broadcast": 130}


def link_bytes(op: str, nbytes: int, world_size: int, backend: str = "ideal") -> int:
    """Bytes one rank puts on its link when it hands ``nbytes`` to collective ``op``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown link model {backend!r}; known: {', '.join(BACKENDS)}")
    w = world_size
    if w == 1:
        return 0
    algorithm = "all_reduce" if backend == "gloo" and op == "reduce_scatter" else op
    data = _data_bytes(algorithm, nbytes, w)
    return data + (GLOO_CALL_BYTES[op] * (w - 1) if backend == "gloo" else 0)


def backend_model(name: str) -> str:
    """The link model for a torch.distributed backend name: ``gloo`` for gloo, and for
    the threaded ranks of ``--replicas`` (they stand in for gloo ranks, and their bytes
    must equal a gloo run's); else ideal."""
    return "gloo" if str(name).lower() in ("gloo", "threaded") else "ideal"


def _data_bytes(op: str, nbytes: int, w: int) -> int:
    if op == "all_reduce":
        return (2 * (w - 1) * nbytes) // w
    if op == "all_gather":
        return (w - 1) * nbytes
    if op in ("reduce_scatter", "all_to_all", "broadcast"):
        return ((w - 1) * nbytes) // w
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(COLLECTIVES)}")
