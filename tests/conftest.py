"""Shared test set-up: Hypothesis profiles and the `gpu` marker.

Tests marked ``gpu`` skip with a reason where CUDA is absent; torch is only
imported when such a test was collected, so the dispatch tests stay torch-free.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from datetime import timedelta

# One intra-op thread for torch's CPU kernels, set before anything imports
# torch: the CPU tests run tiny models, where a second thread buys nothing and,
# on a loaded 2-core machine, turns a 5 us matmul into tens of milliseconds.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from hypothesis import settings

# Profiles are chosen by HYPOTHESIS_PROFILE only, so CI runs the profile a user
# gets unless it asks for another.
#
# "dev", the default: 100 examples and every health check on, so the shared
# strategies must stay cheap to draw from. The deadline is generous on purpose:
# it catches an example that became orders of magnitude slower (say, a table
# built per token count), not a busy machine: with Hypothesis's 200 ms default,
# one example slowed down by the load fails as "Unreliable test timings".
settings.register_profile("dev", max_examples=100, deadline=timedelta(seconds=2))
# "ci": no deadline at all, and a reproduction blob printed with every failure.
settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The objects alive before the test frozen (``gc.freeze``) until it ends.

    A ``gc.collect()`` then scans only what the test made, not the whole
    heap that torch and the other tests left (about 0.1 s on a 2-core
    machine): a state machine that collects after each of its examples, to
    check that memory went with its last reference, runs in a fraction of
    the time and checks the same.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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
