"""``gradzip bench aggregate``: link bytes and error of the mean over W ranks, per path.

Every codec's reduction runs for real over W simulated ranks (``run_simulated``: one
thread per rank, each with its own codec and ``Communicator``; real codec code, real
payload sizes), no ``torch.distributed``. Each rank holds a different gradient.

**Steady state.** Each measurement is ``--warmup`` reductions (default 2) followed by
the measured one, all with the same codec instance per rank (one ``run_simulated``
worker runs every step), each step on the ranks' next successive gradients: error
feedback carries a residual, PowerSGD a warm-started Q, GradiVeQ a fitted basis
(its refresh step is a warm-up) into the measured reduction. Bytes and error come
from the measured reduction only. Multi-round codecs reduce each tensor of the
bucket on its own (key ``grad/p{j}``), as the DDP hook does (``reduce_each``):
PowerSGD compresses matrices, and a flat bucket has none.

**Bytes.** For each world size W (``--worlds``, default 2, 4, 8, 16, 64) and each
codec, one measured reduction is run per aggregation path and the bytes each rank
puts on its link are read from its ``Communicator`` counter (``counter.total_wire``:
the link byte model of every collective, size exchanges and padding included; the
largest over ranks is reported). Payload sizes do not depend on timing, so one
reduction is the measurement. Paths: summable codecs (casts, random-k) all-reduce their payload,
and are also run with ``| aggregate=two_phase`` (fp32 sum at the chunk owner);
non-summable single-round codecs run both ``| aggregate=gather`` (every rank's
payload all-gathered: (W-1) x payload per rank) and ``| aggregate=two_phase``
(compressed chunks to their owners, fp32 sum, compressed all-gather: about 2(W-1)/W x
payload); multi-round codecs (PowerSGD, sketch, ...) run their own protocol. For each
codec the table also says which path ``aggregate=auto`` picks (``gradzip.aggregation.path_for``,
from the link byte model). Bytes are given as a ratio against PyTorch's uncompressed
ring all-reduce of the same gradient, 2(W-1)/W x 4n bytes for fp32 and x 2n for
fp16 (higher is better; 1.0 = the same traffic).

**Crossover.** The W at which a codec (its ``auto`` path, and its plain gather)
stops beating an fp16 ring all-reduce: the first W of the sweep whose bytes are >=
fp16's, with a log2(W)-interpolated estimate between the two sweep points around it.

**Error of the mean.** For W in ``--error-worlds`` (default 2, 4, 8, 16) and
``--seeds`` inputs, the relative L2 error of the mean a rank gets back against the
exact fp64 mean of the ranks' inputs, median over seeds, for every path (fp16/bf16:
the all-reduce sums in 16 bits, ``two_phase`` sums in fp32 at the owner), after the
warm-up reductions (with error feedback, the mean a rank gets back includes the
residuals carried from them; the exact mean is of the measured step's inputs).

**Input.** ``--input real`` (default): in reduction i (warm-ups i = 0 .. warmup - 1,
then the measured one) rank r holds the flat gradient (one DDP bucket, 875,264 values
in 52 tensors, whose shapes are passed to the codec) of SGD step 3 + r + i of the
small transformer LM of ``gradzip.bench.samples``, trained on standard-library
text; the seed sets the model's initialisation. ``--input synthetic``: heavy-tailed
values (Gaussian x log-normal, ``--numel``, default 1M, shaped as one square-ish
matrix), draw r + i, all draws with the same per-coordinate scales. To keep the run
to minutes (W threads each encode and decode in one process; a gather decodes W
payloads on each of W ranks), a rank holds at most
``--max-total`` / W values (default 16M / W: 262,144 at W = 64, the leading values
of the gradient); the ``numel`` of every result says what was used.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from gradzip.aggregation import path_for, reduce

WORLDS = (2, 4, 8, 16, 64)
ERROR_WORLDS = (2, 4, 8, 16)
EXTRA_SPECS = ("ef | topk(ratio=0.01)", "topk(ratio=0.01) | qsgd | eg")
#: the baselines bytes are compared with: PyTorch's ring all-reduce in fp32 and fp16
BASELINES = {"fp32": 4, "fp16": 2}
PATH_ABBREV = {"all_reduce": "AR", "gather": "G", "two_phase": "2P", "multi_round": "MR"}


@dataclass
class Run:
    """One reduction of ``spec`` over ``world`` simulated ranks."""

    spec: str
    path: str  # all_reduce, gather, two_phase or multi_round
    world: int
    seed: int
    numel: int  # values each rank holds
    wire_bytes: int  # largest over ranks of the bytes a rank put on its link
    wire_bytes_mean: float  # mean over ranks
    wire_by_op: dict[str, int]  # rank 0's link bytes per collective
    ratio_fp32: float  # fp32 ring all-reduce bytes / wire_bytes
    ratio_fp16: float  # fp16 ring all-reduce bytes / wire_bytes
    rel_l2_error: float  # of rank 0's mean vs the exact fp64 mean of the ranks' inputs
    #: the error a rank raised (the codec failed on this input); the figures are NaN
    failed: str | None = None


@dataclass
class CodecSummary:
    """Per codec: what ``auto`` picks at each W and where it stops beating fp16."""

    spec: str
    paths: list[str]
    auto: dict[int, str] = field(default_factory=dict)
    #: first W of the sweep whose bytes >= an fp16 ring all-reduce's (None: never)
    auto_stops_at: int | None = None
    auto_stops_at_est: float | None = None
    gather_stops_at: int | None = None
    gather_stops_at_est: float | None = None


def default_specs() -> list[str]:
    """Every registered compressor's default spec, every lossless coder after qsgd,
    and two chains (error-feedback top-k, top-k + qsgd + Exp-Golomb)."""
    from gradzip.codecs import Compressor, LosslessCoder, registered

    stages = registered()
    specs = [n for n, c in stages.items() if issubclass(c, Compressor)]
    specs += [f"qsgd | {n}" for n, c in stages.items() if issubclass(c, LosslessCoder)]
    return specs + list(EXTRA_SPECS)


def paths_of(spec: str) -> list[str]:
    """The aggregation paths measured for ``spec`` (see the module docstring)."""
    import gradzip

    codec = gradzip.codec(spec)
    if codec.multi_round:
        return ["multi_round"]
    if codec.summable:
        return ["all_reduce", "two_phase"]
    return ["gather", "two_phase"]


def per_rank_numel(numel: int, world: int, max_total: int) -> int:
    """Values each rank holds at ``world``: ``numel``, capped at ``max_total // world``."""
    return max(1, min(numel, max_total // world))


# ---------------------------------------------------------------- inputs
class Inputs:
    """The ranks' gradients for one seed: ``count`` different flat tensors + shapes."""

    def __init__(self, kind: str, numel: int, count: int, seed: int) -> None:
        from gradzip.bench.samples import heavy_tailed_steps, real_gradient_steps

        if kind == "real":
            steps = real_gradient_steps(seed=seed, count=count)
            self.shapes = [g.shape for g in steps[0].values()]
            self.tensors = [torch.cat([g.reshape(-1) for g in s.values()]) for s in steps]
            self.numel = min(numel, self.tensors[0].numel())
        elif kind == "synthetic":
            self.tensors = heavy_tailed_steps(numel, count, seed)
            self.shapes = [torch.Size(_square_shape(numel))]
            self.numel = numel
        else:
            raise ValueError(f"input must be real or synthetic, got {kind!r}")
        self.kind, self.seed = kind, seed

    def for_world(self, world: int, numel: int, step: int = 0
                  ) -> tuple[list[torch.Tensor], list[torch.Size]]:
        """The ``world`` ranks' gradients of reduction ``step`` (rank r: gradient
        r + step), each cut to its first ``numel`` values, and the tensor shapes inside
        that cut."""
        from gradzip.aggregation.layout import piece_shapes

        if world + step > len(self.tensors):
            raise ValueError(f"{world} ranks at reduction {step} need {world + step} "
                             f"gradients, have {len(self.tensors)}")
        numel = min(numel, self.numel)
        xs = [t[:numel] for t in self.tensors[step:step + world]]
        if self.kind == "synthetic":
            return xs, [torch.Size(_square_shape(numel))]
        shapes = piece_shapes(self.shapes, 0, numel)
        assert shapes is not None
        return xs, shapes


def _square_shape(numel: int) -> tuple[int, ...]:
    rows = 2 ** int(math.log2(math.isqrt(numel))) if numel >= 4 else 1
    return (rows, numel // rows) if numel % rows == 0 else (numel,)


# ---------------------------------------------------------------- measuring
def reduce_once(spec: str, path: str, xs: list[torch.Tensor], shapes: list[torch.Size] | None,
                seed: int = 0, warmup: list[list[torch.Tensor]] | None = None) -> Run:
    """Reduce ``xs[r]`` on rank r through ``spec`` forced onto ``path`` (``all_reduce``
    and ``multi_round`` are the codec's own); bytes and error of this one reduction.

    ``warmup``: earlier reductions (each a list of the ranks' inputs, same sizes and
    ``shapes``) run first with the same codec instances, unmeasured, so that codec
    state (residuals, warm starts, fitted bases) is in steady state.
    """
    import gradzip
    from gradzip.collectives import run_simulated
    from gradzip.collectives.linkmodel import link_bytes

    world, numel = len(xs), xs[0].numel()
    steps = [*(warmup or []), xs]
    if any(len(s) != world or any(t.numel() != numel for t in s) for s in steps):
        raise ValueError(f"every warm-up reduction needs {world} inputs of {numel} values")
    forced = {"aggregate": path} if path in ("gather", "two_phase") else {}
    codecs = [gradzip.codec(spec, rank=r, **forced) for r in range(world)]

    def work(rank: int, comm: Any) -> tuple[torch.Tensor | None, int, dict[str, int]]:
        codec = codecs[rank]  # one instance for every step: its state carries over
        got = path_for(codec, xs[rank], world, shapes)
        if got != path:
            raise RuntimeError(f"{spec}: expected path {path}, the codec takes {got}")
        mean = xs[rank]
        for step in steps:
            comm.counter.reset()  # bytes of the last (measured) reduction only
            mean = _reduce(codec, step[rank], comm, shapes)
        return (mean if rank == 0 else None), comm.counter.total_wire, dict(comm.counter.wire)

    try:
        out = run_simulated(world, work)
    except Exception as e:  # a codec bug must not hide the other codecs' figures
        nan = math.nan
        return Run(spec=str(codecs[0]), path=path, world=world, seed=seed, numel=numel,
                   wire_bytes=0, wire_bytes_mean=nan, wire_by_op={}, ratio_fp32=nan,
                   ratio_fp16=nan, rel_l2_error=nan, failed=f"{type(e).__name__}: {e}")
    mean = out[0][0]
    assert mean is not None
    truth = torch.stack([x.double() for x in xs]).mean(0)
    err = float((mean.double() - truth).norm() / truth.norm()) if truth.norm() > 0 else 0.0
    wires = [w for _, w, _ in out]
    wire = max(wires)
    raw = {name: link_bytes("all_reduce", size * numel, world) for name, size in BASELINES.items()}
    return Run(spec=str(codecs[0]), path=path, world=world, seed=seed, numel=numel,
               wire_bytes=wire, wire_bytes_mean=statistics.fmean(wires), wire_by_op=out[0][2],
               ratio_fp32=raw["fp32"] / wire if wire else math.inf,
               ratio_fp16=raw["fp16"] / wire if wire else math.inf,
               rel_l2_error=err)


def _reduce(codec: Any, x: torch.Tensor, comm: Any, shapes: list[torch.Size] | None
            ) -> torch.Tensor:
    """One reduction of ``x`` as the DDP hook does it: multi-round codecs get each
    tensor of the bucket in its own shape (``Reducer.reduce_each``), others the flat
    bucket with its ``shapes``."""
    if not codec.multi_round or shapes is None:
        return reduce(codec, x, "grad", comm, shapes=shapes)[0]
    out, offset = torch.empty_like(x), 0
    for j, shape in enumerate(shapes):
        n = shape.numel()
        part = x[offset:offset + n].view(shape)
        out[offset:offset + n] = reduce(codec, part, f"grad/p{j}", comm)[0].reshape(-1)
        offset += n
    return out


def auto_path(spec: str, x: torch.Tensor, world: int, shapes: list[torch.Size] | None) -> str:
    """The path ``aggregate=auto`` takes for ``x`` over ``world`` ranks."""
    import gradzip
    from gradzip.aggregation import path_for

    return path_for(gradzip.codec(spec), x, world, shapes)


def crossover(points: list[tuple[int, float]]) -> tuple[int | None, float | None]:
    """First W whose ratio vs fp16 is <= 1 (bytes >= fp16's), and W where the ratio
    crosses 1 interpolated linearly in log2 W; (None, None) if it never does."""
    points = sorted(points)
    for i, (w, r) in enumerate(points):
        if r <= 1.0:
            if i == 0:
                return w, float(w)
            w0, r0 = points[i - 1]
            t = (r0 - 1.0) / (r0 - r) if r0 != r else 1.0
            return w, 2 ** (math.log2(w0) + t * (math.log2(w) - math.log2(w0)))
    return None, None


def summarize(specs: list[str], runs: list[Run], autos: dict[tuple[str, int], str]
              ) -> list[CodecSummary]:
    """Per codec: ``auto``'s path at each W and the fp16 crossovers (seed-0 runs)."""
    out = []
    for spec in specs:
        mine = [r for r in runs if r.seed == 0 and _base(r.spec) == _base_of(spec)
                and r.failed is None]
        s = CodecSummary(spec=_base_of(spec), paths=paths_of(spec))
        worlds = sorted({r.world for r in mine})
        s.auto = {w: autos[(spec, w)] for w in worlds if (spec, w) in autos}
        auto_pts = [(r.world, r.ratio_fp16) for r in mine if s.auto.get(r.world) == r.path]
        s.auto_stops_at, s.auto_stops_at_est = crossover(auto_pts)
        gather_pts = [(r.world, r.ratio_fp16) for r in mine if r.path == "gather"]
        if gather_pts:
            s.gather_stops_at, s.gather_stops_at_est = crossover(gather_pts)
        out.append(s)
    return out


def _base_of(spec: str) -> str:
    """The canonical spec without an ``aggregate=`` option."""
    import gradzip

    return str(gradzip.codec(spec, aggregate="auto"))


def _base(canonical: str) -> str:
    return canonical.split(" | aggregate=")[0]


def median_errors(runs: list[Run], worlds: list[int]) -> dict[tuple[str, str, int], float]:
    """(codec, path, W) -> median over seeds of the relative L2 error of the mean."""
    groups: dict[tuple[str, str, int], list[float]] = {}
    for r in runs:
        if r.world in worlds and r.failed is None:
            groups.setdefault((_base(r.spec), r.path, r.world), []).append(r.rel_l2_error)
    return {k: statistics.median(v) for k, v in groups.items()}


# ---------------------------------------------------------------- command
def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    worlds = _ints(args.worlds, "--worlds")
    error_worlds = _ints(args.error_worlds, "--error-worlds")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    specs = [s.strip() for s in args.codecs.split(";") if s.strip()] if args.codecs \
        else default_specs()
    paths = {spec: paths_of(spec) for spec in specs}  # also: every spec parses, early
    from gradzip.bench.codecs import parse_size

    numel, max_total = parse_size(args.numel), parse_size(args.max_total)
    jobs: list[tuple[int, int, str, str]] = []  # (seed, W, spec, path)
    for seed in range(args.seeds):
        ws = sorted(set(worlds) | set(error_worlds)) if seed == 0 else error_worlds
        jobs += [(seed, w, spec, p) for w in ws for spec in specs for p in paths[spec]]
    runs: list[Run] = []
    autos: dict[tuple[str, int], str] = {}
    inputs: Inputs | None = None
    bar = tqdm(jobs, desc="reductions", unit="run", disable=args.quiet)
    for seed, w, spec, path in bar:
        if inputs is None or inputs.seed != seed:
            bar.set_postfix_str(f"input seed {seed}")
            count = max(worlds + error_worlds) if seed == 0 else max(error_worlds)
            inputs = Inputs(args.input, numel, count + args.warmup, seed)
        bar.set_postfix_str(f"W={w} {spec} [{path}]")
        n = per_rank_numel(numel, w, max_total)
        warm = [inputs.for_world(w, n, step=i)[0] for i in range(args.warmup)]
        xs, shapes = inputs.for_world(w, n, step=args.warmup)
        if seed == 0 and (spec, w) not in autos:
            autos[(spec, w)] = auto_path(spec, xs[0], w, shapes)
        runs.append(reduce_once(spec, path, xs, shapes, seed, warmup=warm))
    summaries = summarize(specs, runs, autos)
    errors = median_errors(runs, error_worlds)
    _print_tables(runs, summaries, errors, worlds, error_worlds, args)
    for r in runs:
        if r.failed:
            print(f"FAILED: {r.spec} at W={r.world}, seed {r.seed}, {r.numel:,} values "
                  f"per rank: {r.failed}")
    if args.markdown:
        Path(args.markdown).write_text(markdown(runs, summaries, errors, worlds, error_worlds))
        print(f"wrote {args.markdown}")
    if args.json:
        record = {
            "machine": _machine(), "input": args.input, "numel": numel,
            "max_total": max_total, "worlds": worlds, "error_worlds": error_worlds,
            "seeds": args.seeds, "warmup": args.warmup, "threads": args.threads,
            "runs": [asdict(r) for r in runs],
            "summary": [asdict(s) for s in summaries],
            "error_median": [{"codec": c, "path": p, "world": w, "rel_l2_error": e}
                             for (c, p, w), e in sorted(errors.items())],
        }
        path_out = Path(args.json)
        path_out.parent.mkdir(parents=True, exist_ok=True)
        path_out.write_text(json.dumps(record, indent=2))
        print(f"wrote {path_out}")
    return 0


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or values[0] < 2:
        raise ValueError(f"{flag} needs world sizes >= 2, got {text!r}")
    return values


def _machine() -> dict[str, Any]:
    from gradzip.bench.codecs import machine

    return machine()


# ---------------------------------------------------------------- tables
def _ratio(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.2f}x" if x < 10 else f"{x:.1f}x"


def _stops(at: int | None, est: float | None, first: int) -> str:
    if at is None:
        return "never (beats fp16 at all W)"
    if at == first:
        return f"never beats fp16 (W={first})"
    assert est is not None
    return f"W={at} (~{est:.0f})"


def table_rows(runs: list[Run], summaries: list[CodecSummary], errors: dict[Any, float],
               worlds: list[int], error_worlds: list[int]
               ) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
    """Rows of the bytes, crossover and error tables (plain strings)."""
    byw = {(_base(r.spec), r.path, r.world): r for r in runs if r.seed == 0}
    bytes_rows, cross_rows, err_rows = [], [], []
    for s in summaries:
        for path in s.paths:
            cells = []
            for w in worlds:
                r = byw.get((s.spec, path, w))
                mark = "*" if s.auto.get(w) == path and len(s.paths) > 1 else ""
                cells.append("-" if r is None else "FAILED" if r.failed else
                             f"{_ratio(r.ratio_fp32)} / {_ratio(r.ratio_fp16)}{mark}")
            bytes_rows.append([s.spec, path, *cells])
            errs = [errors.get((s.spec, path, w)) for w in error_worlds]
            err_rows.append([s.spec, path, *("-" if e is None else f"{e:.3g}" for e in errs)])
        auto = " ".join(PATH_ABBREV[s.auto[w]] for w in worlds if w in s.auto)
        last = byw.get((s.spec, s.auto.get(worlds[-1], ""), worlds[-1]))
        cross_rows.append([
            s.spec, auto,
            "-" if last is None else "FAILED" if last.failed else f"{last.wire_bytes / 1e6:.3g}",
            _stops(s.auto_stops_at, s.auto_stops_at_est, worlds[0]),
            "-" if "gather" not in s.paths
            else _stops(s.gather_stops_at, s.gather_stops_at_est, worlds[0]),
        ])
    return bytes_rows, cross_rows, err_rows


def headers(worlds: list[int], error_worlds: list[int]) -> tuple[list[str], ...]:
    return (["codec", "path", *(f"W={w}" for w in worlds)],
            ["codec", "auto path per W", f"MB/rank at W={worlds[-1]} (auto)",
             "auto stops beating fp16", "gather alone stops"],
            ["codec", "path", *(f"W={w}" for w in error_worlds)])


def _numel_note(runs: list[Run]) -> str:
    sizes = sorted({(r.world, r.numel) for r in runs if r.seed == 0})
    return ", ".join(f"W={w}: {n:,}" for w, n in sizes)


def _print_tables(runs: list[Run], summaries: list[CodecSummary], errors: dict[Any, float],
                  worlds: list[int], error_worlds: list[int], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    rows = table_rows(runs, summaries, errors, worlds, error_worlds)
    hdrs = headers(worlds, error_worlds)
    titles = [
        "link bytes per rank per reduction: ratio vs fp32 ring all-reduce / vs fp16 "
        "(higher is better; * = the path aggregate=auto takes)",
        "aggregate=auto and the W where bytes reach an fp16 ring all-reduce's",
        f"relative L2 error of the mean vs the exact fp64 mean (median of {args.seeds} seeds)",
    ]
    caption = (f"input: {args.input}; values per rank: {_numel_note(runs)}; simulated ranks, "
               "link bytes from the ring/all-to-all link model; AR all_reduce, G gather, "
               "2P two_phase, MR multi_round")
    for i, (title, hdr, body) in enumerate(zip(titles, hdrs, rows, strict=True)):
        table = Table(title=title, caption=caption if i == len(titles) - 1 else None)
        for h in hdr:
            table.add_column(h, justify="left" if h in ("codec", "path") else "right")
        for row in body:
            table.add_row(*row)
        console.print(table)


def markdown(runs: list[Run], summaries: list[CodecSummary], errors: dict[Any, float],
             worlds: list[int], error_worlds: list[int]) -> str:
    """The three tables as Markdown (for docs/benchmarks/aggregate.md)."""
    out = []
    for hdr, body in zip(headers(worlds, error_worlds),
                         table_rows(runs, summaries, errors, worlds, error_worlds), strict=True):
        lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "aggregate", help="link bytes and error of the mean over W simulated ranks, "
                          "gather vs two-phase, for every codec",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)),
                   help="world sizes of the bytes sweep (default 2,4,8,16,64)")
    p.add_argument("--error-worlds", default=",".join(map(str, ERROR_WORLDS)),
                   help="world sizes of the error-of-the-mean sweep (default 2,4,8,16)")
    p.add_argument("--codecs", metavar="SPECS",
                   help="semicolon-separated codec specs (default: every compressor, "
                        "'qsgd | X' for every lossless coder X, "
                        + ", ".join(f"'{s}'" for s in EXTRA_SPECS) + ")")
    p.add_argument("--input", choices=("real", "synthetic"), default="real",
                   help="real: successive flat gradients of the small LM, one per rank "
                        "(875,264 values); synthetic: heavy-tailed, --numel values")
    p.add_argument("--numel", default="1M",
                   help="values per rank (synthetic; real: at most the LM's 875,264)")
    p.add_argument("--max-total", default="16M",
                   help="at most this many values over all ranks: a rank holds "
                        "min(numel, max_total / W) (default 16M)")
    p.add_argument("--seeds", type=int, default=3,
                   help="inputs (model initialisations) for the error sweep; medians "
                        "are reported (default 3; bytes come from seed 0)")
    p.add_argument("--warmup", type=int, default=2,
                   help="unmeasured reductions (on the preceding gradients, same codec "
                        "instances) before each measured one, so stateful codecs are "
                        "measured in steady state (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", metavar="FILE", help="write every run and the summaries here")
    p.add_argument("--markdown", metavar="FILE", help="write the tables as Markdown here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
