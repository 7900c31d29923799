"""Static buffers: one per declared input, allocated once, refilled in place every step.

A graph reads its inputs at the addresses it was captured with. Each declared
input gets one ``StaticBuffer`` holding its largest row count; a graph of
``g`` rows reads the buffer's first ``g`` rows. A step's tensors are checked
against the declarations before any buffer is touched, then each is copied
into the first rows of its buffer and the graph's remaining rows are filled
with the input's pad value. A decode loop's state lives at fixed addresses
too (``LoopBuffers``): its graphs read and write it on the device.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Mapping
from typing import Final, Generic, TypeAlias

import torch

from .._values._inputs import Rows, StaticInput
from .._values._loop import DecodeLoop, LoopState
from .._values._protocols import OutputT

_Tensor: Final = torch.Tensor
_STRIDED: Final = torch.strided
_KINDS: Final = ("tokens", "reqs")
_NO_LORAS: Final = 0  # run()'s default num_active_loras; more adapters than requests: refused
_Inputs: TypeAlias = Mapping[str, torch.Tensor]  # a step's tensors by input name
#: This package's folder (its modules' frames lie under it).
_PACKAGE: Final = os.path.dirname(os.path.dirname(__file__)) + os.sep


class StaticBuffer:
    """One input's static buffer: its rows, its views for a row count, the checks of a step tensor.

    ``tensor`` is ``[max rows, *shape]`` (``shape`` for an unbatched input).
    Views are cut once per row count and kept: slicing a tensor is host
    time on the step path, and a step needs two views per input
    (docs/benchmarks-notes.md says where to measure it).
    """

    __slots__ = (
        "_views",
        "device",
        "dtype",
        "name",
        "ndim",
        "pad_value",
        "rows",
        "shape",
        "splits",
        "tensor",
    )

    def __init__(self, name: str, spec: StaticInput, max_rows: int, device: torch.device) -> None:
        self.name: Final = name
        self.rows: Final[Rows] = spec.rows
        self.dtype: Final = spec.dtype
        self.shape: Final = spec.shape  # trailing dims; the whole shape of an unbatched input
        self.ndim: Final = len(spec.shape) + (spec.rows is not None)  # of a step's tensor
        self.pad_value: Final = spec.pad_value
        self.device: Final = device
        full_shape = spec.shape if spec.rows is None else (max_rows, *spec.shape)
        self.tensor: Final = torch.full(full_shape, spec.pad_value, dtype=spec.dtype, device=device)
        self._views: dict[int, torch.Tensor] = {}
        #: ``(real rows, padding rows)`` by ``(rows, graph rows)``, cut once by ``split``.
        self.splits: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def view(self, rows: int) -> torch.Tensor:
        """The first ``rows`` rows (the whole buffer when unbatched): what a graph of that size reads."""
        if self.rows is None:
            return self.tensor
        view = self._views.get(rows)
        if view is None:
            view = self._views[rows] = self.tensor[:rows]  # [rows, *shape]
        return view

    def check(self, x: object) -> int:
        """The row count of step tensor ``x`` (0 when unbatched); ``ValueError`` naming the input."""
        if x.__class__ is not _Tensor and not isinstance(x, _Tensor):
            raise ValueError(f"run: input {self.name!r}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype is not self.dtype:
            raise ValueError(f"run: input {self.name!r}: expected dtype {self.dtype}, got {x.dtype}")
        if x.layout is not _STRIDED:
            raise ValueError(
                f"run: input {self.name!r}: expected a dense (strided) tensor, got layout {x.layout}"
            )
        if x.device != self.device:
            raise ValueError(
                f"run: input {self.name!r}: expected a tensor on {self.device}, got one on {x.device}"
            )
        size = x.shape
        if self.rows is None:
            if size != self.shape:
                raise ValueError(
                    f"run: input {self.name!r}: expected shape {self.shape} (not batched), got {tuple(size)}"
                )
            return 0
        if len(size) != len(self.shape) + 1 or size[1:] != self.shape:
            raise ValueError(
                f"run: input {self.name!r}: expected shape [rows, *{self.shape}], got {tuple(size)}"
            )
        rows: int = size[0]
        return rows

    def split(self, rows: int, graph_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(real rows, padding rows)`` of a step of ``rows`` padded to ``graph_rows`` (cut once, kept)."""
        split = self.splits.get((rows, graph_rows))
        if split is None:
            split = self.splits[(rows, graph_rows)] = (self.tensor[:rows], self.tensor[rows:graph_rows])
        return split


