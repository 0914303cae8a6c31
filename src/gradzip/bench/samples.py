"""Test tensors for benchmarks: a heavy-tailed synthetic one and real gradients.

The real gradient comes from one backward pass of a small transformer language model
on text from the Python standard library (no download), so benchmarks see the mix of
scales, sparsity and outliers that real LLM gradients have. A second model family, a
small residual convolutional network with batch normalisation trained on drawn images
(``cnn_gradients``), checks that a result is not a property of transformers alone.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch import nn


def heavy_tailed(numel: int, seed: int = 0) -> torch.Tensor:
    """Gaussian scaled by a log-normal: heavy tails like real gradients (fp32, 1-D)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g) * torch.randn(numel, generator=g).mul_(1.5).exp_()


def heavy_tailed_steps(numel: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` successive heavy-tailed "gradients" that share per-coordinate scales.

    Like successive real gradients, each coordinate keeps its magnitude from step to
    step (one log-normal scale per coordinate) while its value is drawn afresh, so
    stateful codecs (error feedback, momentum, warm starts) see a sequence, not the
    same tensor again. Step 0 is exactly ``heavy_tailed(numel, seed)``.
    """
    g = torch.Generator().manual_seed(seed)
    first = torch.randn(numel, generator=g)
    scale = torch.randn(numel, generator=g).mul_(1.5).exp_()
    steps = [first.mul_(scale)]
    for _ in range(count - 1):
        steps.append(torch.randn(numel, generator=g).mul_(scale))
    return steps


def _stdlib_bytes(nbytes: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= nbytes:
            break
    return bytes(out[:nbytes])


class _TinyLM(nn.Module):
    """A byte-level transformer LM (~1.3M parameters): just enough to give real gradients."""

    mask: torch.Tensor  # a registered buffer (typed here: nn.Module attributes are not)

    def __init__(self, dim: int = 128, layers: int = 4, seq: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        block = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 256)
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.pos[: idx.shape[1]]
        h = self.blocks(h, mask=self.mask[: idx.shape[1], : idx.shape[1]], is_causal=True)
        return self.head(h)


def real_gradients(seed: int = 0, steps: int = 3, batch: int = 8, seq: int = 128
                   ) -> dict[str, torch.Tensor]:
    """Per-parameter gradients of a small LM after ``steps`` SGD steps on stdlib text."""
    return real_gradient_steps(seed, first=steps, count=1, batch=batch, seq=seq)[0]


def real_gradient_steps(seed: int = 0, first: int = 3, count: int = 1, batch: int = 8,
                        seq: int = 128) -> list[dict[str, torch.Tensor]]:
    """Per-parameter gradients of ``count`` successive SGD steps of a small LM.

    The model trains for real on stdlib text: the gradients of steps ``first``,
    ``first + 1``, ... are taken, each after the update of the step before, so they
    are the sequence a stateful codec meets in training.
    """
    torch.manual_seed(seed)
    model = _TinyLM(seq=seq)
    total = first + count
    data = torch.frombuffer(bytearray(_stdlib_bytes(batch * (seq + 1) * total)),
                            dtype=torch.uint8).long()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out: list[dict[str, torch.Tensor]] = []
    for step in range(total):
        chunk = data[step * batch * (seq + 1):(step + 1) * batch * (seq + 1)].view(batch, seq + 1)
        logits = model(chunk[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 256), chunk[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if step >= first:
            out.append({name: p.grad.detach().clone()
                        for name, p in model.named_parameters() if p.grad is not None})
        if step < total - 1:
            opt.step()
    return out


def real_gradient_flat(seed: int = 0) -> torch.Tensor:
    """All parameter gradients of the small LM concatenated (like one DDP bucket)."""
    return torch.cat([g.reshape(-1) for g in real_gradients(seed).values()])


class _TinyResNet(nn.Module):
    """A residual CNN with batch normalisation (~0.5M parameters) for 32x32 RGB images:
    a stem and three stages of width w, 2w, 4w, each one residual block."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        stages: list[nn.Module] = []
        for i, w in enumerate((width, 2 * width, 4 * width)):
            if i:
                stages += [nn.Conv2d(w // 2, w, 3, stride=2, padding=1, bias=False),
                           nn.BatchNorm2d(w), nn.ReLU()]
            stages.append(_ResidualBlock(w))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


class _ResidualBlock(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w),
                                  nn.ReLU(), nn.Conv2d(w, w, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def drawn_images(batch: int, generator: torch.Generator, classes: int = 10
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` 32x32 RGB images and labels: class c is a grating at angle c * 180/classes
    degrees with a random frequency, phase and tint, plus noise (no download)."""
    labels = torch.randint(classes, (batch,), generator=generator)
    angle = labels.float() * (torch.pi / classes)
    freq = 0.2 + 0.4 * torch.rand(batch, generator=generator)
    phase = 2 * torch.pi * torch.rand(batch, generator=generator)
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    proj = xx * torch.cos(angle)[:, None, None] + yy * torch.sin(angle)[:, None, None]
    wave = torch.sin(freq[:, None, None] * proj + phase[:, None, None])
    tint = 0.5 + torch.rand(batch, 3, 1, 1, generator=generator)
    noise = 0.3 * torch.randn(batch, 3, 32, 32, generator=generator)
    return wave[:, None] * tint + noise, labels


def cnn_gradients(seed: int = 0, steps: int = 3, batch: int = 32) -> dict[str, torch.Tensor]:
    """Per-parameter gradients of a small ResNet after ``steps`` SGD steps on drawn images."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = _TinyResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps + 1):
        images, labels = drawn_images(batch, gen)
        loss = nn.functional.cross_entropy(model(images), labels)
        opt.zero_grad()
        loss.backward()
        if step < steps:
            opt.step()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()
            if p.grad is not None}


def cnn_gradient_flat(seed: int = 0) -> torch.Tensor:
    """All parameter gradients of the small ResNet concatenated (like one DDP bucket)."""
    return torch.cat([g.reshape(-1) for g in cnn_gradients(seed).values()])
