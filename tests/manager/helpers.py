"""Shared pieces of the manager tests: a small model, a fake engine, backends, batches.

``ToyModel`` has every kind of input the manager handles (two "tokens" inputs,
one of them integer, a "reqs" input and a non-batched one) and an
``eager_break_during_capture`` op, so PIECEWISE captures really break.

Each behaviour test runs on two backends: ``cpu`` (the manager on CPU tensors
with ``FakeGraphEngine``, which keeps the graph contract without a GPU: it
exercises every line of the manager here) and ``cuda`` (the real engines of
``cudagraph_capture``, marked ``gpu``).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Final, Generic, TypeVar, cast

import pytest
import torch
from torch import nn
from torch.nn.functional import linear

from cudagraph_capture import CaptureOptions, eager_break_during_capture
from cudagraph_capture.lowlevel import RecordSeconds
from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    get_forward_context,
    set_forward_context,
)
from cudagraph_manager import CUDAGraphManager, ManagerOptions, StaticInput
from cudagraph_manager._values._inputs import Rows
from cudagraph_manager.lowlevel import GraphEngineFactory
from tests.torch_support import as_tensor as as_tensor
from tests.torch_support import highest_fp32_matmul_precision as highest_fp32_matmul_precision
from tests.torch_support import rel_err as rel_err

R = TypeVar("R")

#: Width, hidden width and vocabulary of the toy model: tiny, so the suite is fast.
DIM: Final = 32
HIDDEN: Final = 64
VOCAB: Final = 64

#: Token counts captured by the tests; 3 is deliberately missing (it pads to 4).
SIZES: Final[tuple[int, ...]] = (1, 2, 4, 8, 16, 24, 32)
MAX_NUM_SEQS: Final = 16

#: Relative error allowed between a replay and eager on the same fp32 data: a
#: padded batch may run another matmul kernel, which moves the last bits only.
TOL: Final = 1e-4

#: The toy model's inputs. Padding values are inert: token id 0, a zero
#: feature row, a request scale of 1.
INPUTS: Final[Mapping[str, StaticInput]] = {
    "ids": StaticInput((), torch.int64, "tokens", pad_value=0),
    "x": StaticInput((DIM,), torch.float32, "tokens", pad_value=0.0),
    "scale": StaticInput((), torch.float32, "reqs", pad_value=1.0),
    "bias": StaticInput((DIM,), torch.float32, rows=None),
}

ALL_MODES: Final = (
    CUDAGraphMode.FULL,
    CUDAGraphMode.PIECEWISE,
    CUDAGraphMode.FULL_DECODE_ONLY,
    CUDAGraphMode.FULL_AND_PIECEWISE,
)

#: The two backends, as pytest params: ``cuda`` needs a GPU and is marked so.
BACKENDS: Final = ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))


def as_tensor_dict(value: object) -> dict[str, torch.Tensor]:
    """``value``, checked to be a dict of tensors."""
    assert isinstance(value, dict), f"expected a dict, got {type(value).__name__}"
    assert all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    return value


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


class RequestScale:
    """The eager-break op of ``ToyModel``: ``out = h``, row i scaled by ``scale[i]``.

    Rows ``i < min(tokens, reqs)`` are scaled: a stand-in for attention, which
    reads per-request data and is not captured in PIECEWISE mode. It writes
    into ``out`` and returns nothing, as the break contract asks, and counts
    its Python calls (a PIECEWISE replay runs it, a FULL replay does not).
    """

    def __init__(self) -> None:
        self.calls = 0
        self._op = eager_break_during_capture(self._apply)

    def _apply(self, out: torch.Tensor, h: torch.Tensor, scale: torch.Tensor) -> None:
        # out, h: [num_tokens, HIDDEN]; scale: [num_reqs]
        self.calls += 1
        out.copy_(h)
        k = min(h.shape[0], scale.shape[0])
        out[:k].mul_(scale[:k, None])

    def __call__(self, out: torch.Tensor, h: torch.Tensor, scale: torch.Tensor) -> None:
        self._op(out, h, scale)


def _weight(out_features: int, in_features: int, device: torch.device) -> nn.Parameter:
    w = torch.randn(out_features, in_features, device=device) / math.sqrt(in_features)
    return nn.Parameter(w, requires_grad=False)


class ToyModel(nn.Module):
    """``W2 relu(scale * (W1 (embed(ids) + x + bias)))``: returns ``[num_tokens, DIM]``.

    Row-wise except for the request scale, so padding rows never touch the
    real rows, and pad values (id 0, x 0, scale 1) keep the real rows exact.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(VOCAB, DIM, device=device), requires_grad=False)
        self.w1 = _weight(HIDDEN, DIM, device)
        self.w2 = _weight(DIM, HIDDEN, device)
        self.request_scale = RequestScale()

    def forward(
        self, ids: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        return self.hidden(ids, x, scale, bias)

    def hidden(
        self, ids: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        # ids: [T]; x: [T, DIM]; scale: [R]; bias: [DIM] -> [T, DIM]
        h = linear(self.embed[ids] + x + bias, self.w1)  # [T, HIDDEN]
        scaled = torch.empty_like(h)  # the break writes here
        self.request_scale(scaled, h, scale)
        return linear(torch.relu(scaled), self.w2)

    def eager(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The reference: a plain call on the real batch (no manager)."""
        with torch.no_grad():
            return as_tensor(self(**batch))


class DictModel(nn.Module):
    """``ToyModel`` returning a dict: per-token, per-request and unbatched outputs."""

    #: How to cut each output: "hidden" follows tokens by default.
    OUTPUT_ROWS: Final[Mapping[str, Rows]] = {"per_req": "reqs", "bias2": None}

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.toy = ToyModel(device)

    def forward(
        self, ids: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        hidden = self.toy.hidden(ids, x, scale, bias)  # [T, DIM]
        return {"hidden": hidden, "per_req": scale * 2.0, "bias2": bias * 2.0}  # [T, DIM], [R], [DIM]

    def eager_dict(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return as_tensor_dict(self(**batch))


# ---------------------------------------------------------------------------
# A fake engine: the graph contract without a GPU
# ---------------------------------------------------------------------------


class FakeEntry(Generic[R]):
    """A ``GraphEntry`` without a GPU: a replay re-runs the model on the kept inputs into the kept outputs."""

    def __init__(
        self,
        engine: FakeGraphEngine[R],
        descriptor: BatchDescriptor,
        inputs: dict[str, torch.Tensor],
        output: R,
        seconds: RecordSeconds,
        extra: Mapping[str, object],
    ) -> None:
        self._engine = engine
        self.descriptor = descriptor
        # A FULL graph replays what its capture saw (an attention's metadata: its buffers and host
        # values); a PIECEWISE replay's eager breaks read the step's context, which the manager sets.
        self._extra = extra
        self.seconds = seconds  # the model's call stands for the recording; nothing to instantiate
        self._inputs = inputs  # a graph reads fixed addresses: the manager copies the step into them
        self._output = output

    @property
    def output(self) -> R:
        return self._output

    @property
    def replay(self) -> Callable[[], object]:
        return self._replay

    def _replay(self) -> None:
        engine = self._engine
        if engine.mode is CUDAGraphMode.FULL:
            with set_forward_context(CUDAGraphMode.FULL, self.descriptor, **self._extra):
                fresh = engine.model(**self._inputs)
        else:
            fresh = engine.model(**self._inputs)
        for dst, src in zip(_leaves(self._output), _leaves(fresh), strict=True):
            dst.copy_(src)
        self._engine.replays += 1


class FakeGraphEngine(Generic[R]):
    """Keeps the contract of a graph engine on any device, by re-running the model.

    ``record`` runs the model under the key's forward context and keeps the
    argument tensors and the outputs in the entry it returns; the entry's
    ``replay`` re-runs the model on the kept tensors and copies the results
    into the kept outputs. ``warm_up`` runs the model under NONE.
    """

    def __init__(self, model: Callable[..., R], mode: CUDAGraphMode, on_capture: Callable[[], None]) -> None:
        self.model = model
        self.mode = mode
        self.on_capture = on_capture
        self.replays = 0
        self.warm_ups = 0
        self._alive: weakref.WeakSet[FakeEntry[R]] = weakref.WeakSet()

    def warm_up(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> None:
        extra = _callers_extra(descriptor)
        with set_forward_context(CUDAGraphMode.NONE, descriptor, **extra):
            self.model(**inputs)
        self.warm_ups += 1

    def record(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> FakeEntry[R]:
        extra = _callers_extra(descriptor)
        self.on_capture()
        kept = {name: as_tensor(value) for name, value in inputs.items()}
        start = time.perf_counter()
        with set_forward_context(self.mode, descriptor, **extra):  # as the real engines run the capture
            output = self.model(**kept)
        seconds = RecordSeconds(time.perf_counter() - start, 0.0)
        entry = FakeEntry(self, descriptor, kept, output, seconds, extra)
        self._alive.add(entry)
        return entry

    def captured(self) -> frozenset[BatchDescriptor]:
        """The keys of the entries still alive: the manager freed the others."""
        return frozenset(entry.descriptor for entry in self._alive)


def _callers_extra(descriptor: BatchDescriptor) -> Mapping[str, object]:
    """The extras of the manager's context around a warm-up or recording (the attention's metadata).

    The manager calls the engine without a context, or with ``(NONE, descriptor, **extras)``.
    """
    context = get_forward_context()
    if context is None:
        return {}
    assert context.runtime_mode is CUDAGraphMode.NONE
    assert context.batch_descriptor == descriptor
    return context.extra


def _leaves(output: object) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [as_tensor(v) for v in output.values()]
    assert isinstance(output, (tuple, list))
    return [as_tensor(v) for v in output]


class FakeEngines:
    """A ``GraphEngineFactory`` of ``FakeGraphEngine``s that keeps what it built.

    ``on_capture`` runs at each recording (tests use it to observe the capture
    phase, or to make a capture fail).
    """

    def __init__(self, on_capture: Callable[[], None] = lambda: None) -> None:
        self.engines: dict[CUDAGraphMode, FakeGraphEngine[object]] = {}
        self.on_capture = on_capture

    def __call__(
        self, model: Callable[..., R], mode: CUDAGraphMode, options: CaptureOptions
    ) -> FakeGraphEngine[R]:
        assert mode not in self.engines, "the manager builds one engine per mode"
        engine = FakeGraphEngine(model, mode, lambda: self.on_capture())
        self.engines[mode] = cast("FakeGraphEngine[object]", engine)
        return engine


# ---------------------------------------------------------------------------
# Backends, managers, batches
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Backend:
    """Where a test runs: the device, and the engines (``None``: the real ones)."""

    name: str
    device: torch.device
    engines: FakeEngines | None

    @classmethod
    def of(cls, name: str) -> Backend:
        if name == "cpu":
            return cls(name, torch.device("cpu"), FakeEngines())
        assert name == "cuda"
        return cls(name, torch.device("cuda", torch.cuda.current_device()), None)

    @property
    def factory(self) -> GraphEngineFactory | None:
        return self.engines

    @property
    def foreign_device(self) -> torch.device:
        """A device whose tensors the manager must reject."""
        return torch.device("meta") if self.device.type == "cpu" else torch.device("cpu")


def config_for(
    mode: CUDAGraphMode,
    *,
    sizes: tuple[int, ...] = SIZES,
    max_num_seqs: int = MAX_NUM_SEQS,
    query_len: int = 1,
    lora_counts: tuple[int, ...] = (),
) -> DispatchConfig:
    return DispatchConfig(mode, CaptureSizes(sizes), max_num_seqs, query_len, lora_counts)


def make_manager(
    backend: Backend,
    model: Callable[..., torch.Tensor],
    mode: CUDAGraphMode = CUDAGraphMode.FULL,
    *,
    strict: bool = False,
    config: DispatchConfig | None = None,
) -> CUDAGraphManager[torch.Tensor]:
    """A manager of ``model`` over ``INPUTS`` (not captured yet)."""
    return CUDAGraphManager(
        model,
        INPUTS,
        config_for(mode) if config is None else config,
        device=backend.device,
        strict=strict,
        options=ManagerOptions(engine_factory=backend.factory),
    )


def make_batch(num_tokens: int, num_reqs: int, device: torch.device, *, seed: int) -> dict[str, torch.Tensor]:
    """Fresh random inputs for ``INPUTS`` (ids never 0, scales never 1: not the pad values)."""
    g = torch.Generator().manual_seed(seed)
    batch = {
        "ids": torch.randint(1, VOCAB, (num_tokens,), generator=g),  # [T]
        "x": torch.randn(num_tokens, DIM, generator=g),  # [T, DIM]
        "scale": torch.rand(num_reqs, generator=g) + 1.5,  # [R], in [1.5, 2.5)
        "bias": torch.randn(DIM, generator=g),  # [DIM]
    }
    return {name: t.to(device) for name, t in batch.items()}


def snapshot(buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Private copies of the static buffers, to check later that nothing wrote to them."""
    return {name: b.clone() for name, b in buffers.items()}


def assert_unchanged(before: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor]) -> None:
    for name, kept in before.items():
        assert torch.equal(buffers[name], kept), f"static buffer {name!r} was written"


class FirstRecordingGate:
    """An ``on_capture`` hook for ``FakeEngines`` that holds the first recording until ``open()``.

    ``entered`` is set once the first recording (the largest key) is under
    way; it then waits for the gate, at most ``timeout`` seconds.
    """

    def __init__(self, timeout: float) -> None:
        self.entered = threading.Event()
        self._gate = threading.Event()
        self._timeout = timeout

    def __call__(self) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self._gate.wait(self._timeout)

    def open(self) -> None:
        self._gate.set()

    def manager_on_cpu(self, model: ToyModel) -> CUDAGraphManager[torch.Tensor]:
        """A FULL manager of ``model`` on the CPU whose fake engines pass through this gate."""
        return CUDAGraphManager(
            model,
            INPUTS,
            config_for(CUDAGraphMode.FULL),
            device="cpu",
            options=ManagerOptions(engine_factory=FakeEngines(self)),
        )