class StaticBuffers:
    """Every declared input's buffer: the step's checks across inputs, and the copy in."""

    __slots__ = ("_firsts", "buffers", "device", "max_num_seqs", "uniform_decode_query_len", "warned_grad")

    def __init__(
        self,
        inputs: Mapping[str, StaticInput],
        *,
        max_tokens: int,
        max_num_seqs: int,
        uniform_decode_query_len: int,
        device: torch.device,
    ) -> None:
        max_rows: dict[Rows, int] = {"tokens": max_tokens, "reqs": max_num_seqs, None: 0}
        _check_sizes(inputs, max_rows, device)  # before any buffer is allocated
        self.buffers: Final = tuple(
            StaticBuffer(name, spec, max_rows[spec.rows], device) for name, spec in inputs.items()
        )
        #: The first "tokens" and "reqs" inputs, whose rows name the counts ("": none of the kind).
        self._firsts: Final = tuple(
            next((b.name for b in self.buffers if b.rows == kind), "") for kind in _KINDS
        )
        self.max_num_seqs: Final = max_num_seqs
        self.uniform_decode_query_len: Final = uniform_decode_query_len
        self.device: Final = device
        self.warned_grad = False  # a step's input required grad: warned once (per manager)

    def first(self, rows: Rows) -> str:
        """The first input whose rows are ``rows`` (its row count names the batch's count; ``""``: none)."""
        return self._firsts[_KINDS.index(rows)] if rows is not None else ""

    def views(self, num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        """What a graph of ``num_tokens`` tokens and ``num_reqs`` requests reads, by input name."""
        return {b.name: b.view(num_reqs if b.rows == "reqs" else num_tokens) for b in self.buffers}

    def fill_padding(self, num_tokens: int, num_reqs: int) -> None:
        """Fill a graph's batched views with pad values (before its warm-up and capture run the model)."""
        for b in self.buffers:
            if b.rows is not None:
                b.view(num_reqs if b.rows == "reqs" else num_tokens).fill_(b.pad_value)

    def check(self, inputs: _Inputs, uniform_decode: bool, loras: object = 0) -> tuple[int, int, bool]:
        """``(num_tokens, num_reqs, requires_grad)`` of a step's inputs; ``ValueError`` names a bad input."""
        if len(inputs) != len(self.buffers):
            raise self._names_error(inputs)
        num_tokens = num_reqs = 0
        requires_grad = False
        first_tokens, first_reqs = self._firsts  # the inputs whose rows name num_tokens and num_reqs
        for b in self.buffers:
            x = inputs.get(b.name)
            size = x.shape if x.__class__ is _Tensor else None  # the usual step inline: a plain tensor
            if (
                size is not None
                and x.dtype is b.dtype  # type: ignore[union-attr]  # a Tensor
                and x.layout is _STRIDED  # type: ignore[union-attr]  # a Tensor
                and x.device == b.device  # type: ignore[union-attr]  # a Tensor
                and (size == b.shape if b.rows is None else len(size) == b.ndim and size[1:] == b.shape)
            ):
                rows: int = 0 if b.rows is None else size[0]
            else:  # the slow path: names what is wrong (or accepts a tensor subclass)
                rows = self._slow_rows(b, x, inputs)
            requires_grad = requires_grad or x.requires_grad  # type: ignore[union-attr]  # a tensor
            if b.rows == "tokens":
                if rows != num_tokens and b.name is not first_tokens:
                    raise self._row_count_error(b, rows, num_tokens)
                num_tokens = rows
            elif b.rows == "reqs":
                if rows != num_reqs and b.name is not first_reqs:
                    raise self._row_count_error(b, rows, num_reqs)
                num_reqs = rows
        if first_reqs and (
            num_reqs > self.max_num_seqs
            or num_reqs > num_tokens
            or (num_reqs == 0 and num_tokens > 0)
            or (uniform_decode is True and num_tokens != num_reqs * self.uniform_decode_query_len)
            or (loras is not _NO_LORAS and isinstance(loras, int) and loras > num_reqs)
        ):
            self._check_requests(num_tokens, num_reqs, uniform_decode, loras)  # names the input
        if requires_grad and not self.warned_grad:  # the step's one branch for it
            self._warn_requires_grad(inputs)
        return num_tokens, num_reqs, requires_grad

    def _slow_rows(self, b: StaticBuffer, x: torch.Tensor | None, inputs: Mapping[str, torch.Tensor]) -> int:
        """The rows of input ``x`` off the usual path: its buffer's check names what is wrong."""
        if x is None and b.name not in inputs:
            raise self._names_error(inputs)
        return b.check(x)

    def _row_count_error(self, b: StaticBuffer, rows: int, first_rows: int) -> ValueError:
        """The error of ``b``'s input, whose ``rows`` differ from the first input of its kind of rows."""
        return ValueError(
            f"run: input {b.name!r}: {rows} rows, but input {self.first(b.rows)!r} has {first_rows}; "
            f"all {b.rows!r} inputs have num_{b.rows} rows"
        )

    def _warn_requires_grad(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Say once that outputs are detached from the inputs that require grad, naming them."""
        self.warned_grad = True
        names = [b.name for b in self.buffers if inputs[b.name].requires_grad]
        warnings.warn(
            f"CUDAGraphManager.run: input(s) {names} require grad, but the outputs are detached from "
            "them: a step copies its inputs into static buffers (under no_grad) and replays a graph, "
            "so no gradient flows back to them (warned once per manager; run under torch.no_grad(), "
            "or pass tensors that do not require grad)",
            UserWarning,
            stacklevel=_caller_stacklevel(),  # the line that called run(), run_batch() or run_loop()
        )

    def copy_in(
        self,
        inputs: _Inputs,
        num_tokens: int,
        num_reqs: int,
        graph_tokens: int,
        graph_reqs: int,
        requires_grad: bool = False,
    ) -> None:
        """Copy a checked step into the buffers, padded to a graph's row counts (on the current stream).

        ``requires_grad``: some input requires grad, so the copies run under
        ``no_grad`` (they would record autograd history otherwise).
        """
        if requires_grad and torch.is_grad_enabled():
            with torch.no_grad():
                self.copy_in(inputs, num_tokens, num_reqs, graph_tokens, graph_reqs)
            return
        for b in self.buffers:
            x = inputs[b.name]
            if b.rows is None:
                b.tensor.copy_(x)
                continue
            rows, graph_rows = (num_reqs, graph_reqs) if b.rows == "reqs" else (num_tokens, graph_tokens)
            real, padding = b.splits.get((rows, graph_rows)) or b.split(rows, graph_rows)
            # Real rows first, then the padding, so an input that already is (a prefix of)
            # this buffer is read before anything overwrites it. Asynchronous, current stream.
            real.copy_(x)
            if rows != graph_rows:
                padding.fill_(b.pad_value)

    def _check_requests(self, num_tokens: int, num_reqs: int, uniform_decode: bool, loras: object) -> None:
        """``ValueError`` naming what is wrong with the step's counts (a ``bool`` count: dispatch's)."""
        reqs_from = self._firsts[1]
        if num_reqs > self.max_num_seqs:
            raise ValueError(
                f"run: input {reqs_from!r}: {num_reqs} rows (num_reqs) exceed "
                f"max_num_seqs={self.max_num_seqs}"
            )
        if num_reqs > num_tokens:
            raise ValueError(
                f"run: input {reqs_from!r}: {num_reqs} requests for {num_tokens} tokens; "
                "every request has at least one token"
            )
        if num_reqs == 0 and num_tokens > 0:
            raise ValueError(
                f"run: input {reqs_from!r}: 0 rows (num_reqs) for {num_tokens} tokens; "
                "every token belongs to a request"
            )
        if (
            uniform_decode is True and num_tokens != num_reqs * self.uniform_decode_query_len
        ):  # not-a-bool: dispatch names it
            raise ValueError(
                "uniform_decode: a uniform decode batch has num_reqs * "
                f"{self.uniform_decode_query_len} tokens, "
                f"got {num_tokens} tokens for {num_reqs} requests"
            )
        if isinstance(loras, int) and not isinstance(loras, bool) and loras > num_reqs:
            raise ValueError(
                f"num_active_loras: {loras} active adapters for {num_reqs} requests; "
                "each active adapter serves at least one request of the step"
            )

    def _names_error(self, inputs: Mapping[str, object]) -> ValueError:
        expected = [b.name for b in self.buffers]
        missing = [n for n in expected if n not in inputs]
        unknown = sorted(n for n in inputs if n not in expected)
        parts = [f"missing input(s) {missing}"] if missing else []
        parts += [f"unknown input(s) {unknown}"] if unknown else []
        return ValueError(f"run: {'; '.join(parts)}; expected exactly {expected}")


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package: its caller's line.

    Counted from the function that calls ``warnings.warn`` (level 1), however
    many of the package's frames lie between it and the caller (``run()``
    and ``run_loop()`` reach the step's checks through different paths).
    """
    frame = inspect.currentframe()
    frame = None if frame is None else frame.f_back  # the function that warns: level 1
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    return level


def _check_sizes(
    inputs: Mapping[str, StaticInput], max_rows: Mapping[Rows, int], device: torch.device
) -> None:
    """``ValueError`` naming the input whose static buffer could never fit the device's memory.

    The limit is the device's total memory (a CUDA device's, or the host's
    physical memory for the CPU): a buffer above it is a wrong shape, and
    would otherwise fail deep inside torch's allocator.
    """
    limit = _memory_bytes(device)
    if limit is None:
        return
    for name, spec in inputs.items():
        shape = spec.shape if spec.rows is None else (max_rows[spec.rows], *spec.shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=spec.dtype).element_size()
        if nbytes > limit:
            raise ValueError(
                f"inputs[{name!r}]: its static buffer {list(shape)} of {spec.dtype} needs {nbytes} bytes, "
                f"more than the {limit} bytes of {device}"
            )


def _memory_bytes(device: torch.device) -> int | None:
    """The device's total memory in bytes (``None`` where it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
        except (OSError, ValueError):
            return None
    return None


class LoopBuffers(Generic[OutputT]):
    """A manager's decode-loop state at fixed addresses, and its ``DecodeLoop``.

    ``stop`` ``[]`` bool, ``step`` ``[]`` int64 (the host loop's index),
    ``active`` ``[max_num_seqs]`` bool, ``tokens`` ``[max_steps, max_num_seqs]``
    int64; ``state`` hands ``advance`` views of them.
    """

    __slots__ = ("active", "config", "step", "stop", "tokens")

    def __init__(self, config: DecodeLoop[OutputT], max_num_seqs: int, device: torch.device) -> None:
        self.config: Final = config
        self.stop: Final = torch.zeros((), dtype=torch.bool, device=device)
        self.step: Final = torch.zeros((), dtype=torch.int64, device=device)
        self.active: Final = torch.zeros(max_num_seqs, dtype=torch.bool, device=device)
        self.tokens: Final = torch.zeros(config.max_steps, max_num_seqs, dtype=torch.int64, device=device)

    def state(self, step: torch.Tensor, num_reqs: int) -> LoopState:
        return LoopState(step, self.stop, self.active[:num_reqs], self.tokens[:, :num_reqs])

    def reset(self, num_reqs: int) -> None:
        """A new loop: ``num_reqs`` real requests active, every other row not (a shrinking loop reads all)."""
        self.active[:num_reqs].fill_(True)
        self.active[num_reqs:].fill_(False)
        self.stop.fill_(False)
