"""The dispatcher's configuration: an explicit, validated value."""

from __future__ import annotations

import dataclasses
from typing import Final

from ._checks import check_int
from ._modes import CUDAGraphMode
from ._sizes import MAX_CAPTURE_SIZE, CaptureSizes

#: The largest ``max_num_seqs``: ``MAX_CAPTURE_SIZE`` (2**20). Every request
#: has a token, so no step with more requests fits a graph, and a manager
#: sizes its static buffers of request rows at ``max_num_seqs``: a larger
#: value (10**12) could never have one, and is a typo to name, not an
#: allocation to fail deep inside torch.
MAX_NUM_SEQS: Final = MAX_CAPTURE_SIZE


@dataclasses.dataclass(frozen=True, slots=True)
class DispatchConfig:
    """Which graphs to build: the mode, the sizes and the batch limits.

    Args:
        mode: the graph mode, a ``CUDAGraphMode``.
        capture_sizes: the token counts that get graphs.
        max_num_seqs: the most requests a step has, from 1 to 2**20.
        uniform_decode_query_len: the tokens per request of a uniform decode
            batch (1, or 1 + speculative tokens), from 1 to 2**20.
        lora_counts: the numbers of active LoRA adapters to capture besides
            0, each from 1 to ``max_num_seqs`` (a request runs one adapter,
            so a batch never has more active adapters than requests); stored
            sorted, without duplicates.

    Raises:
        ValueError: an invalid field, naming it and its value.
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
        max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, minimum=1, maximum=MAX_NUM_SEQS)
        check_int(
            "uniform_decode_query_len", self.uniform_decode_query_len, minimum=1, maximum=MAX_CAPTURE_SIZE
        )
        given: object = self.lora_counts  # checked at run time: callers may not be typed
        if not isinstance(given, (tuple, list, frozenset, set)):
            raise ValueError(f"lora_counts: expected a tuple of integers, got {given!r}")
        for i, count in enumerate(given):
            if check_int(f"lora_counts[{i}]", count, minimum=1) > max_num_seqs:
                raise ValueError(
                    f"lora_counts[{i}]: expected at most max_num_seqs={max_num_seqs} active adapters "
                    f"(a request runs one), got {count!r}"
                )
        counts = tuple(sorted(set(given)))
        object.__setattr__(self, "lora_counts", counts)
