"""Why a step runs without a graph: one enum, decided where the fact is known.

The dispatcher decides the first five (they follow from the config and the
batch alone) and stores each beside its decisions, so a caller never
re-derives them; a model runner adds the rest (no CUDA, a graph not captured
yet, another rank without a graph, graphs released). ``EMPTY_BATCH`` is the
one a runner never counts as an eager step: a step of 0 tokens is an idle
step (or, with ranks, a dummy step).
"""

from __future__ import annotations

import enum


class EagerReason(enum.Enum):
    """Why a step ran without a graph: the keys (values) of a runner's eager-step counts.

    A ``route`` that is not one of these is a ``Dispatch`` of a graph (FULL or PIECEWISE).
    """

    # Decided by the dispatcher, from the config and the batch.
    EMPTY_BATCH = "empty_batch"  # 0 tokens: nothing to replay (an idle step, not counted as an eager one)
    ABOVE_LARGEST_SIZE = "above_largest_size"  # more tokens than the largest capture size
    LORA_COUNT = "lora_count"  # more active adapters than the largest captured LoRA count
    INVALID_MODES = "invalid_modes"  # the step's invalid_modes turned off the graph it had
    NO_GRAPH_FOR_BATCH = "no_graph_for_batch"  # the mode has no graph for this kind of batch
    # Decided by the runner that owns the graphs.
    NO_CUDA = "no_cuda"  # the runner's device has no CUDA graphs: every step runs eagerly, padded
    NOT_CAPTURED = "not_captured"  # its graph is in the plan but was not captured (yet)
    OTHER_RANK = "other_rank"  # this rank had a graph, another rank of its group had none
    RELEASED = "released"  # the runner released its graphs (sleep) and captures nothing until woken
