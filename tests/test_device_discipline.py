"""Device discipline without a GPU: codecs on ``meta`` tensors.

A meta tensor has a shape, a dtype and a device, but no values: any host read
(``.item()``, ``int(t)``, ``.numpy()``) raises, and ``DeviceWatch`` records every
operator that meets a CPU-made tensor with the data. A codec whose math is pure torch
must encode and decode a bucket of meta tensors with no host read, no mixed-device
operator, and every payload tensor and the result on the data's device; on CUDA it
then runs with no host sync and no device-mismatch error. The stages that must use
the host are listed in ``HOST`` with the reason, and the test holds the list exact.
"""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.bench.devicecheck import DeviceWatch, count_host_syncs

SHAPES = [torch.Size((100, 30)), torch.Size((30,)), torch.Size((5000,)),
          torch.Size((200, 50)), torch.Size((0,))]

#: codecs whose encode and decode are pure torch on the data's device
PURE = ["none", "fp16", "bf16", "randomk(ratio=0.1)", "int8", "int8(block=256)", "qsgd",
        "fp8", "fp8(format=e5m2)", "ef | fp8",
        "signsgd", "powersgd(rank=2)", "gradiveq", "sketch", "ef | int8", "ef | qsgd",
        "ef | fp16", "ef | powersgd(rank=2)"]

#: codecs that read the host, and why (docs/architecture.md, "Device and host")
HOST = {
    "topk(ratio=0.1)": "decode validates the received positions (1-2 host reads)",
    "threshold(v=0.5)": "the number of kept values depends on the data",
    "dgc": "the sampled threshold and the kept count depend on the data",
    "terngrad": "decode validates the received trit codes (1 host read)",
    "centroid": "decode validates the received bin codes (1 host read)",
    "stdbins": "decode validates the received bin codes (1 host read)",
    "natural": "the largest exponent goes into the header (1 host read)",
    "efsignsgd": "per-tensor scales retried in float64 on overflow (1 host read)",
    "onebit": "per-column means retried in float64 on overflow (1 host read)",
    "sharedtopk": "decode validates the received positions (1 host read)",
    "demo": "decode validates the received positions (1 host read per tensor)",
    "int8 | ans": "entropy coders run on the host (numba): one round trip per field",
    "lossless": "the lossless float coder runs on the host (numba, zstd)",
}


def _meta_bucket() -> torch.Tensor:
    return torch.empty(sum(s.numel() for s in SHAPES), device="meta")


def _round_trip(spec: str) -> tuple[DeviceWatch, gradzip.Payload, torch.Tensor]:
    codec = gradzip.codec(spec, nonfinite="propagate")
    watch = DeviceWatch()
    with watch:
        payload = codec.encode(_meta_bucket(), "bucket0", SHAPES)
        out = codec.decode(payload, "bucket0", SHAPES)
    return watch, payload, out


@pytest.mark.parametrize("spec", PURE)
def test_pure_codecs_stay_on_the_device(spec: str) -> None:
    watch, payload, out = _round_trip(spec)
    assert watch.mixes == [], f"{spec}: operators mixing devices: {watch.mixes}"
    assert watch.reads == 0
    assert watch.blocking_uploads == [], f"{spec}: host-to-device copies that block"
    assert {t.device.type for _, t in payload.leaves()} <= {"meta"}
    assert out.device.type == "meta" and out.shape == _meta_bucket().shape


@pytest.mark.parametrize("spec", sorted(HOST))
def test_host_stages_are_listed_exactly(spec: str) -> None:
    """Each listed codec really reads the host; one that stops doing so must move to
    ``PURE`` (and docs/architecture.md), so the list never goes stale."""
    # a decoder's host read on meta surfaces as PayloadError (decoding wraps whatever
    # fails in it), whose cause is the refused read
    with pytest.raises((RuntimeError, NotImplementedError, gradzip.PayloadError)) as caught:
        _round_trip(spec)
    error = caught.value.__cause__ or caught.value
    assert any(m in str(error) for m in ("cannot be called on meta tensors",
                                          "Cannot copy out of meta tensor")), error


def test_every_registered_compressor_is_classified() -> None:
    from gradzip.codecs.base import Compressor
    named = {s.split("(")[0].split("|")[-1].strip() for s in PURE + list(HOST)}
    compressors = {n for n, cls in gradzip.registered().items() if issubclass(cls, Compressor)}
    assert compressors <= named, f"classify {sorted(compressors - named)} in this file"


