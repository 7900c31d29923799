"""Errors that are not a bad argument: bad model outputs, and what is accepted around the rejections.

Every bad input of the public API (``run`` on both backends, ``CUDAGraphManager``
and ``StaticInput`` arguments among them) is a row of ``tests/test_bad_inputs.py``.
Here: inputs checked on the eager path too, the valid values next to the
rejected ones, and model outputs that cannot be cut, found at capture.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Final, TypeVar, cast

import pytest
import torch

from cudagraph_capture import CaptureOptions
from cudagraph_capture._pool import GraphPool, capture_stream
from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import CUDAGraphManager, ManagerOptions, StaticInput

from .helpers import (
    INPUTS,
    Backend,
    FakeEngines,
    FakeGraphEngine,
    ToyModel,
    config_for,
    make_batch,
    make_manager,
)

FULL: Final = CUDAGraphMode.FULL
CPU: Final = torch.device("cpu")
R = TypeVar("R")


# ---------------------------------------------------------------------------
# run(): the checks on the eager path
# ---------------------------------------------------------------------------


def test_bad_inputs_raise_on_the_eager_path_too(backend: Backend) -> None:
    """Above the largest size nothing is copied, but the inputs are still checked."""
    manager = make_manager(backend, ToyModel(backend.device))
    batch = make_batch(40, 3, backend.device, seed=0)
    with pytest.raises(ValueError, match=r"input 'ids': expected dtype torch.int64, got torch.float32"):
        manager.run_batch({**batch, "ids": batch["ids"].float()})
    assert manager.stats.eager_steps == 0


# ---------------------------------------------------------------------------
# Construction (no GPU: the manager on CPU with the fake engines)
# ---------------------------------------------------------------------------


def _construct(**overrides: object) -> object:
    """Build a CPU manager from valid arguments with ``overrides`` applied."""
    arguments: dict[str, object] = {
        "model": ToyModel(CPU),
        "inputs": INPUTS,
        "config": config_for(FULL),
        "device": "cpu",
        "options": ManagerOptions(engine_factory=FakeEngines()),
        **overrides,
    }
    build = cast(Callable[..., object], CUDAGraphManager)  # arguments deliberately of any type
    return build(**arguments)


class _StandInStream(torch.cuda.Stream):
    """A ``torch.cuda.Stream`` by type that a CPU-only torch can build (never used as a stream)."""

    def __new__(cls) -> _StandInStream:
        return object.__new__(cls)

    def __init__(self) -> None:
        pass


def test_valid_construction_keeps_options_and_device() -> None:
    """The options given reach the engine factory: the manager may change warmup_runs, and nothing else."""
    # A pool and a stream (a stand-in without CUDA), checked by identity (the fake engines never use
    # them). A pool handle must be one torch made, so without CUDA there is none to give.
    pool: GraphPool | None = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
    stream = capture_stream() if torch.cuda.is_available() else _StandInStream()
    given = CaptureOptions(
        weak_ref_output=False,
        gc_disable=False,
        check_input_addresses=True,
        pool=pool,
        stream=stream,
        warmup_runs=3,
    )
    engines = FakeEngines()
    received: list[tuple[CUDAGraphMode, CaptureOptions]] = []

    def factory(model: Callable[..., R], mode: CUDAGraphMode, options: CaptureOptions) -> FakeGraphEngine[R]:
        received.append((mode, options))
        return engines(model, mode, options)

    manager = CUDAGraphManager(
        ToyModel(CPU),
        INPUTS,
        config_for(FULL),
        device="cpu",
        strict=True,
        options=ManagerOptions(capture=given, engine_factory=factory),
    )
    assert manager.device == CPU
    assert manager.num_captured == 0
    assert [mode for mode, _ in received] == [FULL]  # one engine per mode of the plan, built up front
    manager.capture()
    assert manager.num_captured == len(config_for(FULL).capture_sizes)
    got = received[0][1]
    for field in dataclasses.fields(CaptureOptions):
        if field.name != "warmup_runs":
            assert getattr(got, field.name) is getattr(given, field.name), field.name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the default device where there is no CUDA")
def test_default_device_without_cuda_is_the_cpu() -> None:
    manager = _construct(device=None)
    assert isinstance(manager, CUDAGraphManager)
    assert manager.device == CPU


def test_config_errors_come_from_the_dispatch_config() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        config_for(FULL, max_num_seqs=0)
    assert config_for(FULL, max_num_seqs=1).max_num_seqs == 1  # the smallest valid value is accepted


# ---------------------------------------------------------------------------
# StaticInput
# ---------------------------------------------------------------------------


def test_static_input_is_a_frozen_hashable_value() -> None:
    spec = StaticInput((4, 2), torch.bfloat16, "reqs", pad_value=-1)
    assert (spec.shape, spec.dtype, spec.rows, spec.pad_value) == ((4, 2), torch.bfloat16, "reqs", -1)
    assert StaticInput() == StaticInput((), torch.float32, "tokens", 0)
    assert hash(spec) == hash(StaticInput((4, 2), torch.bfloat16, "reqs", pad_value=-1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.rows = None  # type: ignore[misc]  # assigning a frozen field is the point
    assert not hasattr(spec, "__dict__")  # slotted


def test_static_input_normalizes_the_shape() -> None:
    from_list = StaticInput(cast(tuple[int, ...], [4, 2]))
    from_size = StaticInput(torch.Size([4, 2]))
    assert from_list.shape == from_size.shape == (4, 2)
    assert type(from_list.shape) is tuple
    assert type(from_size.shape) is tuple


@pytest.mark.parametrize(
    ("dtype", "pad_value"),
    [
        (torch.float32, -(2.0**127)),
        (torch.bfloat16, 1.0),
        (torch.bool, 1),
        (torch.int64, 2.0),
        (torch.uint8, 255),
    ],
)
def test_static_input_accepts_representable_pad_values(dtype: torch.dtype, pad_value: float) -> None:
    spec = StaticInput((), dtype, pad_value=pad_value)
    buffer = torch.full((2,), spec.pad_value, dtype=dtype)  # what the manager allocates
    # The pad value is stored exactly: read back, it is the value given.
    assert buffer.tolist() == [pad_value, pad_value]


# ---------------------------------------------------------------------------
# Model outputs, checked at the warm-up
# ---------------------------------------------------------------------------


def _options(**fields: object) -> ManagerOptions[torch.Tensor]:
    """``ManagerOptions(**fields)``: the fields of the tables below, of any type."""
    return cast(Callable[..., ManagerOptions[torch.Tensor]], ManagerOptions)(**fields)


def _capture_with(model: Callable[..., torch.Tensor], **fields: object) -> CUDAGraphManager[torch.Tensor]:
    options = _options(engine_factory=FakeEngines(), **fields)
    manager = CUDAGraphManager(model, INPUTS, config_for(FULL), device="cpu", options=options)
    manager.capture()
    return manager


def _returns(value: Callable[[dict[str, torch.Tensor]], object]) -> Callable[..., torch.Tensor]:
    def model(**inputs: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, value(inputs))  # whatever it really is: the manager must check

    return model


BAD_OUTPUTS: Final[dict[str, tuple[Callable[..., torch.Tensor], dict[str, object], str]]] = {
    "a string": (
        _returns(lambda i: "hidden"),
        {},
        "model output: expected a tensor or a tuple, list or dict",
    ),
    "None in a tuple": (
        _returns(lambda i: (i["x"], None)),
        {},
        "model output[1]: expected a tensor, got NoneType",
    ),
    "int dict keys": (_returns(lambda i: {0: i["x"]}), {}, "model output: dict keys must be str"),
    "a set": (_returns(lambda i: {1, 2}), {}, "got set"),
    "unknown output name": (
        _returns(lambda i: {"h": i["x"]}),
        {"output_rows": {"logits": None}},
        "output_rows: no output named ['logits']",
    ),
    "mapping for a tensor": (
        _returns(lambda i: i["x"]),
        {"output_rows": {"h": None}},
        "output_rows: a mapping needs a dict output, but the model returns a tensor",
    ),
    "tuple of the wrong length": (
        _returns(lambda i: (i["x"], i["x"])),
        {"output_rows": ("tokens",)},
        "got 1 entries for a tuple of 2 tensors",
    ),
    "reqs output with token rows": (
        _returns(lambda i: {"h": i["x"]}),
        {"output_rows": {"h": "reqs"}},
        "model output['h']: shape (32, 32) does not have the 16 rows of the batch's 'reqs' count",
    ),
    "scalar output following tokens": (
        _returns(lambda i: i["x"].sum()),
        {},
        "model output: shape () does not have the 32 rows",
    ),
    "structure changes with the size": (
        _returns(lambda i: i["x"] if i["x"].shape[0] > 16 else (i["x"],)),
        {},
        "model output: its structure changed between batch sizes (first a tensor [], now a tuple [0])",
    ),
}


@pytest.mark.parametrize("case", list(BAD_OUTPUTS))
def test_bad_model_outputs_fail_the_capture(case: str) -> None:
    model, kwargs, message = BAD_OUTPUTS[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        _capture_with(model, **kwargs)


# ---------------------------------------------------------------------------
# Model outputs of eager steps: checked as a capture's are (never returned as is)
# ---------------------------------------------------------------------------

#: (model, the manager's option fields, the error's pattern). The row counts in the
#: patterns are those of the unpadded step (5 tokens, 3 requests) or, on the CPU's
#: padded path, of the padded key (8 and 8).
EAGER_BAD_OUTPUTS: Final[dict[str, tuple[Callable[..., torch.Tensor], dict[str, object], str]]] = {
    "one row for 5 tokens": (
        _returns(lambda i: i["x"][:1]),
        {},
        r"model output: shape \(1, 32\) does not have the (5|8) rows of the batch's 'tokens' count",
    ),
    "twice the rows": (
        _returns(lambda i: torch.cat([i["x"], i["x"]])),
        {},
        r"model output: shape \((10|16), 32\) does not have the (5|8) rows",
    ),
    "token rows under reqs": (
        _returns(lambda i: i["x"]),
        {"output_rows": "reqs"},
        r"model output: shape \(5, 32\) does not have the 3 rows of the batch's 'reqs' count",
    ),
    "a 0-dim output": (
        _returns(lambda i: i["x"].sum()),
        {},
        r"model output: shape \(\) does not have the (5|8) rows",
    ),
    "structure changes with the size": (
        _returns(lambda i: i["x"] if i["x"].shape[0] > 4 else (i["x"],)),
        {},
        re.escape(
            "model output: its structure changed between batch sizes (first a tuple [0], now a tensor [])"
        ),
    ),
}


@pytest.mark.parametrize("case", list(EAGER_BAD_OUTPUTS))
@pytest.mark.parametrize("device", ["cpu", "fake-engines"])
def test_bad_model_outputs_of_an_eager_step_raise(case: str, device: str) -> None:
    """Without a graph (a CPU manager, or a step before capture) the outputs are checked all the same.

    On the CPU's padded path a key whose request rows equal its token rows (8 and 8 here)
    cannot tell token rows from request rows: that case is checked where the step is unpadded.
    """
    if device == "cpu" and case == "token rows under reqs":
        pytest.skip("the padded key has as many request rows as token rows: indistinguishable")
    model, kwargs, pattern = EAGER_BAD_OUTPUTS[case]
    factory = {"engine_factory": FakeEngines()} if device == "fake-engines" else {}
    options = _options(**factory, **kwargs)
    manager = CUDAGraphManager(model, INPUTS, config_for(FULL), device="cpu", options=options)
    if case == "structure changes with the size":
        manager.run_batch(make_batch(2, 2, CPU, seed=0))  # the first outputs seen: a tuple
    with pytest.raises(ValueError, match=pattern):
        manager.run_batch(make_batch(5, 3, CPU, seed=1))
