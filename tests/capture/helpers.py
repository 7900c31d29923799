"""Shared pieces of the capture tests: small models, an error metric, call counters.

Everything here is typed: ``nn.Module.__call__`` returns ``Any`` in torch's
stubs, so models are called through :func:`as_tensor`, which narrows and checks
the result instead of letting ``Any`` spread into the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Final, Literal, Protocol

import torch
from torch import nn
from torch.nn.functional import gelu, linear

from cudagraph_capture import (
    BreakableCUDAGraphWrapper,
    CaptureOptions,
    CUDAGraphWrapper,
    eager_break_during_capture,
)
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, set_forward_context
from tests.torch_support import as_tensor as as_tensor
from tests.torch_support import highest_fp32_matmul_precision as highest_fp32_matmul_precision
from tests.torch_support import rel_err as rel_err

#: Relative error allowed between a replay and eager on the same fp32 data.
#: Replays run the same kernels as eager; cuBLAS may still pick another
#: algorithm under capture, which moves the last bits only.
FP32_TOL: Final = 1e-5
#: The same for bf16/fp16 models.
HALF_TOL: Final = 2e-2

#: Width of the small test models: tiny, so the GPU suite stays fast.
DIM: Final = 64
HIDDEN: Final = 128

#: Token counts captured by the tests, largest first (the capture order of a
#: serving engine); 3 is deliberately not a power of two.
SIZES: Final[tuple[int, ...]] = (24, 8, 3, 1)

#: GPU cycles of a ``_cuda_sleep`` long enough (tens of ms) that a missing
#: stream dependency turns into a wrong result instead of a lucky race.
SLEEP_CYCLES: Final = 50_000_000

Engine = Literal["monolithic", "breakable"]


def cuda() -> torch.device:
    """The CUDA device the tests run on."""
    return torch.device("cuda", torch.cuda.current_device())


def fill_fresh_(buf: torch.Tensor) -> torch.Tensor:
    """Copy fresh ``randn`` data into ``buf`` in place; return a private copy of it."""
    data = torch.randn(buf.shape, dtype=buf.dtype, device=buf.device)
    buf.copy_(data)
    return data


def new_stream() -> torch.cuda.Stream:
    """A new CUDA stream on the current device."""
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch's Stream.__new__ is unannotated


def sleep_gpu(cycles: int = SLEEP_CYCLES) -> None:
    """Queue a busy-wait kernel on the current stream (the host does not wait)."""
    torch._C._cuda_sleep(cycles)


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def _init_linear(
    out_features: int, in_features: int, device: torch.device, dtype: torch.dtype
) -> nn.Parameter:
    weight = torch.randn(out_features, in_features, device=device, dtype=dtype) / math.sqrt(in_features)
    return nn.Parameter(weight, requires_grad=False)


class TinyMLP(nn.Module):
    """``x + W2 gelu(W1 x + b1)``: a few kernels, fp32 unless told otherwise."""

    #: Read through a wrapper to test attribute fall-through.
    marker: str = "tiny-mlp"

    def __init__(
        self,
        dim: int = DIM,
        hidden: int = HIDDEN,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        device = cuda() if device is None else device
        self.hidden = hidden
        self.w1 = _init_linear(hidden, dim, device, dtype)
        self.b1 = nn.Parameter(torch.randn(hidden, device=device, dtype=dtype), requires_grad=False)
        self.w2 = _init_linear(dim, hidden, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, dim] -> [tokens, dim]
        h = gelu(linear(x, self.w1, self.b1))
        return x + linear(h, self.w2)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """Typed call of the module (``nn.Module.__call__`` returns ``Any``)."""
        return as_tensor(self(x))


class CountingSiLU:
    """An eager-break op, ``out = silu(src)``, that counts its Python calls.

    Decorated with ``eager_break_during_capture``: a break point inside a
    breakable capture, a plain call (captured inline) anywhere else. It writes
    into the caller's buffer and returns nothing, as the contract asks.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.capturing: list[bool] = []
        self._op = eager_break_during_capture(self._silu_into)

    def _silu_into(self, src: torch.Tensor, out: torch.Tensor) -> None:
        self.calls += 1
        self.capturing.append(torch.cuda.is_current_stream_capturing())
        torch.mul(src, torch.sigmoid(src), out=out)

    def __call__(self, src: torch.Tensor, out: torch.Tensor) -> None:
        self._op(src, out)


