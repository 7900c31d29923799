"""The model's outputs: their structure, and cutting graph outputs back to the real rows.

A graph computes the padded batch; the caller wants the rows of its real
batch. Which count each output tensor's leading dimension follows (tokens,
requests, or none) is declared once (``output_rows``), checked against the
first outputs seen, and used to slice every step's outputs.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Final, TypeAlias, cast

import torch

from .._values._inputs import Rows

#: ``output_rows``: one ``Rows`` for every output; for a dict output, a mapping
#: by key (keys left out follow tokens); for a tuple or list output, one
#: ``Rows`` per position.
OutputRows: TypeAlias = Rows | Mapping[str, Rows] | tuple[Rows, ...]

#: ``output_rows`` once checked (a mapping copied to a dict).
RowsSpec: TypeAlias = Rows | dict[str, Rows] | tuple[Rows, ...]

_CONTAINERS = (tuple, list, dict)


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
    """The structure of the model's output and the rows each tensor follows.

    Outputs are a tensor or a flat tuple, list or dict of tensors, so the
    structure is a kind and the keys: no pytree walk on the step path.
    """

    kind: type  # torch.Tensor, tuple, list or dict
    keys: tuple[str | int | None, ...]  # one per tensor: None for a lone tensor, else index or key
    structure: str  # for errors: "a tensor []", "a tuple [0, 1]", "a dict ['a']"
    labels: tuple[str, ...]  # one per tensor, for errors: "model output" or "model output['key']"
    rows: tuple[Rows, ...]  # one per tensor, in order
    empty_leaves: tuple[torch.Tensor, ...]  # an idle step's: 0 rows, or zeros when unbatched

    @classmethod
    def of(cls, output: object, spec: RowsSpec) -> OutputLayout:
        """The layout of ``output`` (the first outputs seen), with rows resolved from ``spec``."""
        keys = _keys(output)
        labels = tuple("model output" if k is None else f"model output[{k!r}]" for k in keys)
        tensors: list[torch.Tensor] = []
        for label, leaf in zip(labels, output_leaves(output), strict=True):
            if not isinstance(leaf, torch.Tensor):
                nested = isinstance(leaf, (*_CONTAINERS, Mapping))
                raise ValueError(
                    "model output: expected a tensor or a flat tuple, list or dict of tensors, "
                    f"got a nested {type(output).__name__}"
                    if nested
                    else f"{label}: expected a tensor, got {type(leaf).__name__}"
                )
            tensors.append(leaf)
        rows = _resolve_rows(output, keys, spec)
        empty = tuple(
            t.new_zeros(t.shape) if r is None or t.dim() == 0 else t.new_empty((0, *t.shape[1:]))
            for t, r in zip(tensors, rows, strict=True)
        )
        kind = type(output) if type(output) in _CONTAINERS else torch.Tensor
        name = kind.__name__ if kind is not torch.Tensor else "tensor"
        structure = f"a {name} {[k for k in keys if k is not None]!r}"
        return cls(kind, keys, structure, labels, rows, empty)

    def check(self, output: object, num_tokens: int, num_reqs: int) -> None:
        """``output`` has this layout and a graph's row counts, else ``ValueError`` naming the output."""
        same = type(output) is self.kind or (self.kind is torch.Tensor and isinstance(output, torch.Tensor))
        if not same or _keys(output) != self.keys:
            now = OutputLayout.of(output, None)  # raises on an invalid structure
            raise ValueError(
                "model output: its structure changed between batch sizes "
                f"(first {self.structure}, now {now.structure})"
            )
        for label, rows, leaf in zip(self.labels, self.rows, output_leaves(output), strict=True):
            if not isinstance(leaf, torch.Tensor):
                raise ValueError(f"{label}: expected a tensor, got {type(leaf).__name__}")
            if rows is None:
                continue
            expected = num_tokens if rows == "tokens" else num_reqs
            if leaf.dim() == 0 or leaf.shape[0] != expected:
                raise ValueError(
                    f"{label}: shape {tuple(leaf.shape)} does not have the {expected} rows of the "
                    f"batch's {rows!r} count; declare its rows in output_rows ('tokens', 'reqs' or None)"
                )

    def cut(self, output: object, num_tokens: int, num_reqs: int) -> object:
        """``output`` with each batched tensor sliced to the real rows (views, no copies)."""
        leaves = cast("list[torch.Tensor]", output_leaves(output))  # checked when captured
        cut = [
            leaf if rows is None else leaf[: num_tokens if rows == "tokens" else num_reqs]
            for leaf, rows in zip(leaves, self.rows, strict=True)
        ]
        return self._build(cut)

    def empty(self) -> object:
        """The outputs of an idle step (0 tokens): batched tensors with 0 rows, unbatched ones zero."""
        return self._build([t.clone() for t in self.empty_leaves])

    def _build(self, leaves: list[torch.Tensor]) -> object:
        kind = self.kind
        if kind is torch.Tensor:
            return leaves[0]
        if kind is dict:
            return dict(zip(self.keys, leaves, strict=True))
        return leaves if kind is list else tuple(leaves)


