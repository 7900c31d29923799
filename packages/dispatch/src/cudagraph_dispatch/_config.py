"""The dispatcher's configuration: an explicit, validated value."""

from __future__ import annotations

import dataclasses

from ._checks import check_int
from ._modes import CUDAGraphMode
from ._sizes import CaptureSizes


@dataclasses.dataclass(frozen=True, slots=True)
class DispatchConfig:
    """Which graphs to build: the mode, the sizes and the batch limits.

    ``uniform_decode_query_len`` is the tokens per request of a uniform decode
    batch (1, or 1 + speculative tokens). ``lora_counts`` are the numbers of
    active LoRA adapters to capture besides 0. Invalid values raise
    ``ValueError`` naming the field and the value.
    """

    mode: CUDAGraphMode
    capture_sizes: CaptureSizes
    max_num_seqs: int
    uniform_decode_query_len: int = 1
    lora_counts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.mode, CUDAGraphMode):  # callers may not be typed
            raise ValueError(f"mode: expected a CUDAGraphMode, got {self.mode!r}")
        if not isinstance(self.capture_sizes, CaptureSizes):
            raise ValueError(f"capture_sizes: expected CaptureSizes, got {self.capture_sizes!r}")
        check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        check_int("uniform_decode_query_len", self.uniform_decode_query_len, minimum=1)
        given: object = self.lora_counts  # checked at run time: callers may not be typed
        if not isinstance(given, (tuple, list, frozenset, set)):
            raise ValueError(f"lora_counts: expected a tuple of integers, got {given!r}")
        counts = tuple(sorted({check_int(f"lora_counts[{i}]", c, minimum=1) for i, c in enumerate(given)}))
        object.__setattr__(self, "lora_counts", counts)
