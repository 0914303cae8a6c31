"""A matrix of the ways runs are configured, on 2 gloo ranks, through the real trainer.

Most failures users of comm hooks report come from combinations: accumulation with a
hook, mixed precision, sharding. Every cell of

    {fp32, bf16 autocast} x {DDP, FSDP2} x {grad-accum 1, 4}
        x {none, summable (fp16), gathered (ef | topk), multi-round}

trains 3 steps with ``gradzip.train.loop.train`` (its autocast, ``loss / grad_accum``,
``no_sync`` on all but the last micro-batch, clipping, AdamW, evaluation, checkpoint)
on a ~6k-parameter GPT and in-memory data. The multi-round codec is ``ef |
powersgd(rank=2)`` on DDP; FSDP2 refuses PowerSGD (it compresses matrices, FSDP2 hands
over flat shards; asserted below), so its multi-round cell is ``terngrad`` (shared
scales: a max all-reduce, then the trits are summed).

What each cell must show:

* every step's loss (all-reduced, logged every step) and the final weights are finite,
  the codec took the aggregation path of its kind and sent fewer bytes than fp32;
  DDP replicas are bit-identical across ranks after training with every codec;
* ``none`` equals the same run without any hook, bit for bit (weights and losses).
  The trainer's ``--codec none`` attaches gradzip's ``none`` on DDP and nothing on
  FSDP2; gradzip's ``none`` is also attached through the documented JSON policy form
  ``{"codec": "none"}``; "no hook" is DDP's built-in all-reduce (a ``DataParallel``
  with no codec in place of ``parallelize``) or plain FSDP2. Exact
  equality is the right bar: gradients are fp32 in every cell (autocast computes in
  bf16 but parameters and their gradients stay fp32), every variant reduces the same
  fp32 buckets / shards, a 2-rank sum is one fp32 addition (commutative, so the
  collective's algorithm and order cannot change it), and the division by the world
  size is by 2, exact, before or after the sum alike. Not 1e-6: a tolerance would
  hide a hook that rounds (e.g. through fp16) or drops a bucket on one step;
* grad-accum 4 with ``none`` equals one step on the 4x batch: the trainer's loader
  yields consecutive samples, so the 4 micro-batches of 2 sequences are the 8
  sequences of the big batch. Compared after one optimizer step: the reduced
  gradient the optimizer sees and the weights after the step. The optimizer is
  replaced by plain SGD (lr 1, no clipping) for this: AdamW's first update is
  lr * g / (|g| + eps) ~ lr * sign(g), which would hide a wrong gradient scale
  (e.g. a missing ``/ grad_accum``) and flip on rounding noise where g ~ 0.
  Tolerance, relative to the gradient's norm: fp32 1e-5 (measured 1.6e-7, each tensor
  at most 2.5e-7: the mean is summed in another order); bf16 autocast 2e-2 (measured
  1.7e-3, each tensor at most 2.9e-3: each micro-batch's weight gradient is a bf16
  matmul over fewer rows, rounded to bf16 before the fp32 accumulation); 3x that per
  tensor. A missing or doubled ``/ grad_accum`` is off by 300%.

The 2 ranks are spawned once for the whole matrix (a module fixture); its 53 runs take
about 30 s on 2 CPU cores. CUDA-only cells (fp16 autocast + GradScaler) are written at
the end and skipped without 2 CUDA devices.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from gradzip.comm.launch import run_ranks

pytestmark = pytest.mark.dist

DTYPES = ("fp32", "bf16")
PARALLELS = ("ddp", "fsdp")
ACCUMS = (1, 4)
KINDS = ("none", "summable", "gathered", "multi-round")
CODECS = {
    "summable": {"ddp": "fp16", "fsdp": "fp16"},
    "gathered": {"ddp": "ef | topk(ratio=0.1)", "fsdp": "ef | topk(ratio=0.1)"},
    "multi-round": {"ddp": "ef | powersgd(rank=2)", "fsdp": "terngrad"},
}
GRADZIP_NONE = json.dumps({"codec": "none"})  # gradzip's `none` codec, attached by the trainer
STEPS = 3
FSDP_UNITS = 3  # apply_fsdp: one fully_shard per block (n_layer 2), then the root
VOCAB = 64
SEQ = 16
MICRO = 2  # sequences per micro-batch per rank


# ---------------------------------------------------------------- in-memory data
class _Tokenizer:
    vocab_size = VOCAB

    def save(self, path: Path) -> None:
        Path(path).write_text("{}")


class _Data:
    """What ``train(data=...)`` reads: a tokenizer, train and val token streams."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokenizer = _Tokenizer()
        self.train = torch.randint(0, VOCAB, (4096,), generator=g)
        self.val = torch.randint(0, VOCAB, (1024,), generator=g)


