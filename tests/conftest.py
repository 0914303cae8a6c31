"""Shared test settings: deterministic, CPU-only, few threads (CI has 2 cores)."""

import os

import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

settings.register_profile(
    "gradzip",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("gradzip")
