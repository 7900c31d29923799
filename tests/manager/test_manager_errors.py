"""Errors: bad inputs to ``run``, bad construction, bad ``StaticInput`` values, bad model outputs.

Every bad input raises ``ValueError`` naming the input and the bad value,
before any static buffer is touched and without counting a run. The run
errors are checked on both backends (``helpers``); the rest needs no GPU.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Final, TypeVar, cast

import pytest
import torch

from cudagraph_capture import CaptureOptions, GraphPool
from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import CUDAGraphManager, StaticInput

from .helpers import (
    BACKENDS,
    DIM,
    INPUTS,
    MAX_NUM_SEQS,
    Backend,
    FakeEngines,
    FakeGraphEngine,
    ToyModel,
    assert_unchanged,
    config_for,
    make_batch,
    make_manager,
    snapshot,
)

FULL: Final = CUDAGraphMode.FULL
CPU: Final = torch.device("cpu")
R = TypeVar("R")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    torch.manual_seed(0)
    return Backend.of(str(request.param))


def run_untyped(manager: CUDAGraphManager[torch.Tensor], kwargs: Mapping[str, object]) -> object:
    """``manager.run(**kwargs)`` with deliberately wrong types (what an untyped caller may pass)."""
    return manager.run(**kwargs)  # type: ignore[arg-type]  # the wrong types are the point


# ---------------------------------------------------------------------------
# run(): bad inputs
# ---------------------------------------------------------------------------

# A bad call: from a valid 5-token, 3-request batch and the backend, the
# keyword arguments of ``run`` and the fragments the error message must hold.
BadCall = Callable[[dict[str, torch.Tensor], Backend], tuple[dict[str, object], tuple[str, ...]]]


def _replace(batch: dict[str, torch.Tensor], name: str, value: object) -> dict[str, object]:
    return {**batch, name: value}


def _fresh(num_tokens: int, num_reqs: int, backend: Backend) -> dict[str, object]:
    return dict(make_batch(num_tokens, num_reqs, backend.device, seed=1))


BAD_CALLS: Final[dict[str, BadCall]] = {
    "unknown name": lambda b, _: ({**b, "idz": b["ids"]}, ("unknown input(s) ['idz']",)),
    "missing name": lambda b, _: (
        {k: v for k, v in b.items() if k != "scale"},
        ("missing input(s) ['scale']",),
    ),
    "not a tensor": lambda b, _: (_replace(b, "x", b["x"].tolist()), ("input 'x'", "got list")),
    "dtype": lambda b, _: (_replace(b, "ids", b["ids"].to(torch.int32)), ("input 'ids'", "torch.int32")),
    "device": lambda b, be: (
        _replace(b, "x", b["x"].to(be.foreign_device)),
        ("input 'x'", f"got one on {be.foreign_device.type}"),
    ),
    "trailing shape": lambda b, be: (
        _replace(b, "x", torch.randn(5, DIM + 1, device=be.device)),
        ("input 'x'", "(5, 33)"),
    ),
    "no row dim": lambda b, be: (
        _replace(b, "scale", torch.tensor(2.0, device=be.device)),
        ("input 'scale'", "()"),
    ),
    "extra dim": lambda b, _: (_replace(b, "ids", b["ids"][:, None]), ("input 'ids'", "(5, 1)")),
    "unbatched shape": lambda b, be: (
        _replace(b, "bias", torch.randn(1, DIM, device=be.device)),
        ("input 'bias'", "(1, 32)"),
    ),
    "token rows differ": lambda b, be: (
        _replace(b, "x", torch.randn(6, DIM, device=be.device)),
        ("input 'x': 6 rows", "input 'ids' has 5"),
    ),
    "reqs above max_num_seqs": lambda _, be: (
        _fresh(20, MAX_NUM_SEQS + 1, be),
        ("input 'scale'", f"{MAX_NUM_SEQS + 1} rows", f"max_num_seqs={MAX_NUM_SEQS}"),
    ),
    "more reqs than tokens": lambda _, be: (_fresh(3, 4, be), ("input 'scale'", "4 requests for 3 tokens")),
    "not uniform": lambda b, _: (
        {**b, "uniform_decode": True},
        ("uniform_decode", "5 tokens for 3 requests"),
    ),
    "negative loras": lambda b, _: ({**b, "num_active_loras": -1}, ("num_active_loras", "-1")),
    "bad invalid_modes": lambda b, _: (
        {**b, "invalid_modes": frozenset({CUDAGraphMode.NONE})},
        ("invalid_modes", "NONE"),
    ),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_inputs_raise_before_touching_a_buffer(backend: Backend, case: str) -> None:
    manager = make_manager(backend, ToyModel(backend.device))
    manager.capture()
    manager.run_batch(make_batch(8, 8, backend.device, seed=0))  # real data in the buffers
    before = snapshot(manager.static_buffers)
    stats = manager.stats
    kwargs, fragments = BAD_CALLS[case](make_batch(5, 3, backend.device, seed=2), backend)
    with pytest.raises(ValueError, match=re.escape(fragments[0])) as info:
        run_untyped(manager, kwargs)
    for fragment in fragments[1:]:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    assert_unchanged(before, manager.static_buffers)
    assert manager.stats == stats


def test_bad_inputs_raise_on_the_eager_path_too(backend: Backend) -> None:
    """Above the largest size nothing is copied, but the inputs are still checked."""
    manager = make_manager(backend, ToyModel(backend.device))
    batch = make_batch(40, 3, backend.device, seed=0)
    with pytest.raises(ValueError, match=r"input 'ids': expected dtype torch.int64, got torch.float32"):
        manager.run_batch({**batch, "ids": batch["ids"].float()})
    assert manager.stats.eager_runs == 0


def test_run_batch_takes_a_mapping_only(backend: Backend) -> None:
    manager = make_manager(backend, ToyModel(backend.device))
    batch = make_batch(4, 2, backend.device, seed=0)
    with pytest.raises(ValueError, match="inputs: expected a mapping of input names to tensors, got list"):
        manager.run_batch(cast(Mapping[str, torch.Tensor], list(batch.values())))


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
        "engine_factory": FakeEngines(),
        **overrides,
    }
    build = cast(Callable[..., object], CUDAGraphManager)  # arguments deliberately of any type
    return build(**arguments)


BAD_CONSTRUCTIONS: Final[dict[str, tuple[dict[str, object], str]]] = {
    "model not callable": ({"model": 3}, "model: expected a callable, got int"),
    "config not a DispatchConfig": ({"config": "FULL"}, "config: expected a DispatchConfig"),
    "no inputs": ({"inputs": {}}, "inputs: expected a non-empty mapping"),
    "inputs not a mapping": ({"inputs": [StaticInput()]}, "inputs: expected a non-empty mapping"),
    "name not an identifier": (
        {"inputs": {"input ids": StaticInput()}},
        "must be identifiers, got 'input ids'",
    ),
    "name not a str": ({"inputs": {3: StaticInput()}}, "must be identifiers, got 3"),
    "reserved name": (
        {"inputs": {"x": StaticInput(), "uniform_decode": StaticInput()}},
        "inputs['uniform_decode']: the name is a keyword of run() itself",
    ),
    "spec not a StaticInput": ({"inputs": {"x": (DIM,)}}, "inputs['x']: expected a StaticInput, got (32,)"),
    "no tokens input": (
        {"inputs": {"s": StaticInput(rows="reqs"), "b": StaticInput(rows=None)}},
        "at least one input needs rows='tokens'",
    ),
    "strict not a bool": ({"strict": 1}, "strict: expected True or False, got 1"),
    "options not CaptureOptions": (
        {"options": {"gc_disable": True}},
        "options: expected CaptureOptions or None",
    ),
    "bad device": ({"device": "gpu7"}, "device: expected a torch.device"),
    "bad output_rows": (
        {"output_rows": "rows"},
        "output_rows: expected 'tokens', 'reqs' or None, got 'rows'",
    ),
    "output_rows not a spec": ({"output_rows": ["reqs"]}, "a mapping or a tuple of them, got ['reqs']"),
    "bad output_rows entry": (
        {"output_rows": {"a": "token"}},
        "output_rows['a']: expected 'tokens', 'reqs' or None",
    ),
    "output_rows key not str": ({"output_rows": {0: "reqs"}}, "keyed by the output dict's keys (str), got 0"),
    "output_rows reqs without reqs input": (
        {"inputs": {"x": StaticInput((DIM,))}, "output_rows": "reqs"},
        "an output follows 'reqs', but no input has rows='reqs'",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONSTRUCTIONS))
def test_bad_construction_raises_naming_the_argument(case: str) -> None:
    overrides, message = BAD_CONSTRUCTIONS[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        _construct(**overrides)


def test_valid_construction_keeps_options_and_device() -> None:
    """The options given reach the engine factory: the manager may change warmup_runs, and nothing else."""
    # Stand-ins for a pool and a stream, checked by identity (the fake engines never use them).
    pool = cast(GraphPool, (1234, 5678))
    stream = cast(torch.cuda.Stream, object())
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
        options=given,
        engine_factory=factory,
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


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the errors raised where there is no CUDA device"
)
@pytest.mark.parametrize("device", [0, "cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_devices_without_cuda_are_named(device: object) -> None:
    with pytest.raises(ValueError, match=r"device: .* is a CUDA device, but CUDA is not available here"):
        _construct(device=device)


def test_config_errors_come_from_the_dispatch_config() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        config_for(FULL, max_num_seqs=0)
    assert config_for(FULL, max_num_seqs=1).max_num_seqs == 1  # the smallest valid value is accepted


# ---------------------------------------------------------------------------
# StaticInput
# ---------------------------------------------------------------------------

BAD_STATIC_INPUTS: Final[dict[str, tuple[dict[str, object], str]]] = {
    "shape not a tuple": ({"shape": 4}, "shape: expected a tuple of integers >= 1"),
    "shape with zero": ({"shape": (4, 0)}, "shape: expected a tuple of integers >= 1"),
    "shape with negative": ({"shape": (-1,)}, "shape: expected a tuple of integers >= 1"),
    "shape with bool": ({"shape": (True,)}, "shape: expected a tuple of integers >= 1"),
    "shape with float": ({"shape": (2.0,)}, "shape: expected a tuple of integers >= 1"),
    "dtype not a dtype": ({"dtype": "float32"}, "dtype: expected a torch.dtype, got 'float32'"),
    "rows unknown": ({"rows": "requests"}, "rows: expected 'tokens', 'reqs' or None, got 'requests'"),
    "pad_value not a number": ({"pad_value": "0"}, "pad_value: expected an int or a float, got '0'"),
    "pad_value fractional for int": (
        {"dtype": torch.int64, "pad_value": 0.5},
        "pad_value: 0.5 is not an integer",
    ),
    "pad_value out of uint8": (
        {"dtype": torch.uint8, "pad_value": -1},
        "pad_value: -1 is out of range for torch.uint8",
    ),
    "pad_value above int8": (
        {"dtype": torch.int8, "pad_value": 128},
        "pad_value: 128 is out of range for torch.int8",
    ),
    "pad_value for bool": (
        {"dtype": torch.bool, "pad_value": 2},
        "pad_value: expected 0 or 1 for dtype torch.bool",
    ),
    "pad_value a bool": (
        {"dtype": torch.bool, "pad_value": True},
        "pad_value: expected an int or a float, got True",
    ),
    "pad_value nan": ({"pad_value": float("nan")}, "pad_value: expected a finite number"),
    "pad_value nan for int": (
        {"dtype": torch.int32, "pad_value": float("nan")},
        "pad_value: expected a finite",
    ),
    "pad_value inf": ({"pad_value": float("inf")}, "pad_value: expected a finite number"),
    "dtype quantized": ({"dtype": torch.quint8}, "dtype: expected a floating, integer or bool torch.dtype"),
    "dtype complex": ({"dtype": torch.complex64}, "dtype: expected a floating, integer or bool torch.dtype"),
    "pad_value overflows half": (
        {"dtype": torch.float16, "pad_value": 1e6},
        "pad_value: 1000000.0 overflows",
    ),
}


@pytest.mark.parametrize("case", list(BAD_STATIC_INPUTS))
def test_static_input_rejects_bad_values_naming_the_field(case: str) -> None:
    kwargs, message = BAD_STATIC_INPUTS[case]
    build = cast(Callable[..., StaticInput], StaticInput)
    with pytest.raises(ValueError, match=re.escape(message)):
        build(**kwargs)


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


def _capture_with(model: Callable[..., torch.Tensor], **kwargs: object) -> CUDAGraphManager[torch.Tensor]:
    build = cast(Callable[..., CUDAGraphManager[torch.Tensor]], CUDAGraphManager)
    manager = build(model, INPUTS, config_for(FULL), device="cpu", engine_factory=FakeEngines(), **kwargs)
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