class LayoutCell:
    """The output layout, set once from the first outputs seen, by whichever thread sees them first."""

    __slots__ = ("_lock", "_spec", "layout")

    def __init__(self, spec: RowsSpec) -> None:
        self._spec: Final = spec
        self._lock: Final = threading.Lock()
        self.layout: OutputLayout | None = None

    def of(self, output: object) -> OutputLayout:
        """The layout; from ``output`` if none was set yet (a capture's or an eager step's outputs)."""
        layout = self.layout
        if layout is None:
            with self._lock:  # a capture thread and the serving thread may both see first outputs
                layout = self.layout
                if layout is None:
                    layout = self.layout = OutputLayout.of(output, self._spec)
        return layout


def output_leaves(output: object) -> list[object]:
    """The parts of a model's output in order: the tensor itself, a tuple's or list's items, a dict's values.

    Anything else is one leaf, itself (the callers check what the leaves are).
    """
    if isinstance(output, dict):
        return list(output.values())
    if isinstance(output, (tuple, list)):
        return list(output)
    return [output]


def _keys(output: object) -> tuple[str | int | None, ...]:
    """One key per output tensor: ``None`` for a lone tensor, else its index or dict key."""
    if isinstance(output, torch.Tensor):
        return (None,)
    if type(output) in (tuple, list):
        assert isinstance(output, (tuple, list))
        return tuple(range(len(output)))
    if type(output) is dict:
        named: dict[object, object] = output
        if not all(isinstance(k, str) for k in named):
            raise ValueError(f"model output: dict keys must be str, got {list(named)!r}")
        return tuple(str(k) for k in named)
    raise ValueError(
        f"model output: expected a tensor or a tuple, list or dict of tensors, got {type(output).__name__}"
    )


def _resolve_rows(output: object, keys: tuple[str | int | None, ...], spec: RowsSpec) -> tuple[Rows, ...]:
    kind = type(output).__name__ if type(output) in _CONTAINERS else "tensor"
    if isinstance(spec, dict):
        if kind != "dict":
            raise ValueError(f"output_rows: a mapping needs a dict output, but the model returns a {kind}")
        unknown = [k for k in spec if k not in keys]
        if unknown:
            raise ValueError(f"output_rows: no output named {unknown!r}; the outputs are {list(keys)!r}")
        return tuple(spec.get(str(k), "tokens") for k in keys)
    if isinstance(spec, tuple):
        if kind not in ("tuple", "list") or len(spec) != len(keys):
            count = f"{len(keys)} tensors" if kind != "tensor" else "1 tensor"
            raise ValueError(
                f"output_rows: a tuple gives one entry per tensor of a tuple or list output; "
                f"got {len(spec)} entries for a {kind} of {count}"
            )
        return spec
    return (spec,) * len(keys)
