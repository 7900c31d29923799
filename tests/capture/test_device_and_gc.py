"""The capture package's two policies that need no GPU: device arguments and the collector.

Bad device arguments are rows of ``tests/test_bad_inputs.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch

from cudagraph_capture._gc import collector_paused
from cudagraph_capture.lowlevel import resolve_device


def test_resolve_device_without_an_argument_follows_cuda() -> None:
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    assert resolve_device(None) == (expected if expected is not None else torch.device("cpu"))


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_resolve_device_keeps_the_cpu(device: object) -> None:
    assert resolve_device(device) == torch.device(str(device))  # type: ignore[arg-type]  # untyped on purpose


def test_collector_paused_pauses_freezes_and_restores() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with collector_paused():
        assert not gc.isenabled()
        assert gc.get_freeze_count() >= frozen
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen


def test_collector_paused_restores_after_an_error() -> None:
    frozen = gc.get_freeze_count()
    seen: list[bool] = []

    def fail_inside() -> None:
        with collector_paused():
            seen.append(gc.isenabled())
            raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        fail_inside()
    assert seen == [False]
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen


def test_collector_runs_when_gc_disable_is_off() -> None:
    with collector_paused(gc_disable=False):
        assert gc.isenabled()
    assert gc.isenabled()
