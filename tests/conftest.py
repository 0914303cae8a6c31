"""Shared test settings: deterministic, CPU-only, few threads (CI has 2 cores)."""

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton's kernels run on CPU tensors in its interpreter (tests/test_kernels.py): the
# switch is read when a kernel is defined, so it is set before gradzip imports triton
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)

settings.register_profile(
    "gradzip",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("gradzip")


@pytest.fixture(autouse=True)
def _keep_denormals():
    """Commands run in-process (``gradzip bench``, ``gradzip train``) flush denormals to
    zero for speed, as training should; that flag is process-wide and would leak into
    later tests (hypothesis refuses to draw floats without subnormals)."""
    yield
    torch.set_flush_denormal(False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data cache shared by one module's trainer runs: the tokenizer and token shards
    of the built-in corpus are built by the first run and read by the others."""
    return tmp_path_factory.mktemp("data-cache")