class _Loader:
    """``make_loader``: sample i of a rank is window (seed + i) * world + rank (strided).

    Consecutive samples: 4 batches of 2 are exactly the one batch of 8 (the
    accumulation cells rely on this)."""

    def __init__(self, tokens: torch.Tensor, *, batch_size: int, seq_len: int, rank: int,
                 world_size: int, seed: int, prefetch: int = 0) -> None:
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.sample = 0

    def __iter__(self) -> _Loader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.tokens.numel() - self.seq_len - 1
        starts = [((self.seed + self.sample + i) * self.world_size + self.rank) * 37 % n
                  for i in range(self.batch_size)]
        self.sample += self.batch_size
        x = torch.stack([self.tokens[s:s + self.seq_len] for s in starts])
        y = torch.stack([self.tokens[s + 1:s + self.seq_len + 1] for s in starts])
        return x, y

    def state_dict(self) -> dict[str, int]:
        return {"sample": self.sample}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sample = state["sample"]

    def close(self) -> None:
        pass

    def __enter__(self) -> _Loader:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


# ---------------------------------------------------------------- the runs, in the ranks
def _job(out: Path, *, dtype: str, parallel: str, accum: int, codec: str, steps: int = STEPS,
         batch: int = MICRO, clip: float = 1.0, lr: float = 3e-3) -> Any:
    from gradzip.train.config import JobConfig

    cfg = JobConfig()
    m = cfg.model
    m.n_layer, m.n_head, m.dim, m.ffn_dim, m.max_seq_len = 2, 2, 16, 32, SEQ
    cfg.data.seq_len, cfg.data.batch_size, cfg.data.prefetch = SEQ, batch, 0
    o = cfg.optim
    o.grad_accum, o.warmup_steps, o.lr, o.grad_clip = accum, 1, lr, clip
    t = cfg.train
    t.max_steps, t.device, t.dtype, t.parallel, t.codec = steps, "cpu", dtype, parallel, codec
    # 10 kB buckets: several DDP buckets (the first step runs in one, before the rebuild)
    t.bucket_cap_mb, t.eval_every, t.eval_steps, t.threads = 0.01, 0, 1, 1
    r = cfg.run
    r.out, r.log_every, r.tensorboard, r.progress = str(out), 1, False, False
    cfg.validate()
    return cfg


def _jobs() -> list[dict[str, Any]]:
    """Every run of the matrix: (name, _job keywords, patches)."""
    jobs = []
    for d in DTYPES:
        for p in PARALLELS:
            for a in ACCUMS:
                cell = f"{d}-{p}-accum{a}"
                common = {"dtype": d, "parallel": p, "accum": a}
                jobs.append({"name": f"{cell}-none", "job": {**common, "codec": "none"}})
                jobs.append({"name": f"{cell}-gradzip-none",
                             "job": {**common, "codec": GRADZIP_NONE}})
                if p == "ddp":
                    jobs.append({"name": f"{cell}-nohook", "no_hook": True,
                                 "job": {**common, "codec": "none"}})
                for kind, specs in CODECS.items():
                    jobs.append({"name": f"{cell}-{kind}", "job": {**common, "codec": specs[p]}})
            # one optimizer step of 4 x 2 sequences against one of 8, plain SGD
            for a, batch in ((4, MICRO), (1, 4 * MICRO)):
                jobs.append({"name": f"{d}-{p}-sgd-accum{a}", "sgd": True,
                             "job": {"dtype": d, "parallel": p, "accum": a, "codec": "none",
                                     "steps": 1, "batch": batch, "clip": 0.0, "lr": 1.0}})
    jobs.append({"name": "fsdp-powersgd", "expect_error": True,
                 "job": {"dtype": "fp32", "parallel": "fsdp", "accum": 1,
                         "codec": "ef | powersgd(rank=2)"}})
    return jobs


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an FSDP2 DTensor is all-gathered: every rank calls this)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().clone()


