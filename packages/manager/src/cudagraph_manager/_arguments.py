"""``CUDAGraphManager``'s constructor arguments, checked before anything is allocated.

Each bad argument raises ``ValueError`` naming it, in the order of the
signature's concerns (callables first, then the config, the inputs and the
options), so the manager's constructor builds only from checked values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from cudagraph_capture import CaptureOptions, resolve_device
from cudagraph_dispatch import CUDAGraphDispatcher, DispatchConfig, check_bool

from ._buffers import check_inputs_spec
from ._outputs import OutputRows, RowsSpec, check_output_rows, uses_reqs
from ._static import StaticInput
from .ranks import RankAgreement


@dataclasses.dataclass(frozen=True, slots=True)
class Arguments:
    """What the constructor builds from: each argument checked, the defaults filled in."""

    dispatcher: CUDAGraphDispatcher
    inputs: dict[str, StaticInput]
    options: CaptureOptions
    rows: RowsSpec
    device: torch.device
    #: Why the manager captures nothing (``None``: it captures).
    no_graphs: str | None


def check_arguments(
    model: object,
    inputs: Mapping[str, StaticInput],
    config: DispatchConfig,
    *,
    device: torch.device | str | int | None,
    strict: bool,
    options: CaptureOptions | None,
    output_rows: OutputRows,
    engine_factory: object,
    check_overwritten_outputs: bool,
    ranks: RankAgreement | None,
) -> Arguments:
    """Check every argument of ``CUDAGraphManager(...)`` (``ValueError`` naming the first bad one)."""
    if not callable(model):
        raise ValueError(f"model: expected a callable, got {model!r:.80}")
    if engine_factory is not None and not callable(engine_factory):
        raise ValueError(f"engine_factory: expected None or a GraphEngineFactory, got {engine_factory!r:.80}")
    check_bool("check_overwritten_outputs", check_overwritten_outputs)
    given_ranks: object = ranks
    if given_ranks is not None and not isinstance(given_ranks, RankAgreement):
        raise ValueError(f"ranks: expected a RankAgreement or None, got {ranks!r:.80}")
    dispatcher = CUDAGraphDispatcher(config)  # validates config
    checked = check_inputs_spec(inputs)
    check_bool("strict", strict)
    given_options: object = options
    if given_options is not None and not isinstance(given_options, CaptureOptions):
        raise ValueError(f"options: expected CaptureOptions or None, got {options!r}")
    rows = check_output_rows(output_rows)
    if uses_reqs(rows) and not any(spec.rows == "reqs" for spec in checked.values()):
        raise ValueError("output_rows: an output follows 'reqs', but no input has rows='reqs' to count them")
    resolved = resolve_device(device)
    no_graphs = (
        f"CUDA graphs need a CUDA device, and the manager's device is {resolved}"
        if engine_factory is None and resolved.type != "cuda"
        else None
    )
    if strict and no_graphs is not None:
        raise ValueError(f"strict: {no_graphs}; pass strict=False to run every step eagerly")
    return Arguments(
        dispatcher, checked, options if options is not None else CaptureOptions(), rows, resolved, no_graphs
    )