class MLPWithBreak(nn.Module):
    """``x + W2 silu(W1 x)`` with the SiLU as an eager-break op.

    Under a breakable capture it becomes two graph segments around one eager
    break; under a monolithic capture the SiLU is captured inline.
    """

    marker: str = "mlp-with-break"

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN, *, device: torch.device | None = None) -> None:
        super().__init__()
        device = cuda() if device is None else device
        self.hidden = hidden
        self.w1 = _init_linear(hidden, dim, device, torch.float32)
        self.w2 = _init_linear(dim, hidden, device, torch.float32)
        self.silu = CountingSiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, dim]; h, act: [tokens, hidden] (act allocated in the segment)
        h = linear(x, self.w1)
        act = torch.empty_like(h)
        self.silu(h, act)
        return x + linear(act, self.w2)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """Typed call of the module."""
        return as_tensor(self(x))


class CallCounter:
    """Wraps ``fn(x) -> tensor``; counts Python calls and whether each ran under capture.

    A replay must run no Python of the wrapped body, so ``calls`` stays put
    across replays; ``capturing`` tells captures from pass-through calls.
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn
        self.calls = 0
        self.capturing: list[bool] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.capturing.append(torch.cuda.is_current_stream_capturing())
        return self.fn(x)

    @property
    def captures(self) -> int:
        """Calls made under graph capture (an engine may also run eager warm-ups)."""
        return sum(self.capturing)


# ---------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------


class GraphWrapper(Protocol):
    """What the tests use of either engine's wrapper."""

    def __call__(self, x: torch.Tensor, /) -> object: ...

    @property
    def num_captured(self) -> int: ...

    def clear(self) -> None: ...

    def unwrap(self) -> object: ...


#: (engine, forward-context mode) pairs that capture: the monolithic wrapper
#: is built with the mode it captures; the breakable one captures any mode.
CAPTURING_CASES: Final[tuple[tuple[Engine, CUDAGraphMode], ...]] = (
    ("monolithic", CUDAGraphMode.FULL),
    ("monolithic", CUDAGraphMode.PIECEWISE),
    ("breakable", CUDAGraphMode.PIECEWISE),
    ("breakable", CUDAGraphMode.FULL),
)
#: One capturing case per engine, for the contract tests.
ENGINE_CASES: Final[tuple[tuple[Engine, CUDAGraphMode], ...]] = (
    ("monolithic", CUDAGraphMode.FULL),
    ("breakable", CUDAGraphMode.PIECEWISE),
)


def case_id(case: tuple[Engine, CUDAGraphMode]) -> str:
    """Test id of an (engine, mode) case."""
    return f"{case[0]}-{case[1].name}"


def make_wrapper(
    engine: Engine,
    runnable: Callable[[torch.Tensor], torch.Tensor],
    mode: CUDAGraphMode,
    options: CaptureOptions | None = None,
) -> GraphWrapper:
    """The engine's wrapper around ``runnable``, capturing under ``mode``."""
    if engine == "monolithic":
        return CUDAGraphWrapper(runnable, mode, options)
    return BreakableCUDAGraphWrapper(runnable, options)


def call(
    wrapper: Callable[[torch.Tensor], object],
    x: torch.Tensor,
    mode: CUDAGraphMode | None,
    descriptor: BatchDescriptor | None = None,
) -> torch.Tensor:
    """Call ``wrapper(x)`` under ``set_forward_context(mode, descriptor)`` (no context for ``None``)."""
    if mode is None:
        return as_tensor(wrapper(x))
    with set_forward_context(mode, descriptor):
        return as_tensor(wrapper(x))


def warm_up(fn: Callable[[torch.Tensor], torch.Tensor], buf: torch.Tensor, sizes: Sequence[int]) -> None:
    """One eager run per size (what an engine does before capture), then a sync."""
    for n in sizes:
        fn(buf[:n])
    torch.cuda.synchronize()
