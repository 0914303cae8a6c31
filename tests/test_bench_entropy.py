"""``gradzip bench entropy`` helpers on tiny inputs: sizes, inputs, Huffman sizing, bars.

Timings are measured by the benchmark but never asserted here.
"""

import heapq

import pytest
import torch

from gradzip.bench import entropy as bench
from gradzip.bench import samples
from gradzip.codecs.entropy import measures


def test_parse_size():
    assert bench.parse_size("4M") == 4 * 2**20
    assert bench.parse_size("64k") == 64 * 2**10
    assert bench.parse_size("4096") == 4096
    assert bench.parse_size("0.5k") == 512
    for bad in ("", "x", "0", "-3M"):
        with pytest.raises(ValueError):
            bench.parse_size(bad)


@pytest.mark.parametrize("kind", ["gaussian", "laplace", "gengauss0.5"])
def test_synthetic_inputs_are_int8_symbols(kind):
    t = bench.synthetic(kind, 5000, seed=0)
    assert t.dtype == torch.int8 and t.numel() == 5000
    assert int(t.abs().max()) == 127  # max-abs scaling uses the full range
    assert torch.equal(t, bench.synthetic(kind, 5000, seed=0))
    with pytest.raises(ValueError):
        bench.synthetic("cauchy", 10, 0)


def _reference_huffman_bits(counts):
    """Total bits of an optimal prefix code, by the textbook merge of the two rarest."""
    if len(counts) < 2:
        return 0
    heap = [int(c) for c in counts]
    heapq.heapify(heap)
    total = 0
    while len(heap) > 1:
        merged = heapq.heappop(heap) + heapq.heappop(heap)
        total += merged  # every symbol below the merge gets one bit longer
        heapq.heappush(heap, merged)
    return total


def test_huffman_size_is_an_optimal_prefix_code_plus_its_table():
    t = bench.synthetic("laplace", 20_000, seed=1)
    values, counts = measures.histogram(t)
    span = int(values[-1] - values[0]) + 1
    want = (_reference_huffman_bits(counts) + 7) // 8 + span
    assert bench.huffman_bytes(t) == want
    assert bench.huffman_bytes(torch.zeros(10, dtype=torch.int8)) == 1


def test_symbol_rows_round_trip_and_never_beat_the_entropy():
    t = bench.synthetic("laplace", 4096, seed=2)
    rows = bench.bench_symbols("laplace", t, repeat=1)  # raises if a coder is not exact
    coders = {r["coder"] for r in rows}
    assert {"ans", "eg auto", "huffman (constriction)", "lz4"} <= coders
    for r in rows:
        assert r["wire_bytes"] > 0 and r["symbols"] == 4096
        if not r["coder"].startswith(("zstd", "lz4")):  # symbol-wise coders: order-0 bound
            assert r["eta"] <= 1.0, r


def test_bars_read_the_rows():
    sym = [
        {"input": "laplace", "coder": "ans", "eta": 0.995, "encode_mbps": 450.0,
         "decode_mbps": 500.0},
        {"input": "laplace", "coder": "eg auto", "eta": 0.9, "encode_mbps": 50.0,
         "decode_mbps": 900.0},
        {"input": "laplace", "coder": "eg best-k sign", "eta": 0.95, "encode_mbps": 1.0},
        {"input": "laplace", "coder": "eg best-k offset", "eta": 0.5, "encode_mbps": 1.0},
    ]
    flt = [
        {"input": "g", "coder": "lossless", "wire_bytes": 90, "ratio": 1.3,
         "encode_mbps": 600.0, "decode_mbps": 900.0},
        {"input": "g", "coder": "zstd-3 raw bytes", "wire_bytes": 95, "ratio": 1.2},
        {"input": "g", "coder": "zipnn", "wire_bytes": 80, "ratio": 1.4,
         "encode_mbps": 500.0, "decode_mbps": 1000.0},
    ]
    bars = bench.check_bars(sym, flt)
    assert bars["ans eta >= 0.99 (laplace)"] and bars["ans encode >= 400 MB/s (laplace)"]
    assert bars["ans decode >= 400 MB/s (laplace)"]
    assert not bars["eg auto encode >= 400 MB/s (laplace)"]
    assert bars["eg auto decode >= 400 MB/s (laplace)"]
    assert bars["lossless encode >= zipnn (g)"] and not bars["lossless decode >= zipnn (g)"]
    assert bars["eg best-k sign eta >= 0.92 (laplace)"]
    assert not any("offset" in name for name in bars)  # not a signed mapping
    assert bars["lossless beats zstd (g)"] and not bars["lossless ratio >= zipnn (g)"]


def test_float_rows_are_exact(monkeypatch):
    for fn in bench.FLOAT_SOURCES.values():
        monkeypatch.setattr(samples, fn, lambda seed=0: {"a": samples.heavy_tailed(3000),
                                                         "b": samples.heavy_tailed(500, 1)})
    rows = bench.bench_floats(seed=0, repeat=1)
    assert {r["coder"] for r in rows} >= {"lossless", "zstd-3 raw bytes"}
    assert len({r["input"] for r in rows}) == 2 * 3  # two model families x three dtypes
    for r in rows:
        assert r["exact"], r
        assert r["ratio"] == pytest.approx(r["raw_bytes"] / r["wire_bytes"])
    lossless = [r for r in rows if r["coder"] == "lossless"]
    assert all(r["ratio"] > 1.0 for r in lossless)


def test_the_cnn_source_is_a_real_small_resnet_gradient():
    grads = samples.cnn_gradients(seed=0, steps=1, batch=8)
    assert any("bn" in n or n.endswith(".1.weight") for n in grads)  # batch-norm affine
    assert any(g.dim() == 4 for g in grads.values())  # conv kernels
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    assert torch.isfinite(flat).all() and flat.abs().max() > 0
    images, labels = samples.drawn_images(4, torch.Generator().manual_seed(0))
    assert images.shape == (4, 3, 32, 32) and labels.shape == (4,)


def test_exponent_table_study_rows(monkeypatch):
    for fn in bench.FLOAT_SOURCES.values():
        monkeypatch.setattr(samples, fn, lambda seed=0: {"a": samples.heavy_tailed(3000),
                                                         "b": samples.heavy_tailed(500, 1)})
    rows = bench.bench_exponent_tables(seed=0, repeat=1)
    assert len(rows) == 2 * 2 * 3  # sources x (bf16, fp16) x the three table strategies
    for group in zip(rows[::3], rows[1::3], rows[2::3], strict=True):
        assert [r["tables"] for r in group] == ["zstd, one per 128 KB", "zstd, one per tensor",
                                                "huff, fitted to blocks"]
        assert len({r["mutual_bits"] for r in group}) == 1 and group[0]["mutual_bits"] >= 0
        for r in group:
            assert 0 < r["share_of_raw"] < 1 and r["exponent_bytes"] > 0
