"""GradiVeQ (Yu et al., NeurIPS 2018): PCA vector quantization of gradient slices.

Yu et al. observe strong linear correlation between gradient slices of CNNs. The
flat gradient is cut into m = n // d slices of dimension d; a PCA basis U (d x k)
fitted on full gradients maps every slice s to k coefficients c = Uᵀ s and back
to U c. The map is *linear*, so with one basis shared by every rank the
coefficients of different ranks can be summed (Σ Uᵀ s_i = Uᵀ Σ s_i) inside a plain
all-reduce — the property that distinguishes GradiVeQ from other quantizers. The
basis is refitted every L steps from uncompressed gradients.

``reduce`` is the paper's protocol. Steps 0, L, 2L, ... ("refresh steps") all-reduce
the gradient uncompressed and fit the basis on the *aggregated* gradient, which is
identical on every rank, so every rank derives the same U and the basis itself is
never sent (a 16-byte all-reduce of its fingerprint checks that every rank did
derive the same U, ``agreement.py``). Other steps all-reduce only the coefficients
(m x k floats, a ratio of about d / k) and the n mod d tail values that do not fill
a slice.

Standalone ``encode``/``decode`` (one payload, decodable by anyone, no slot):

* refresh steps send the gradient uncompressed and fit the basis on it (the local
  gradient: standalone has no aggregate), exactly like ``reduce`` does;
* other steps send the coefficients, the tail *and the basis U* (d x k floats), so
  the payload is self-contained. The decoder cannot be assumed to hold the encoder's
  slot, and the basis is small next to the coefficients of a large tensor
  (d * k vs n * k / d). Its bytes are in ``wire_bytes`` like everything else.
* Tensors for which coefficients + basis would not be smaller than the tensor
  (always when n < d) are sent uncompressed.

Design choices:

* **Uncentred PCA.** The basis is the top-k eigenvectors of the slices' second
  moment SᵀS rather than of their covariance, so the code map stays strictly linear
  (the sum of codes is the code of the sum with no world-size-dependent mean term).
* **Summability flag.** The coefficients are summable under a shared basis and
  ``reduce`` exploits exactly that. A *standalone* payload, however, carries a basis
  fitted on its own rank's gradient; summing such payloads leaf by leaf would sum the
  bases too, so ``summable`` is honestly False.
* The paper optionally scalar-quantizes the coefficients as well; that is not done
  here (a multi-round stage stands alone in a chain), so coefficients are fp32.
"""

from __future__ import annotations

import torch

from gradzip.codecs.base import Compressor, Slot
from gradzip.codecs.payload import Payload, PayloadError
from gradzip.codecs.registry import Param, SpecError, at_least, register
from gradzip.collectives.agreement import check_same_on_all_ranks
from gradzip.collectives.communicator import Communicator