def test_sync_counter_counts_what_a_gpu_would_sync_on() -> None:
    t = torch.arange(4.0)
    with count_host_syncs() as syncs:
        float(t.sum())
        t.tolist()
        t.numpy()
        t.cpu()
    assert syncs.counts == {"item": 1, "tolist": 1, "cpu": 1}  # numpy: host tensors only


#: codecs that keep tensors between steps (residuals, momentum, warm starts)
STATEFUL = ["ef | int8", "ef | qsgd", "ef | fp16", "ef | powersgd(rank=2)",
            "gradiveq", "demo"]


@pytest.mark.parametrize("spec", STATEFUL)
def test_state_loaded_on_the_host_follows_the_data(spec: str) -> None:
    """A checkpoint loads on the CPU; resumed on a GPU, the state must move beside the
    gradients at its first use, not meet them on the host (issue 41, item 5). Meta
    tensors stand in for the GPU: a CPU residual that met them would be a mix."""
    trained = gradzip.codec(spec, nonfinite="propagate")
    for step in range(3):
        x = torch.randn(sum(s.numel() for s in SHAPES), generator=torch.Generator()
                        .manual_seed(step))
        trained.decode(trained.encode(x, "bucket0", SHAPES), "bucket0", SHAPES)
    resumed = gradzip.codec(spec, nonfinite="propagate")
    resumed.load_state_dict(trained.state_dict())
    watch = DeviceWatch()
    with watch:
        try:
            resumed.encode(_meta_bucket(), "bucket0", SHAPES)
        except NotImplementedError as e:  # a host read on meta: the mix came first
            assert "meta" in str(e), e
    assert watch.mixes == [], f"{spec}: state on the host met the data: {watch.mixes}"
    placed = [t.device.type for rec in resumed.state.records.values()
              for t in rec["data"].values() if isinstance(t, torch.Tensor)]
    assert placed and set(placed) == {"meta"}, placed


def test_every_tensor_of_a_loaded_record_moves_once() -> None:
    from gradzip.codecs.base import CodecState

    saved = CodecState(seed=1)
    saved.slot(0, "k").data.update(v=torch.ones(3), nested={"u": [torch.zeros(2)]})
    loaded = CodecState()
    loaded.load_state_dict(saved.state_dict())
    first = loaded.slot(0, "k", torch.device("meta")).data
    assert first["v"].device.type == first["nested"]["u"][0].device.type == "meta"
    first["v"] = torch.full((3,), 2.0)  # a stage's new state stays where it put it
    assert loaded.slot(0, "k", torch.device("meta")).data["v"].device.type == "cpu"


def test_a_payload_frames_onto_the_device_in_one_upload() -> None:
    """A byte payload's host parts (headers, lengths, digest) go up in one pinned,
    non-blocking copy; its device tensors are placed on the device (issue 41, item 11:
    before, every part was its own blocking upload)."""
    codec = gradzip.codec("topk(ratio=0.1)", nonfinite="propagate")
    x = torch.randn(sum(s.numel() for s in SHAPES))
    payload = codec.encode(x, "bucket0", SHAPES)
    assert len(list(payload.leaves())) > 1
    received = DeviceWatch()
    with received:  # a received payload's leaves, back to the device: one copy too
        on_meta = payload.to("meta")
    assert received.transfers["cpu->meta"] == 1 and received.blocking_uploads == []
    watch = DeviceWatch()
    with watch:
        framed = on_meta.to_tensor()
    assert framed.device.type == "meta" and framed.numel() == payload.to_tensor().numel()
    assert watch.blocking_uploads == []
    assert watch.transfers["cpu->meta"] == 1, watch.transfers


#: ``torch.tensor(..., device=)`` left on purpose: values the host just computed after a
#: host read it already made (the codecs of ``HOST`` that read a scale back)
TENSOR_ON_DEVICE_ALLOWED = {"codecs/sign.py": 3}


def test_small_device_tensors_are_uploaded_without_blocking() -> None:
    """``torch.tensor(data, device=cuda)`` copies from pageable memory and blocks the
    host; the hot-path layers make such tensors with ``device_tensor`` (pinned,
    non-blocking). A count per file, held exact, so a new one is a decision."""
    import ast
    from pathlib import Path

    root = Path(gradzip.__file__).parent
    found: dict[str, int] = {}
    for layer in ("codecs", "collectives", "aggregation", "comm"):
        for path in sorted((root / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "tensor"
                        and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "torch"
                        and any(k.arg == "device" and not (
                            isinstance(k.value, ast.Constant) and k.value.value == "cpu")
                            for k in node.keywords)):
                    name = str(path.relative_to(root))
                    found[name] = found.get(name, 0) + 1
    assert found == TENSOR_ON_DEVICE_ALLOWED, found
