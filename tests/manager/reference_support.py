"""Helpers for tests and benchmarks of the reference decoder: padded steps, static step buffers."""

from __future__ import annotations

from typing import Final

import torch

from examples.config import DecoderConfig
from examples.reference import INPUT_NAMES, ReferenceDecoder, static_inputs
from examples.reference_attention import AttentionMetadata

#: Steps of the GPU decoder tests, (num_tokens, uniform): exact capture sizes
#: (of 1, 2, 4, 8, 16), padded sizes, one token, and one above the largest size.
GPU_STEPS: Final[tuple[tuple[int, bool], ...]] = (
    (1, True),
    (3, True),
    (8, True),
    (5, False),
    (13, False),
    (16, False),
    (12, True),
    (20, False),
)


def pad_step_inputs(
    config: DecoderConfig, inputs: dict[str, torch.Tensor], num_tokens: int
) -> dict[str, torch.Tensor]:
    """``inputs`` padded to ``num_tokens`` rows as the manager pads them (for eager checks).

    Padding rows get ``static_inputs``' pad values: token 0 at position 0 in
    the scratch cache row ``config.scratch_row``.
    """
    real = inputs["input_ids"].shape[0]
    if num_tokens < real:
        raise ValueError(f"num_tokens: must be >= the {real} rows of the inputs, got {num_tokens!r}")
    pads = {name: spec.pad_value for name, spec in static_inputs(config).items()}
    padded: dict[str, torch.Tensor] = {}
    for name in INPUT_NAMES:
        tensor = inputs[name]  # [T]
        fill = torch.full((num_tokens - real,), pads[name], dtype=tensor.dtype, device=tensor.device)
        padded[name] = torch.cat((tensor, fill))  # [num_tokens]
    return padded


class StaticStep:
    """Static step inputs and their attention metadata, built eagerly, outside every graph.

    What graphs of ``ReferenceDecoder.forward_with_metadata`` are captured on
    and replay from: the buffers hold ``max_tokens`` rows, a step of ``n``
    tokens uses the first ``n`` (``rows``). ``load`` copies a step's inputs
    into the first rows and builds its metadata into the first rows of
    ``meta``, as an engine prepares attention metadata before each replay.
    """

    __slots__ = ("_model", "inputs", "meta")

    def __init__(self, model: ReferenceDecoder, inputs: dict[str, torch.Tensor]) -> None:
        self._model = model
        self.inputs = {name: inputs[name].clone() for name in INPUT_NAMES}  # [max_tokens] each
        self.meta = model.metadata(self.inputs["positions"], self.inputs["cache_rows"])  # [max_tokens, ...]

    def rows(self, num_tokens: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """``(input_ids, meta)`` of the first ``num_tokens`` rows: views of the static buffers."""
        return (
            self.inputs["input_ids"][:num_tokens],
            AttentionMetadata._make(tensor[:num_tokens] for tensor in self.meta),
        )

    def step_inputs(self, num_tokens: int) -> dict[str, torch.Tensor]:
        """The step held in the first ``num_tokens`` rows, as ``make_step_inputs`` gives one (views)."""
        return {name: tensor[:num_tokens] for name, tensor in self.inputs.items()}

    def load(self, inputs: dict[str, torch.Tensor]) -> None:
        """Copy the step ``inputs`` (``[n]`` each) and its metadata into the first ``n`` rows."""
        num_tokens = inputs["input_ids"].shape[0]
        for name, static in self.step_inputs(num_tokens).items():
            static.copy_(inputs[name])
        fresh = self._model.metadata(inputs["positions"], inputs["cache_rows"])
        for static, tensor in zip(self.rows(num_tokens)[1], fresh, strict=True):
            static.copy_(tensor)