def _logged_losses(run_dir: Path, rank: int) -> list[float]:
    rows = [json.loads(line) for line in
            (run_dir / "logs" / f"rank{rank}.log").read_text().splitlines()
            if line.startswith("{")]
    return [r["loss/train"] for r in rows if "loss/train" in r]


def _matrix(rank: int, jobs: list[dict[str, Any]], root: str) -> dict[str, Any]:
    # train() reads its rank from the environment; the group run_ranks made is reused
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    from gradzip.codecs.registry import SpecError
    from gradzip.train import loop, parallel
    from gradzip.train.components import Components, build_optimizer
    from gradzip.train.model import GPT

    made: list[tuple[GPT, dict[str, torch.Tensor]]] = []

    class Recorded(GPT):  # the trainer's model, kept (with its initial weights) to read
        def __init__(self, cfg: Any) -> None:
            super().__init__(cfg)
            made.append((self, {n: p.detach().clone() for n, p in self.named_parameters()}))

    seen: list[dict[str, torch.Tensor]] = []

    def sgd(model: torch.nn.Module, o: Any) -> torch.optim.Optimizer:
        class RecordingSGD(torch.optim.SGD):  # keeps the gradient each step applies
            def step(self, closure: Any = None) -> Any:
                seen.append({n.removeprefix("module."): _full(p.grad)  # DDP names
                             for n, p in model.named_parameters()})
                return super().step(closure)

        return RecordingSGD([p for p in model.parameters() if p.requires_grad], lr=o.lr)

    def ddp_without_hook(raw: Any, info: Any, *, bucket_cap_mb: float, **_: Any) -> Any:
        return parallel.DataParallel(raw, parallel.apply_ddp(raw, info,
                                                             bucket_cap_mb=bucket_cap_mb))

    data = _Data()
    results: dict[str, Any] = {}
    for job in jobs:
        out = Path(root) / job["name"]
        parts = Components(  # the trainer's parts, injected: the recorded model, ...
            model=Recorded, optimizer=sgd if job.get("sgd") else build_optimizer,
            parallelize=ddp_without_hook if job.get("no_hook") else parallel.parallelize,
            data=data, make_loader=_Loader)
        made.clear()
        seen.clear()
        try:
            rec = loop.train(_job(out, **job["job"]), components=parts)
        except SpecError as e:
            if not job.get("expect_error"):
                raise
            results[job["name"]] = {"error": str(e)}
            continue
        model, initial = made[-1]
        results[job["name"]] = {
            "losses": _logged_losses(out, rank),
            "record": {k: rec[k] for k in ("train_loss", "val_loss", "aggregation",
                                           "bytes_raw_total", "bytes_wire_total",
                                           "comm_time_ms_by_op", "steps", "grad_accum",
                                           "replicas_identical")},
            "initial": initial,
            "weights": {n: _full(p) for n, p in model.named_parameters()},
            "grads": list(seen),
        }
    return results


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every run of the matrix on 2 gloo ranks; per rank, results by run name."""
    root = tmp_path_factory.mktemp("matrix")
    return run_ranks(_matrix, 2, _jobs(), str(root), timeout=600.0)


# ---------------------------------------------------------------- the cells
CELLS = [(d, p, a, k) for d in DTYPES for p in PARALLELS for a in ACCUMS for k in KINDS]


def _id(cell: tuple) -> str:
    d, p, a, k = cell
    return f"{d}-{p}-accum{a}-{k}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("cell", CELLS, ids=_id)
def test_cell_trains_finite(matrix: list[dict[str, Any]], cell: tuple) -> None:
    d, p, a, kind = cell
    runs = [r[_id(cell)] for r in matrix]
    for run in runs:
        assert len(run["losses"]) == STEPS, run["losses"]
        assert all(math.isfinite(v) for v in run["losses"]), run["losses"]
        assert math.isfinite(run["record"]["val_loss"])
        assert run["record"]["grad_accum"] == a and run["record"]["steps"] == STEPS
        assert all(torch.isfinite(w).all() for w in run["weights"].values())
        # it trained: the weights moved from their initial values
        assert any(not torch.equal(w, run["initial"][n]) for n, w in run["weights"].items())
    rec = runs[0]["record"]
    if a > 1:
        # accumulation with a hook: it runs on the last micro-batch only (no_sync /
        # set_requires_gradient_sync): the same calls and bytes as without accumulation
        single = matrix[0][_id((d, p, 1, kind))]["record"]
        assert rec["aggregation"] == single["aggregation"]
        assert rec["bytes_raw_total"] == single["bytes_raw_total"]
    if p == "ddp":
        # every rank applied the same averaged gradient: replicas stay identical, and
        # the record says so from the digests (what the GPU cells assert)
        for n, w in runs[0]["weights"].items():
            assert torch.equal(w, runs[1]["weights"][n]), n
        assert rec["replicas_identical"] is True
    else:
        assert rec["replicas_identical"] is None
    if kind == "none":
        if p == "ddp":  # gradzip's none: DDP's first step plain, then one all-reduce a bucket
            agg = rec["aggregation"]
            assert set(agg) == {"plain", "all_reduce"} and agg["all_reduce"] >= STEPS - 1
            assert rec["bytes_wire_total"] == rec["bytes_raw_total"]
        else:  # FSDP2 without a codec: its own reduce-scatter, counted from outside
            assert set(rec["aggregation"]) == {"torch"}
            assert rec["bytes_wire_total"] == rec["bytes_raw_total"] > 0
            assert list(rec["comm_time_ms_by_op"]) == ["reduce_scatter"]
        return
    # compressed, through the path of its kind
    assert rec["bytes_wire_total"] < rec["bytes_raw_total"]
    paths = dict(rec["aggregation"])
    if p == "ddp":
        # DDP's first step runs before its bucket rebuild: sent uncompressed (one bucket)
        assert paths.pop("plain") == 1
        expected = {"summable": "all_reduce", "gathered": "gather",
                    "multi-round": "multi_round"}[kind]
        assert set(paths) == {expected}, rec["aggregation"]
        assert paths[expected] >= STEPS - 1  # every bucket of every later step
    else:
        expected = {"summable": "reduce_scatter", "gathered": "reduce_scatter",
                    "multi-round": "multi_round"}[kind]
        assert set(paths) == {expected}, rec["aggregation"]
        ops = set(rec["comm_time_ms_by_op"])
        if kind == "summable":  # fp16 payloads are reduce-scattered as they are
            assert "reduce_scatter" in ops and "all_to_all" not in ops, ops
        elif kind == "gathered":  # top-k payloads do not sum: exchanged, decoded, summed
            assert "all_to_all" in ops and "reduce_scatter" not in ops, ops


@pytest.mark.parametrize("accum", ACCUMS, ids=lambda a: f"accum{a}")
@pytest.mark.parametrize("parallel", PARALLELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_none_is_identical_to_no_hook(matrix: list[dict[str, Any]], dtype: str, parallel: str,
                                      accum: int) -> None:
    cell = f"{dtype}-{parallel}-accum{accum}"
    # FSDP2's "no hook" run is the trainer's own `none` (it installs nothing there)
    reference = f"{cell}-nohook" if parallel == "ddp" else f"{cell}-none"
    variants = [f"{cell}-none", f"{cell}-gradzip-none"] if parallel == "ddp" else [
        f"{cell}-gradzip-none"]
    for rank, runs in enumerate(matrix):
        ref = runs[reference]
        for name in variants:
            run = runs[name]
            assert run["losses"] == ref["losses"], (rank, name)
            assert run["record"]["val_loss"] == ref["record"]["val_loss"], (rank, name)
            for n, w in ref["weights"].items():
                assert torch.equal(run["weights"][n], w), (rank, name, n)
    # the gradzip `none` run really went through gradzip (counted by its stats)
    agg = matrix[0][f"{cell}-gradzip-none"]["record"]["aggregation"]
    assert agg and set(agg) <= {"plain", "all_reduce", "reduce_scatter"}, agg


# bf16: each micro-batch's weight gradient is a bf16 matmul rounded to bf16 (rel. 2^-8)
ACCUM_TOL = {"fp32": 1e-5, "bf16": 2e-2}


@pytest.mark.parametrize("parallel", PARALLELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_accum_4_equals_one_step_on_4x_batch(matrix: list[dict[str, Any]], dtype: str,
                                                  parallel: str) -> None:
    tol = ACCUM_TOL[dtype]
    for runs in matrix:
        acc, big = runs[f"{dtype}-{parallel}-sgd-accum4"], runs[f"{dtype}-{parallel}-sgd-accum1"]
        # the step's gradient; (FSDP2's checkpoint save then calls step() once more on
        # zero gradients with lr 0, to create optimizer state: DCP's _init_optim_state)
        assert len(acc["grads"]) == len(big["grads"]) == (1 if parallel == "ddp" else 2)
        # the logged loss of the step: sum of the 4 (loss / 4) = the mean over 8 sequences
        assert acc["losses"][0] == pytest.approx(big["losses"][0], rel=tol / 10)
        ga, gb = acc["grads"][0], big["grads"][0]
        flat_a = torch.cat([ga[n].flatten() for n in gb])
        flat_b = torch.cat([gb[n].flatten() for n in gb])
        assert _rel(flat_a, flat_b) < tol
        for n in gb:  # each tensor, not only the whole
            assert _rel(ga[n], gb[n]) < 3 * tol, n
        # the weights after the step (SGD, lr 1): initial - gradient in both runs, so
        # they differ by the gradients' difference, plus fp32 rounding of the weights
        for n, w in big["weights"].items():
            assert torch.equal(acc["initial"][n], big["initial"][n]), n
            assert torch.allclose(w, big["initial"][n] - gb[n], rtol=1e-6, atol=0), n
            assert torch.allclose(acc["weights"][n], acc["initial"][n] - ga[n],
                                  rtol=1e-6, atol=0), n
            rounding = 2 * torch.finfo(torch.float32).eps * float(w.norm())
            assert float((acc["weights"][n] - w).norm()) <= (
                3 * tol * float(gb[n].norm()) + rounding), n


def test_fsdp2_refuses_powersgd_with_a_clear_error(matrix: list[dict[str, Any]]) -> None:
    for runs in matrix:
        msg = runs["fsdp-powersgd"]["error"]
        assert "powersgd" in msg and "compresses gradient matrices" in msg
        assert "DDP" in msg and "flat" in msg


@pytest.mark.parametrize("dtype", DTYPES)
def test_fsdp2_multi_round_counts_each_reduce_scatter_once(matrix: list[dict[str, Any]],
                                                           dtype: str) -> None:
    for a in ACCUMS:
        cell = f"{dtype}-fsdp-accum{a}"
        # the summable codec on the same units: one reduce-scatter per unit per step
        assert matrix[0][f"{cell}-summable"]["record"]["aggregation"] == {
            "reduce_scatter": FSDP_UNITS * STEPS}
        assert matrix[0][f"{cell}-multi-round"]["record"]["aggregation"] == {
            "multi_round": FSDP_UNITS * STEPS}


# ---------------------------------------------------------------- CUDA-only cells
def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("accum", ACCUMS, ids=lambda a: f"accum{a}")
@pytest.mark.parametrize("parallel", PARALLELS)
def test_fp16_gradscaler_cell(parallel: str, accum: int, kind: str,
                              tmp_path: Path) -> None:
    """fp16 autocast with the trainer's GradScaler (dynamic loss scaling: the scaled
    gradients pass through the codec, are unscaled before clipping, and a step with
    inf/nan gradients is skipped): the trainer refuses --dtype fp16 on CPU, so these
    cells need 2 CUDA devices (2 NCCL ranks under torchrun)."""
    if not _two_gpus():
        pytest.skip("needs CUDA: --dtype fp16 runs only with the GradScaler on CUDA "
                    "(refused on CPU), and 2 devices for 2 NCCL ranks")
    from train_helpers import flags, last_result, launch

    codec = "none" if kind == "none" else CODECS[kind][parallel]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    cmd = [*launch(2), "-m", "gradzip", "train",
           *flags(tmp_path / "cache", out, "--device", "cuda", "--dtype", "fp16",
                  "--parallel", parallel, "--grad-accum", str(accum), "--codec", codec,
                  "--max-steps", "5", "--eval-every", "0")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    rec = last_result(out)
    assert rec["world_size"] == 2 and rec["dtype"] == "fp16" and rec["grad_accum"] == accum
    assert math.isfinite(rec["train_loss"]) and math.isfinite(rec["val_loss"])
    # every rank applied the same mean gradient: DDP replicas end bit-identical (a codec
    # or a stream race that let ranks drift would pass the checks above)
    assert rec["replicas_identical"] is (True if parallel == "ddp" else None)
    if kind != "none":
        assert rec["bytes_wire_total"] < rec["bytes_raw_total"]
