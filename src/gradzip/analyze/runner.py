"""Running an analysis: buckets in worker processes, rows appended as they finish.

Buckets of one step (every captured rank of it) form one task, so the what-if runs each
codec's real N-rank protocol on them. The what-if costs several times the other columns
together (six codecs' real encode, reduce and decode per step), and its answer changes
slowly over training, so by default it runs on a few steps spread evenly over the source
(``Options.whatif_steps``; ``None``: every step). Tasks go to ``workers`` processes; each reads its
bucket in slices of ``slice_elems`` values (memory stays bounded whatever the bucket
size). Finished rows are appended to ``OUT/buckets.csv`` (``--per-param``: also
``OUT/params.csv``) and flushed at once, so an interrupted run resumes where it stopped:
buckets already in the file are skipped (a torn last line is dropped). A bucket that
fails is listed in ``OUT/errors.csv`` and skipped, never fatal. At the end the CSV files
are also written as Parquet when ``pyarrow`` is installed.
"""

from __future__ import annotations

import csv
import math
import os
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gradzip.analyze.sources import BucketRef, find_buckets

BUCKETS_CSV, PARAMS_CSV, ERRORS_CSV = "buckets.csv", "params.csv", "errors.csv"


@dataclass(frozen=True)
class Options:
    """What to measure."""

    per_param: bool = False
    codecs: tuple[str, ...] = ()
    #: steps that get the what-if, evenly spread over the source's (None: every step)
    whatif_steps: int | None = None
    slice_elems: int = 1 << 22


@dataclass
class Outcome:
    """What a run did: rows written, buckets skipped as done, failures (key -> why)."""

    analyzed: int = 0
    resumed: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    #: seconds spent compiling (or loading from numba's cache) the kernels, up front
    compile_s: float = 0.0


def _groups(refs: list[BucketRef]) -> list[list[BucketRef]]:
    """Buckets of one (epoch, step, bucket) across ranks together; others alone."""
    groups: dict[Any, list[BucketRef]] = {}
    for ref in refs:
        key = ref.path if ref.step is None else (ref.epoch, ref.step, ref.bucket)
        groups.setdefault(key, []).append(ref)
    return list(groups.values())


def _step_key(group: list[BucketRef]) -> Any:
    ref = group[0]
    return ref.path if ref.step is None else (ref.epoch, ref.step)


def whatif_groups(groups: list[list[BucketRef]], steps: int | None) -> set[int]:
    """Indices of the groups whose step is among ``steps`` evenly spread over the
    source's steps, first and last included (every group when ``steps`` is None)."""
    keys = sorted({_step_key(g) for g in groups}, key=lambda k: (isinstance(k, str), k))
    if steps is None or steps >= len(keys):
        chosen = set(keys)
    elif steps <= 0:
        chosen = set()
    elif steps == 1:
        chosen = {keys[-1]}
    else:
        chosen = {keys[round(i * (len(keys) - 1) / (steps - 1))] for i in range(steps)}
    return {i for i, g in enumerate(groups) if _step_key(g) in chosen}