def fit_basis(slices: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k principal directions (d x k, orthonormal) of the rows of ``slices``.

    Uncentred: eigenvectors of the d x d second moment Sᵀ S (accumulated in float32,
    decomposed in float64), largest eigenvalue first, each column's sign fixed so its
    largest-magnitude entry is positive (deterministic output for identical input).
    The slices are scaled to a largest magnitude of 1 first: the eigenvectors do not
    change, but a float32 Sᵀ S of raw values would overflow for |x| above ~1e17 and
    underflow to denormals (then NaN) below ~1e-20.
    """
    if slices.numel():  # on the device: no host read of the peak
        peak = slices.abs().amax()
        slices = slices * torch.where(peak > 0, peak.reciprocal(), torch.ones_like(peak))
    gram = (slices.T @ slices).double()
    _, vecs = torch.linalg.eigh(gram)  # ascending eigenvalues
    u = vecs[:, -k:].flip(-1)
    pivot = u.abs().argmax(dim=0)
    signs = torch.sign(u[pivot, torch.arange(k, device=u.device)])
    signs[signs == 0] = 1.0
    return (u * signs).to(slices.dtype).contiguous()


def _rebuild(coeffs: torch.Tensor, u: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The flat tensor: slices U c written in place, then the tail (no concatenation copy)."""
    m, d = coeffs.shape[0], u.shape[0]
    out = torch.empty(m * d + tail.numel(), dtype=torch.float32, device=coeffs.device)
    torch.mm(coeffs, u.T, out=out[: m * d].view(m, d))
    out[m * d :] = tail
    return out


@register("gradiveq")
class GradiVeQ(Compressor):
    """Summable PCA codes of d-dim gradient slices, basis refit every L steps (Yu et al. 2018)."""

    summary = "PCA codes of d-dim gradient slices, summable under a shared basis (Yu et al. 2018)"
    PARAMS = (
        Param("dim", int, 64, "slice dimension d the flat gradient is cut into", at_least(2)),
        Param("rank", int, 8, "principal components k kept per slice (k < d; ratio ~ d/k)",
              at_least(1)),
        Param("refresh", int, 100,
              "refit the basis every L steps; those steps send the gradient uncompressed",
              at_least(1)),
    )
    # see module docstring: standalone payloads carry rank-local bases
    summable = False
    # a projection onto a fitted subspace: biased
    unbiased = False
    multi_round = True
    positional_state = True  # the basis is fitted to the tensor's own slices

    def validate(self) -> None:
        if self.params["rank"] >= self.params["dim"]:
            raise SpecError(
                f"gradiveq: rank ({self.params['rank']}) must be smaller than dim "
                f"({self.params['dim']}), or the codes are no smaller than the slices"
            )

    # ------------------------------------------------------------ helpers
    def _split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slices m x d, tail of n mod d values)."""
        d = self.params["dim"]
        m = flat.numel() // d
        return flat[: m * d].reshape(m, d), flat[m * d :]

    def _refresh_due(self, slot: Slot) -> bool:
        return slot.step % self.params["refresh"] == 0 or "basis" not in slot.data

    def _standalone_pays(self, n: int) -> bool:
        """Coefficients + basis strictly smaller than the slices they replace."""
        d, k = self.params["dim"], self.params["rank"]
        m = n // d
        return m > 0 and m * k + d * k < m * d

    def _refit(self, slot: Slot, flat: torch.Tensor) -> None:
        slices, _ = self._split(flat)
        slot.data["basis"] = fit_basis(slices, self.params["rank"])
        slot.data["fitted_step"] = slot.step

    def _basis(self, slot: Slot, device: torch.device) -> torch.Tensor:
        u = slot.data["basis"]
        if tuple(u.shape) != (self.params["dim"], self.params["rank"]):
            raise ValueError(
                f"gradiveq: stored basis for key {slot.key!r} has shape {tuple(u.shape)}, "
                f"expected {(self.params['dim'], self.params['rank'])}"
            )
        return u.to(device)

    # ------------------------------------------------------------ standalone
    def encode(self, x: torch.Tensor, slot: Slot) -> Payload:
        """Uncompressed on refresh steps (and fit U); else coefficients + tail + U."""
        flat = x.reshape(-1)
        if not self._standalone_pays(flat.numel()):
            return Payload({"values": flat})
        if self._refresh_due(slot):
            self._refit(slot, flat)
            return Payload({"values": flat})
        u = self._basis(slot, x.device)
        slices, tail = self._split(flat)
        fields: dict = {"coeffs": slices @ u, "basis": u}
        if tail.numel():
            fields["tail"] = tail
        return Payload(fields)

    def decode(self, p: Payload, shape: torch.Size, slot: Slot | None) -> torch.Tensor:
        """Rebuild from the payload alone (it carries its basis; the slot is not needed)."""
        if "values" in p.fields:
            values = p.tensor("values")
            if values.numel() != shape.numel():
                raise PayloadError(
                    f"gradiveq: payload has {values.numel()} values for shape {tuple(shape)}"
                )
            return values.float().reshape(shape)
        coeffs, u = p.tensor("coeffs").float(), p.tensor("basis").float()
        tail = p.tensor("tail").float() if "tail" in p.fields else coeffs.new_zeros(0)
        if coeffs.dim() != 2 or u.dim() != 2 or coeffs.shape[1] != u.shape[1] \
                or coeffs.shape[0] * u.shape[0] + tail.numel() != shape.numel():
            raise PayloadError(
                f"gradiveq: coefficients {tuple(coeffs.shape)}, basis {tuple(u.shape)} and "
                f"{tail.numel()} tail values do not rebuild shape {tuple(shape)}"
            )
        return _rebuild(coeffs, u, tail).reshape(shape)

    # ------------------------------------------------------------ distributed
    def reduce(
        self, x: torch.Tensor, slot: Slot, comm: Communicator, want_local: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The paper's protocol: raw all-reduce + basis fit on refresh steps, codes otherwise.

        The local estimate (for error feedback) is x itself on uncompressed steps and
        this rank's projection U Uᵀ s (plus exact tail) otherwise; its mean over ranks
        is the aggregate.
        """
        world = comm.world_size
        flat = x.reshape(-1)
        d = self.params["dim"]
        if flat.numel() < d or self._refresh_due(slot):
            # clone: a real all-reduce may work in place on the caller's tensor
            (total,) = comm.all_reduce([flat.clone()])
            mean = total / world
            if flat.numel() >= d:
                self._refit(slot, mean)  # identical on every rank: U is never sent
                # ... unless one rank's arithmetic differs: check (16 bytes) it does not
                check_same_on_all_ranks(comm, slot.data["basis"], self.spec, "PCA basis",
                                        slot.key)
            return mean.reshape(x.shape), (x.clone() if want_local else None)
        u = self._basis(slot, x.device)
        slices, tail = self._split(flat)
        coeffs = slices @ u
        local = None
        if want_local:  # before the all-reduce, which may overwrite coeffs in place
            local = _rebuild(coeffs, u, tail).reshape(x.shape)
        sent = [coeffs] + ([tail.clone()] if tail.numel() else [])
        summed = comm.all_reduce(sent)
        rest = summed[1] if tail.numel() else tail
        return _rebuild(summed[0], u, rest).div_(world).reshape(x.shape), local
