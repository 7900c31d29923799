"""Shared test set-up: Hypothesis profiles and the `gpu` marker.

Tests marked ``gpu`` skip with a reason where CUDA is absent; torch is only
imported when such a test was collected, so the dispatch tests stay torch-free.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=100)
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def _cuda_missing_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA device; none is available here"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _cuda_missing_reason()
    if reason is not None:
        skip = pytest.mark.skip(reason=reason)
        for item in gpu_items:
            item.add_marker(skip)
