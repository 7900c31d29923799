"""The model's outputs: their structure, and cutting graph outputs back to the real rows.

A graph computes the padded batch; the caller wants the rows of its real
batch. Which count an output's leading dimension follows (tokens, requests,
or none) is declared once, checked against the warm-up's outputs, and used to
slice every replay's outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal, TypeAlias

import torch

from ._static import Rows

#: ``output_rows``: one ``Rows`` for every output; for a dict output, a mapping
#: by key (keys left out follow tokens); for a tuple or list output, one
#: ``Rows`` per position.
OutputRows: TypeAlias = Rows | Mapping[str, Rows] | tuple[Rows, ...]

#: ``output_rows`` once checked (a mapping copied to a dict).
RowsSpec: TypeAlias = Rows | dict[str, Rows] | tuple[Rows, ...]

_Kind: TypeAlias = Literal["tensor", "tuple", "list", "dict"]


def check_output_rows(spec: object) -> RowsSpec:
    """``spec`` if it is a valid ``output_rows`` value, else a ``ValueError``."""
    if spec is None or isinstance(spec, str):
        return _check_rows("output_rows", spec)
    if isinstance(spec, Mapping):
        by_key: dict[str, Rows] = {}
        for key, rows in spec.items():
            if not isinstance(key, str):
                raise ValueError(
                    f"output_rows: a mapping is keyed by the output dict's keys (str), got {key!r}"
                )
            by_key[key] = _check_rows(f"output_rows[{key!r}]", rows)
        return by_key
    if isinstance(spec, tuple):
        return tuple(_check_rows(f"output_rows[{i}]", rows) for i, rows in enumerate(spec))
    raise ValueError(
        f"output_rows: expected 'tokens', 'reqs', None, a mapping or a tuple of them, got {spec!r}"
    )


def _check_rows(field: str, rows: object) -> Rows:
    if rows == "tokens" or rows == "reqs" or rows is None:
        return rows
    raise ValueError(f"{field}: expected 'tokens', 'reqs' or None, got {rows!r}")


def uses_reqs(spec: RowsSpec) -> bool:
    """True when some output is declared to follow the request count."""
    if isinstance(spec, dict):
        return "reqs" in spec.values()
    if isinstance(spec, tuple):
        return "reqs" in spec
    return spec == "reqs"


@dataclasses.dataclass(frozen=True, slots=True)
class OutputLayout:
    """The structure of the model's output and the rows each of its tensors follows."""

    kind: _Kind
    keys: tuple[str | int, ...]  # dict keys, or 0..n-1 for a tuple or list; () for one tensor
    rows: tuple[Rows, ...]  # one per tensor, in output order

    @classmethod
    def of(cls, output: object, spec: RowsSpec) -> OutputLayout:
        """The layout of ``output`` (a warm-up's result), with rows resolved from ``spec``."""
        keys: tuple[str | int, ...]
        tensors: list[object]
        kind: _Kind
        if isinstance(output, torch.Tensor):
            kind, keys, tensors = "tensor", (), [output]
        elif type(output) is tuple or type(output) is list:
            kind = "tuple" if type(output) is tuple else "list"
            tensors = list(output)
            keys = tuple(range(len(tensors)))
        elif type(output) is dict:
            named: dict[object, object] = output
            if not all(isinstance(k, str) for k in named):
                raise ValueError(f"model output: dict keys must be str, got {list(named)!r}")
            kind, keys, tensors = "dict", tuple(str(k) for k in named), list(named.values())
        else:
            raise ValueError(
                "model output: expected a tensor or a tuple, list or dict of tensors, "
                f"got {type(output).__name__}"
            )
        labels = keys if kind != "tensor" else ("",)
        for label, value in zip(labels, tensors, strict=True):
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{_name(kind, label)}: expected a tensor, got {type(value).__name__}")
        rows: tuple[Rows, ...]
        if isinstance(spec, dict):
            if kind != "dict":
                raise ValueError(
                    f"output_rows: a mapping needs a dict output, but the model returns a {kind}"
                )
            unknown = [k for k in spec if k not in keys]
            if unknown:
                raise ValueError(f"output_rows: no output named {unknown!r}; the outputs are {list(keys)!r}")
            rows = tuple(spec.get(str(k), "tokens") for k in keys)
        elif isinstance(spec, tuple):
            if kind not in ("tuple", "list") or len(spec) != len(keys):
                count = f"{len(keys)} tensors" if kind != "tensor" else "1 tensor"
                raise ValueError(
                    f"output_rows: a tuple gives one entry per tensor of a tuple or list output; "
                    f"got {len(spec)} entries for a {kind} of {count}"
                )
            rows = spec
        else:
            rows = (spec,) * len(labels)
        return cls(kind, keys, rows)

    @property
    def labels(self) -> tuple[str | int, ...]:
        """One label per tensor: its key or index ("" for a single tensor)."""
        return self.keys if self.kind != "tensor" else ("",)

    def check(self, output: object, num_tokens: int, num_reqs: int) -> None:
        """``output`` has this layout and the row counts of a graph of that size, else ``ValueError``."""
        now = OutputLayout.of(output, "tokens")  # raises on an invalid structure
        if (now.kind, now.keys) != (self.kind, self.keys):
            raise ValueError(
                "model output: its structure changed between batch sizes "
                f"(first a {self.kind} {list(self.keys)!r}, now a {now.kind} {list(now.keys)!r})"
            )
        for key, rows, tensor in zip(self.labels, self.rows, _tensors(output), strict=True):
            if rows is None:
                continue
            expected = num_tokens if rows == "tokens" else num_reqs
            if tensor.dim() == 0 or tensor.shape[0] != expected:
                raise ValueError(
                    f"{_name(self.kind, key)}: shape {tuple(tensor.shape)} does not have the {expected} "
                    f"rows of the batch's {rows!r} count; declare its rows in output_rows "
                    "('tokens', 'reqs' or None)"
                )

    def cut(self, output: object, num_tokens: int, num_reqs: int) -> object:
        """``output`` with each batched tensor sliced to the real rows (views, no copies)."""
        if self.kind == "tensor":
            assert isinstance(output, torch.Tensor)
            return _cut(output, self.rows[0], num_tokens, num_reqs)
        tensors = [
            _cut(t, rows, num_tokens, num_reqs) for t, rows in zip(_tensors(output), self.rows, strict=True)
        ]
        if self.kind == "dict":
            return {str(k): t for k, t in zip(self.keys, tensors, strict=True)}
        return tuple(tensors) if self.kind == "tuple" else tensors


def _cut(tensor: torch.Tensor, rows: Rows, num_tokens: int, num_reqs: int) -> torch.Tensor:
    if rows is None:
        return tensor
    n = num_tokens if rows == "tokens" else num_reqs
    return tensor if tensor.shape[0] == n else tensor[:n]


def _tensors(output: object) -> list[torch.Tensor]:
    """The tensors of an output of a known-valid layout, in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return list(output.values())
    assert isinstance(output, (tuple, list))
    return list(output)


def _name(kind: _Kind, key: str | int) -> str:
    return "model output" if kind == "tensor" else f"model output[{key!r}]"