def analyze_group(group: list[BucketRef], options: Options
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows of each bucket of the group (and of each parameter with ``per_param``)."""
    import numpy as np
    import torch

    from gradzip.analyze.measures import analyze_values
    from gradzip.analyze.sources import as_float32, load
    from gradzip.analyze.whatif import codec_costs

    rows, params = [], []
    loaded = [load(ref) for ref in group]
    for ref, data in zip(group, loaded, strict=True):
        row = {**_where(ref), "tensors": len(data.params),
               **analyze_values(data.values, data.dtype, options.slice_elems)}
        rows.append(row)
        if options.per_param:
            for name, shape, offset in data.params:
                n = int(np.prod(shape, dtype=np.int64))
                part = data.values[offset:offset + n]
                params.append({**_where(ref), "name": name, "shape": "x".join(map(str, shape)),
                               **analyze_values(part, data.dtype, options.slice_elems)})
    if options.codecs:
        xs = [torch.from_numpy(as_float32(np.asarray(d.values), d.dtype).copy())
              for d in loaded]
        shapes = [torch.Size(s) for _, s, _ in loaded[0].params]
        itemsize = 2 if loaded[0].dtype in ("float16", "bfloat16") else 4
        for row, extra in zip(rows, codec_costs(xs, shapes, list(options.codecs), itemsize),
                              strict=True):
            row.update(extra)
    return rows, params


def _where(ref: BucketRef) -> dict[str, Any]:
    return {"key": ref.key, "source": ref.path, "rank": ref.rank, "epoch": ref.epoch,
            "step": ref.step, "bucket": ref.bucket}


def _done_keys(path: Path) -> set[str]:
    """Keys of complete rows already in ``path``; a torn last line is dropped."""
    if not path.is_file():
        return set()
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return set()
    header, body = rows[0], rows[1:]
    good = [r for r in body if len(r) == len(header)]
    if len(good) != len(body):  # rewrite without the torn line (write, then rename)
        _write_rows(path, header, good)
    return {r[header.index("key")] for r in good}


def _write_rows(path: Path, header: list[str], rows: list[list[str]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    tmp.replace(path)


class _Appender:
    """Rows appended to a CSV file and flushed one by one (the header from the first)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header: list[str] | None = None
        if path.is_file() and path.stat().st_size:
            with open(path, newline="") as f:
                self.header = next(csv.reader(f))

    def add(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        if self.header is None:
            self.header = list(rows[0])
            _write_rows(self.path, self.header, [])
        new = list(dict.fromkeys(k for row in rows for k in row if k not in self.header))
        if new:  # columns first seen now (a what-if step after plain ones): widen the file
            with open(self.path, newline="") as f:
                body = list(csv.reader(f))[1:]
            self.header += new
            _write_rows(self.path, self.header, [r + [""] * len(new) for r in body])
        with open(self.path, "a", newline="") as f:
            writer = csv.writer(f)
            for row in rows:
                writer.writerow([_cell(row.get(c)) for c in self.header])
            f.flush()
            os.fsync(f.fileno())


def _cell(v: Any) -> str:
    """A CSV cell: empty for missing; floats (numpy's too) as their shortest exact repr."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return repr(float(v)) if isinstance(v, float) else str(v)


def run_analysis(source: str | os.PathLike[str], out: str | os.PathLike[str], *,
                 workers: int = 1, options: Options = Options(),
                 on_bucket: Callable[[int, int], None] | None = None) -> Outcome:
    """Analyze every bucket of ``source`` not yet in ``OUT/buckets.csv``."""
    out_dir = Path(out)
    refs = find_buckets(source)  # a missing or empty source fails before OUT is made
    out_dir.mkdir(parents=True, exist_ok=True)
    done = _done_keys(out_dir / BUCKETS_CSV)
    if options.per_param:
        done &= _done_keys(out_dir / PARAMS_CSV)
    groups = _groups(refs)
    sampled = whatif_groups(groups, options.whatif_steps)
    plain = replace(options, codecs=())
    todo = [(g, options if i in sampled else plain) for i, g in enumerate(groups)
            if not all(r.key in done for r in g)]
    outcome = Outcome(resumed=len(refs) - sum(len(g) for g, _ in todo))
    buckets, params = _Appender(out_dir / BUCKETS_CSV), _Appender(out_dir / PARAMS_CSV)
    errors = _Appender(out_dir / ERRORS_CSV)
    total = len(refs)
    if todo:
        outcome.compile_s = warm_up(options)
    if on_bucket is not None:
        on_bucket(outcome.resumed, total)

    def finished(group: list[BucketRef], result: Any, error: str | None) -> None:
        if error is None:
            rows, prows = result
            buckets.add([r for r in rows if r["key"] not in done])
            params.add(prows)
            outcome.analyzed += len(rows)
        else:
            for ref in group:
                outcome.failed[ref.key] = error
            errors.add([{"key": r.key, "source": r.path, "error": error} for r in group])
        if on_bucket is not None:
            on_bucket(len(group), total)

    if workers <= 1:
        for group, opts in todo:
            try:
                finished(group, analyze_group(group, opts), None)
            except Exception as e:  # noqa: BLE001 - reported and skipped
                finished(group, None, _why(e))
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                                 max_tasks_per_child=64) as pool:
            futures = {pool.submit(analyze_group, g, opts): g for g, opts in todo}
            for fut in as_completed(futures):
                try:
                    finished(futures[fut], fut.result(), None)
                except Exception as e:  # noqa: BLE001 - a worker's failure, reported
                    finished(futures[fut], None, _why(e))
    _write_parquet(out_dir)
    return outcome


def warm_up(options: Options) -> float:
    """Compile every kernel the workers will run, here, once (seconds it took): numba
    caches compiled kernels on disk, so the workers then load them instead of each
    compiling the same ones at the same time (~47 s on 2 cores from a cold cache)."""
    import time

    import numpy as np

    from gradzip.analyze.measures import analyze_values
    from gradzip.analyze.whatif import codec_costs

    start = time.perf_counter()
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 1e-3
    bf16_bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    for dtype, values in (("float32", x), ("float16", x.astype(np.float16)),
                          ("bfloat16", bf16_bits)):
        analyze_values(values, dtype, 1024)
    if options.codecs:
        import torch

        xs = [torch.from_numpy(x.copy()), torch.from_numpy(x[::-1].copy())]
        codec_costs(xs, [torch.Size([x.size])], list(options.codecs), 4)
    return time.perf_counter() - start


def _why(e: BaseException) -> str:
    last = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    where = f" ({Path(last[0].filename).name}:{last[0].lineno})" if last else ""
    return f"{type(e).__name__}: {e}{where}"


def _write_parquet(out_dir: Path) -> None:
    """Parquet copies of the CSV files, when pyarrow is installed."""
    try:
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq
    except ImportError:
        return
    for name in (BUCKETS_CSV, PARAMS_CSV):
        path = out_dir / name
        if path.is_file() and path.stat().st_size:
            tmp = path.with_suffix(".parquet.tmp")
            pq.write_table(pacsv.read_csv(path), tmp)
            tmp.replace(path.with_suffix(".parquet"))
