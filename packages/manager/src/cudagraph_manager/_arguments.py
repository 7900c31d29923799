"""``CUDAGraphManager``'s constructor arguments, checked before anything is allocated.

Each bad argument raises ``ValueError`` naming it, in the order of the
signature's concerns (callables first, then the config, the inputs and the
options), so the manager's constructor builds only from checked values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import cast

import torch

from cudagraph_capture import CaptureOptions, graph_engine, resolve_device
from cudagraph_dispatch import AttentionSupport, CUDAGraphDispatcher, DispatchConfig, check_bool

from ._buffers._buffers import check_inputs_spec
from ._buffers._outputs import OutputRows, RowsSpec, check_output_rows, uses_reqs
from ._buffers._static import StaticInput
from ._decode_loop import DecodeLoop
from ._protocols import AttentionMetadataBuilder, GraphEngineFactory
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
    #: The attention's metadata builder, called on every path (``None``: the model needs none).
    builder: AttentionMetadataBuilder[object] | None
    #: The capture engines' factory (the default: ``cudagraph_capture.graph_engine``).
    factory: GraphEngineFactory


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
    attention: AttentionSupport | None = None,
    strict_attention: bool = False,
    metadata_builder: object = None,
    decode_loop: object = None,
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
    check_bool("strict_attention", strict_attention)
    builder = check_builder(metadata_builder)
    support = attention if attention is not None else declared_support(model, builder)
    # Checks config and attention, and resolves the mode against the attention (ModeNotSupportedError
    # if strict).
    dispatcher = CUDAGraphDispatcher(config, attention=support, strict_attention=strict_attention)
    checked = check_inputs_spec(inputs)
    check_bool("strict", strict)
    checked_options = CaptureOptions.given(options)
    rows = check_output_rows(output_rows)
    _check_request_counts(checked, rows, builder)
    check_decode_loop(decode_loop, config, ranks)
    resolved = resolve_device(device)
    no_graphs = (
        f"CUDA graphs need a CUDA device, and the manager's device is {resolved}"
        if engine_factory is None and resolved.type != "cuda"
        else None
    )
    if strict and no_graphs is not None:
        raise ValueError(f"strict: {no_graphs}; pass strict=False to run every step eagerly")
    factory = cast(GraphEngineFactory, graph_engine if engine_factory is None else engine_factory)
    return Arguments(dispatcher, checked, checked_options, rows, resolved, no_graphs, builder, factory)


def _check_request_counts(
    inputs: Mapping[str, StaticInput], rows: RowsSpec, builder: AttentionMetadataBuilder[object] | None
) -> None:
    """Outputs that follow requests, and a builder (its metadata is per request), need a "reqs" input."""
    if any(spec.rows == "reqs" for spec in inputs.values()):
        return
    if uses_reqs(rows):
        raise ValueError("output_rows: an output follows 'reqs', but no input has rows='reqs' to count them")
    if builder is not None:
        raise ValueError(
            "metadata_builder: an attention's metadata is per request, but no input has rows='reqs' "
            "to count the requests"
        )


def check_decode_loop(decode_loop: object, config: DispatchConfig, ranks: RankAgreement | None) -> None:
    """``decode_loop`` is ``None``, or a ``DecodeLoop`` this manager can run (``ValueError`` naming it)."""
    if decode_loop is None:
        return
    if not isinstance(decode_loop, DecodeLoop):
        raise ValueError(f"decode_loop: expected a DecodeLoop or None, got {decode_loop!r:.80}")
    if config.uniform_decode_query_len != 1:
        raise ValueError(
            "decode_loop: a decode loop takes one token per request, but the config's "
            f"uniform_decode_query_len is {config.uniform_decode_query_len}"
        )
    if ranks is not None:
        raise ValueError("decode_loop: ranks step together through run(); a loop would step alone")


def check_builder(builder: object) -> AttentionMetadataBuilder[object] | None:
    """``builder`` if it is ``None`` or has the protocol's methods; ``ValueError`` naming what it lacks."""
    if builder is None:
        return None
    lacks = [
        f"{name}()" for name in ("build", "build_for_capture") if not callable(getattr(builder, name, None))
    ]
    if not isinstance(getattr(builder, "support", None), AttentionSupport):
        lacks.append("a support of type AttentionSupport")
    if lacks:
        raise ValueError(
            f"metadata_builder: expected an AttentionMetadataBuilder, got {builder!r:.80}, "
            f"which lacks {', '.join(lacks)}"
        )
    return builder  # type: ignore[return-value]  # checked above: the protocol's members exist


def declared_support(
    model: object, builder: AttentionMetadataBuilder[object] | None = None
) -> AttentionSupport | None:
    """What the attention declares it can graph: the builder's ``support``, else the model's, else ``None``.

    The model's ``graph_support()`` is looked up on the model, then on the
    object of a bound method (a model passed as ``decoder.step``). A model
    with several backends returns ``AttentionSupport.weakest`` of them.
    """
    if builder is not None:
        return builder.support
    for owner in (model, getattr(model, "__self__", None)):
        declare = getattr(owner, "graph_support", None)
        if declare is None:
            continue
        support: object = declare() if callable(declare) else declare
        if not isinstance(support, AttentionSupport):
            raise ValueError(f"model: graph_support() returned {support!r:.80}, expected an AttentionSupport")
        return support
    return None
