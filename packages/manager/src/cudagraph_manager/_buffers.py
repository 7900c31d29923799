"""The static-input side of the manager: the buffers, the per-step check, the copy in.

A graph reads its inputs from the addresses it was captured with, so each
declared input gets one buffer, allocated once; every graph sees a view of it
(a ``Slot``). A step's tensors are checked against the declarations before a
buffer is touched, then copied into one graph's views with the rest padded.
The check and the copy run every step, so their loops work on values
precomputed here (row kinds as small ints, shapes as tuples).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Final, TypeAlias

import torch

from ._static import StaticInput

_Tensor: Final = torch.Tensor

#: Keyword arguments of ``run`` itself: no model input may be named so.
RESERVED_NAMES: Final = frozenset({"uniform_decode", "num_active_loras", "invalid_modes"})

# Row kinds of an input, as small ints for the per-step loops.
TOKENS: Final = 0
REQS: Final = 1
WHOLE: Final = 2
_KINDS: Final = {"tokens": TOKENS, "reqs": REQS, None: WHOLE}

# What the per-step check needs of one input: (name, dtype, ndim, trailing shape or whole shape, kind).
_Check: TypeAlias = tuple[str, torch.dtype, int, tuple[int, ...], int]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Input:
    """One declared input and the static buffer that holds it."""

    name: str
    spec: StaticInput
    kind: int  # TOKENS, REQS or WHOLE
    buffer: torch.Tensor  # [max rows, *spec.shape], or spec.shape for WHOLE


class Slot:
    """One input as one graph sees it: a view of the buffer, and how to fill it."""

    __slots__ = ("_splits", "kind", "name", "pad_value", "rows", "view")

    def __init__(self, source: Input, rows: int) -> None:
        self.name = source.name
        self.kind = source.kind
        self.pad_value = source.spec.pad_value
        self.rows = rows  # the graph's row count for this input; -1 for WHOLE
        self.view = source.buffer if source.kind == WHOLE else source.buffer[:rows]  # [rows, *shape]
        self._splits: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def split(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(view[:n], view[n:])``: the real rows and the padding.

        Cached per row count (slicing costs microseconds; at most ``rows`` entries).
        """
        pair = self._splits.get(n)
        if pair is None:
            pair = self._splits[n] = (self.view[:n], self.view[n:])
        return pair


def check_inputs_spec(inputs: Mapping[str, StaticInput]) -> dict[str, StaticInput]:
    """The declared inputs, validated: names usable as keywords, at least one "tokens" input."""
    given: object = inputs
    if not isinstance(given, Mapping) or not given:
        raise ValueError(f"inputs: expected a non-empty mapping of names to StaticInput, got {inputs!r}")
    checked: dict[str, StaticInput] = {}
    for name, spec in inputs.items():
        given_name: object = name  # checked at run time: callers may not be typed
        if not isinstance(given_name, str) or not given_name.isidentifier():
            raise ValueError(f"inputs: names are passed as keywords, so must be identifiers, got {name!r}")
        if name in RESERVED_NAMES:
            raise ValueError(f"inputs[{name!r}]: the name is a keyword of run() itself; rename the input")
        if not isinstance(spec, StaticInput):
            raise ValueError(f"inputs[{name!r}]: expected a StaticInput, got {spec!r}")
        checked[name] = spec
    if not any(spec.rows == "tokens" for spec in checked.values()):
        raise ValueError(
            "inputs: at least one input needs rows='tokens': its row count is the batch's num_tokens"
        )
    return checked


