"""PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019): rank-r low-rank compression.

A gradient tensor is viewed as a matrix M (n x m) and approximated by P̂ Qᵀ with
r columns each, found by *one* step of subspace (power) iteration per SGD step::

    P  = M Q          # Q: m x r, warm-started from the previous step
    P̂  = orth(P)      # orthonormal columns
    Q  = Mᵀ P̂
    M ≈ P̂ Qᵀ          # the orthogonal projection of M onto span(P̂)

Warm-starting Q from the previous step (Algorithm 1, "reuse Q") turns the
one-step approximation into power iteration over training: on a slowly changing
gradient the subspace converges to the top-r singular subspace.

The paper's setting is distributed (Algorithm 2): P and Q are linear in M, so
they are *all-reduced*, not gathered — ``reduce`` runs that two-round protocol
(all-reduce P, orthogonalise, Q = Mᵀ P̂, all-reduce Q). Error feedback is an
essential part of the method (``ef | powersgd(rank=2)`` is the paper's setting):
``reduce`` returns this rank's own estimate P̂ Q_iᵀ, whose mean over ranks is the
aggregate, for the ``ef`` wrapper to keep the residual.

Design choices:

* **Matrix view.** ``shape[0] x rest`` for every tensor with >= 2 dims. For a conv
  kernel (out, in, kh, kw) that is out x (in*kh*kw), the reshape used by the paper
  and by PyTorch's ``powerSGD_hook``; it keeps each output filter a row.
* **Uncompressed fallback.** Vectors, scalars, empty tensors and matrices with
  (n + m) * r * min_compression_rate >= n * m (low rank would not send enough fewer
  numbers) go uncompressed, as PyTorch's hook does (``_should_compress``; its default
  rate is 2, gradzip's 1 compresses every matrix the paper would). Start compressing
  after N uncompressed steps (PyTorch's ``start_powerSGD_iter``) with
  ``gradzip.attach(..., start_step=N)``.
* **Thin products.** M Q and Mᵀ P are computed as (Qᵀ Mᵀ)ᵀ and (Pᵀ M)ᵀ: the same
  numbers, 3-10x faster on CPU BLAS for a large row-major M.
* **Shared initial Q.** Drawn from the slot's *shared* generator (same seed on every
  rank) and orthogonalised, so all ranks start identical and, since Q is then
  updated from all-reduced quantities, stay identical.
* **Orthogonalised warm start.** The reused Q is orthonormalised before use (as
  PyTorch's hook does). span(M Q) does not change, so neither does the result in
  exact arithmetic, but the scale of Q no longer compounds across steps (Q has the
  magnitude of M; P = M Q would have M's squared, underflowing for tiny gradients).
* **Orthogonalisation** uses Householder QR instead of the paper's Gram-Schmidt:
  same span, better conditioned, and it always returns orthonormal columns even
  when P is rank deficient (a zero gradient), so no epsilon is needed.
"""

from __future__ import annotations

import torch

from gradzip.codecs.base import Compressor, Shapes, Slot
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.registry import Param, at_least, register
from gradzip.collectives.communicator import Communicator


def matrix_view(shape: torch.Size, rank: int, min_rate: float = 1.0
                ) -> tuple[int, int] | None:
    """(n, m) of the matrix PowerSGD compresses, or None if it is sent uncompressed.

    None for tensors with fewer than 2 dims, empty tensors, and matrices where
    r * (n + m) * min_rate >= n * m, i.e. the factors would not be ``min_rate`` times
    smaller than the matrix (PyTorch's ``min_compression_rate``).
    """
    if len(shape) < 2:
        return None
    n = shape[0]
    numel = shape.numel()
    if numel == 0:
        return None
    m = numel // n
    if rank * (n + m) * min_rate >= n * m:
        return None
    return n, m


def times_thin(mat: torch.Tensor, thin: torch.Tensor) -> torch.Tensor:
    """``mat @ thin`` for a thin ``thin`` (m x r, r small), computed as (thinᵀ matᵀ)ᵀ.

    The same product; CPU BLAS runs the wide-times-matrix form 3-4x faster than the
    matrix-times-thin one for r <= 8 (``gradzip bench comm`` measures the step).
    """
    return (thin.T @ mat.T).T


def transposed_times_thin(mat: torch.Tensor, thin: torch.Tensor) -> torch.Tensor:
    """``mat.T @ thin`` (thin: n x r), computed as (thinᵀ mat)ᵀ: 10x faster on CPU
    BLAS than multiplying by a transposed view of a large row-major matrix."""
    return (thin.T @ mat).T


