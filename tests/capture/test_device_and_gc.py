"""The capture package's two policies that need no GPU: device arguments and the collector."""

from __future__ import annotations

import gc

import pytest
import torch

from cudagraph_capture import collector_paused, resolve_device


def test_resolve_device_without_an_argument_follows_cuda() -> None:
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    assert resolve_device(None) == (expected if expected is not None else torch.device("cpu"))


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_resolve_device_keeps_other_devices(device: object) -> None:
    assert resolve_device(device) == torch.device(str(device))  # type: ignore[arg-type]  # untyped on purpose


@pytest.mark.parametrize(
    ("device", "message"),
    [
        (True, "device: expected a torch.device, a device string or a CUDA index, got True"),
        (2.5, "device: expected a torch.device, a device string or a CUDA index, got 2.5"),
        ("gpu", "device: expected a torch.device, a device string or a CUDA index, got 'gpu'"),
        (-1, "device: expected a torch.device, a device string or a CUDA index, got -1"),
        ("cuda:99", "device: 'cuda:99' "),
    ],
)
def test_resolve_device_names_a_bad_value(device: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        resolve_device(device)  # type: ignore[arg-type]  # the wrong type is the point


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where there is no CUDA device")
@pytest.mark.parametrize("device", [0, "cuda", "cuda:1"])
def test_resolve_device_without_cuda_says_so(device: object) -> None:
    with pytest.raises(ValueError, match="is a CUDA device, but CUDA is not available here"):
        resolve_device(device)  # type: ignore[arg-type]  # an int is a CUDA index


def test_collector_paused_pauses_freezes_and_restores() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with collector_paused():
        assert not gc.isenabled()
        assert gc.get_freeze_count() >= frozen
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen


def test_collector_paused_restores_after_an_error() -> None:
    with pytest.raises(RuntimeError, match="inside"), collector_paused():
        raise RuntimeError("inside")
    assert gc.isenabled()


def test_collector_runs_when_gc_disable_is_off() -> None:
    with collector_paused(gc_disable=False):
        assert gc.isenabled()
    assert gc.isenabled()