def allocate(
    inputs: Mapping[str, StaticInput], max_tokens: int, max_num_seqs: int, device: torch.device
) -> tuple[Input, ...]:
    """One buffer per declared input on ``device``, filled with its ``pad_value``.

    ``max_tokens`` rows for a "tokens" input, ``max_num_seqs`` for a "reqs"
    one: the largest graph's rows, so every graph's view fits in it.
    """
    max_rows = {TOKENS: max_tokens, REQS: max_num_seqs}
    sources: list[Input] = []
    for name, spec in inputs.items():
        kind = _KINDS[spec.rows]
        shape = spec.shape if kind == WHOLE else (max_rows[kind], *spec.shape)
        buffer = torch.full(shape, spec.pad_value, dtype=spec.dtype, device=device)
        sources.append(Input(name, spec, kind, buffer))
    return tuple(sources)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class InputChecker:
    """``run``'s check of a step's inputs against the declared ones, before any buffer is touched.

    Holds exactly what the check reads, precomputed once (``of``), so the
    manager binds ``check`` once and calls it once per step.
    """

    checks: tuple[_Check, ...]  # one per declared input, in declaration order
    device: torch.device
    max_num_seqs: int
    query_len: int  # uniform_decode_query_len

    @classmethod
    def of(
        cls, inputs: tuple[Input, ...], device: torch.device, max_num_seqs: int, query_len: int
    ) -> InputChecker:
        checks = tuple(
            (s.name, s.spec.dtype, len(s.spec.shape) + (s.kind != WHOLE), s.spec.shape, s.kind)
            for s in inputs
        )
        return cls(checks, device, max_num_seqs, query_len)

    def check(self, inputs: Mapping[str, torch.Tensor], uniform_decode: bool) -> tuple[int, int, bool]:
        """``(num_tokens, num_reqs, any input requires grad)``; ``num_reqs`` is -1 without "reqs" inputs.

        Cheap by design (this is per step): dtype and device are compared as
        objects, shapes as tuples.
        """
        if len(inputs) != len(self.checks):
            raise self._names_error(inputs)
        device = self.device
        num_tokens = num_reqs = -1
        tokens_from = reqs_from = ""
        grad = False
        for name, dtype, ndim, shape, kind in self.checks:
            x = inputs.get(name)
            if x.__class__ is not _Tensor and not isinstance(x, _Tensor):
                if name not in inputs:
                    raise self._names_error(inputs)
                raise ValueError(f"run: input {name!r}: expected a torch.Tensor, got {type(x).__name__}")
            assert x is not None
            if x.dtype is not dtype:
                raise ValueError(f"run: input {name!r}: expected dtype {dtype}, got {x.dtype}")
            if x.device != device:
                raise ValueError(f"run: input {name!r}: expected a tensor on {device}, got one on {x.device}")
            size = x.shape
            if kind == WHOLE:
                if size != shape:
                    raise ValueError(
                        f"run: input {name!r}: expected shape {shape} (not batched), got {tuple(size)}"
                    )
            else:
                if len(size) != ndim or size[1:] != shape:
                    raise ValueError(
                        f"run: input {name!r}: expected shape [rows, *{shape}], got {tuple(size)}"
                    )
                rows = size[0]
                if kind == TOKENS:
                    if num_tokens < 0:
                        num_tokens, tokens_from = rows, name
                    elif rows != num_tokens:
                        raise ValueError(
                            f"run: input {name!r}: {rows} rows, but input {tokens_from!r} has {num_tokens}; "
                            "all 'tokens' inputs have num_tokens rows"
                        )
                elif num_reqs < 0:
                    num_reqs, reqs_from = rows, name
                elif rows != num_reqs:
                    raise ValueError(
                        f"run: input {name!r}: {rows} rows, but input {reqs_from!r} has {num_reqs}; "
                        "all 'reqs' inputs have num_reqs rows"
                    )
            if x.requires_grad:
                grad = True
        if num_reqs >= 0:
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
            if uniform_decode and num_tokens != num_reqs * self.query_len:
                raise ValueError(
                    f"uniform_decode: a uniform decode batch has num_reqs * {self.query_len} tokens, "
                    f"got {num_tokens} tokens for {num_reqs} requests"
                )
        return num_tokens, num_reqs, grad

    def _names_error(self, inputs: Mapping[str, object]) -> ValueError:
        expected = [name for name, *_ in self.checks]
        missing = [n for n in expected if n not in inputs]
        unknown = sorted(n for n in inputs if n not in expected)
        parts = [f"missing input(s) {missing}"] if missing else []
        parts += [f"unknown input(s) {unknown}"] if unknown else []
        return ValueError(f"run: {'; '.join(parts)}; expected exactly {expected}")


def load(slots: tuple[Slot, ...], inputs: Mapping[str, torch.Tensor], num_tokens: int, num_reqs: int) -> None:
    """Copy the batch into one graph's views of the static buffers; pad the rest.

    Real rows first, then the padding rows, so an input that already is (a
    prefix of) its static buffer is not overwritten before it is read.
    """
    for slot in slots:
        src = inputs[slot.name]  # [n, *shape], or shape for WHOLE
        kind = slot.kind
        if kind == WHOLE:
            slot.view.copy_(src)
            continue
        n = num_tokens if kind == TOKENS else num_reqs
        if n == slot.rows:
            slot.view.copy_(src)
        else:
            head, tail = slot.split(n)
            head.copy_(src)
            tail.fill_(slot.pad_value)