def orthonormal(a: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of the columns of ``a`` (n x r, r <= n), by Householder QR."""
    return torch.linalg.qr(a, mode="reduced").Q


@register("powersgd")
class PowerSGD(Compressor):
    """Rank-r approximation P̂ Qᵀ by warm-started power iteration (Vogels et al. 2019)."""

    summary = "rank-r low-rank approximation by warm-started power iteration (Vogels et al. 2019)"
    PARAMS = (
        Param("rank", int, 2, "rank r of the approximation P̂ Qᵀ (paper: 1-4)", at_least(1)),
        Param(
            "warm_start", bool, True,
            "reuse last step's Q, so successive steps continue one power iteration",
        ),
        Param(
            "min_compression_rate", float, 1.0,
            "compress a matrix only if its factors are this many times smaller "
            "(PyTorch's powerSGD_hook uses 2)", at_least(1.0),
        ),
    )
    # decode(P1 + P2, Q1 + Q2) != P1 Q1ᵀ + P2 Q2ᵀ: the payload is bilinear, not linear;
    # ``reduce`` all-reduces P and Q in two rounds instead.
    summable = False
    # a projection onto a data-dependent subspace: biased (error feedback fixes that)
    unbiased = False
    multi_round = True
    positional_state = True  # Q (m x r) belongs to the tensor's columns
    needs_matrices = True  # a 1-D tensor is all-reduced uncompressed

    # ------------------------------------------------------------ helpers
    def _matrix(self, shape: torch.Size) -> tuple[int, int] | None:
        return matrix_view(shape, self.params["rank"], self.params["min_compression_rate"])

    def _start_q(self, slot: Slot, m: int, device: torch.device) -> torch.Tensor:
        """The orthonormal Q this step starts from: last step's, or shared-random."""
        r = self.params["rank"]
        q = slot.data.get("q") if self.params["warm_start"] else None
        if q is None or tuple(q.shape) != (m, r):
            # CPU generator then move: identical on every rank and device
            q = torch.randn(m, r, generator=slot.generator("cpu", shared=True))
        return orthonormal(q.to(device=device, dtype=torch.float32))

    def _remember(self, slot: Slot, q: torch.Tensor) -> None:
        if self.params["warm_start"]:
            slot.data["q"] = q.detach().clone()

    # ------------------------------------------------------------ standalone
    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        """One power-iteration step on this tensor alone: payload (P̂, Q)."""
        dims = self._matrix(x.shape)
        if dims is None:
            return Payload({"values": x.reshape(-1)})
        mat = x.reshape(dims)
        q = self._start_q(slot, dims[1], x.device)
        p = orthonormal(times_thin(mat, q))
        q = transposed_times_thin(mat, p)
        self._remember(slot, q)
        return Payload({"p": p, "q": q})

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        if "values" in p.fields:
            values = p.tensor("values")
            if values.numel() != shape.numel():
                raise PayloadError(
                    f"powersgd: payload has {values.numel()} values for shape {tuple(shape)}"
                )
            return values.float().reshape(shape)
        pm, qm = p.tensor("p").float(), p.tensor("q").float()
        n = shape[0] if len(shape) >= 2 else -1
        m = shape.numel() // n if n > 0 else -1
        if pm.dim() != 2 or qm.dim() != 2 or pm.shape[0] != n or qm.shape[0] != m \
                or pm.shape[1] != qm.shape[1]:
            raise PayloadError(
                f"powersgd: factors {tuple(pm.shape)} and {tuple(qm.shape)} do not "
                f"rebuild shape {tuple(shape)}"
            )
        return (pm @ qm.T).reshape(shape)

    # ------------------------------------------------------------ distributed
    def reduce(
        self, x: torch.Tensor, slot: Slot, comm: Communicator, want_local: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Algorithm 2 of the paper: all-reduce P, orthogonalise, all-reduce Q.

        Returns the mean approximation P̂ Q̄ᵀ and this rank's own estimate P̂ Q_iᵀ
        (their mean over ranks is the aggregate, so error feedback stays consistent).
        Uncompressed tensors are all-reduced as they are.
        """
        world = comm.world_size
        dims = self._matrix(x.shape)
        if dims is None:
            # clone: a real all-reduce may work in place, and x may be the caller's tensor
            (total,) = comm.all_reduce([x.reshape(-1).clone()])
            return (total / world).reshape(x.shape), (x.clone() if want_local else None)
        mat = x.reshape(dims)
        q = self._start_q(slot, dims[1], x.device)
        # sum, not mean: orthogonalisation is scale invariant
        (p,) = comm.all_reduce([times_thin(mat, q).contiguous()])
        p = orthonormal(p)
        q_local = transposed_times_thin(mat, p).contiguous()
        # before the all-reduce, which may overwrite q_local in place
        local = (p @ q_local.T).reshape(x.shape) if want_local else None
        (q_sum,) = comm.all_reduce([q_local])
        q_mean = q_sum / world
        self._remember(slot, q_mean)
        return (p @ q_mean.T).reshape(x.shape), local

    def reduce_tensors(
        self, x: torch.Tensor, slot: Slot, comm: Communicator, want_local: bool,
        shapes: Shapes,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Algorithm 2 for a whole bucket in two all-reduces, as ``powerSGD_hook`` does.

        Every matrix's P goes into one buffer (with the uncompressed vectors appended),
        every matrix's Q into another: 2 collectives per bucket instead of 2 per matrix.
        Each matrix keeps its own warm-start Q (``q{j}`` in the slot).
        """
        world, rank = comm.world_size, self.params["rank"]
        flat = x.reshape(-1)
        mats, vecs = _split_bucket(shapes, rank, self.params["min_compression_rate"])
        fresh = slot.generator("cpu", shared=True)  # one draw per matrix, in order
        qs = [self._start_q_at(slot, f"q{j}", dims[1], x.device, fresh)
              for j, _, dims in mats]
        views = [flat[o:o + d[0] * d[1]].view(d) for _, o, d in mats]
        vec_parts = [flat[o:o + n] for o, n in vecs]
        first = torch.cat([times_thin(m, q).reshape(-1) for m, q in zip(views, qs, strict=True)]
                          + vec_parts) if views or vec_parts else flat.new_zeros(0)
        (first,) = comm.all_reduce([first])  # sums: orthogonalisation is scale invariant
        ps, offset = [], 0
        for _, _, d in mats:
            ps.append(orthonormal(first[offset:offset + d[0] * rank].view(d[0], rank)))
            offset += d[0] * rank
        q_locals = [transposed_times_thin(m, p) for m, p in zip(views, ps, strict=True)]
        local = None
        if want_local:  # before the all-reduce below, which may reuse the buffer
            local = torch.empty_like(flat)
            for (_, o, d), p, q in zip(mats, ps, q_locals, strict=True):
                torch.mm(p, q.T, out=local[o:o + d[0] * d[1]].view(d))
            for o, n in vecs:
                local[o:o + n] = flat[o:o + n]
        second = (torch.cat([q.reshape(-1) for q in q_locals]) if q_locals
                  else flat.new_zeros(0))
        (second,) = comm.all_reduce([second]) if q_locals else (second,)
        mean = torch.empty_like(flat)
        qoff = 0
        for (j, o, d), p in zip(mats, ps, strict=True):
            q_mean = second[qoff:qoff + d[1] * rank].view(d[1], rank) / world
            qoff += d[1] * rank
            if self.params["warm_start"]:
                slot.data[f"q{j}"] = q_mean.detach().clone()
            torch.mm(p, q_mean.T, out=mean[o:o + d[0] * d[1]].view(d))
        voff = offset
        for o, n in vecs:
            mean[o:o + n] = first[voff:voff + n] / world
            voff += n
        return mean.reshape(x.shape), (local.reshape(x.shape) if local is not None else None)

    def _start_q_at(self, slot: Slot, name: str, m: int, device: torch.device,
                    fresh: torch.Generator) -> torch.Tensor:
        """Matrix ``name``'s starting Q: its last one, or drawn from ``fresh``."""
        r = self.params["rank"]
        q = slot.data.get(name) if self.params["warm_start"] else None
        if q is None or tuple(q.shape) != (m, r):
            q = torch.randn(m, r, generator=fresh)
        return orthonormal(q.to(device=device, dtype=torch.float32))


def _split_bucket(shapes: Shapes, rank: int, min_rate: float
                  ) -> tuple[list[tuple[int, int, tuple[int, int]]], list[tuple[int, int]]]:
    """(index, offset, matrix dims) of compressible tensors; (offset, numel) of the rest."""
    mats, vecs, offset = [], [], 0
    for j, s in enumerate(shapes):
        dims = matrix_view(torch.Size(s), rank, min_rate)
        if dims is None:
            vecs.append((offset, torch.Size(s).numel()))
        else:
            mats.append((j, offset, dims))
        offset += torch.Size(s).numel()
    return mats, vecs
