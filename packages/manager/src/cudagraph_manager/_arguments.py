"""``CUDAGraphManager``'s constructor arguments, checked before anything is allocated.

Each bad argument raises ``ValueError`` naming it, in the order of the
signature's concerns (the model first, then the options' type, the config,
the inputs, and what the options must agree with), so the manager's
constructor builds only from checked values. The options checked their own
fields when they were built (``_options``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Final, Generic, cast

import torch
from torch import nn

from cudagraph_capture import CaptureOptions, graph_engine
from cudagraph_capture.lowlevel import resolve_device
from cudagraph_dispatch import CUDAGraphDispatcher, DispatchConfig
from cudagraph_dispatch.lowlevel import check_bool
from cudagraph_dispatch.support import AttentionSupport

from ._memory._outputs import RowsSpec, check_output_rows, uses_reqs
from ._memory._weights import watched_module
from ._options import AttentionOptions, ManagerOptions
from ._values._inputs import StaticInput, check_inputs_spec
from ._values._loop import DecodeLoop
from ._values._protocols import AttentionMetadataBuilder, GraphEngineFactory, OutputT

_LOG: Final = logging.getLogger("cudagraph_manager")


@dataclasses.dataclass(frozen=True, slots=True)
class Arguments(Generic[OutputT]):
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
    #: The rest of the options, as given (``ManagerOptions``' defaults for ``None``).
    given: ManagerOptions[OutputT]


def check_arguments(
    model: object,
    inputs: Mapping[str, StaticInput],
    config: DispatchConfig,
    device: torch.device | str | int | None,
    strict: bool,
    options: ManagerOptions[OutputT] | None,
) -> Arguments[OutputT]:
    """Check every argument of ``CUDAGraphManager(...)`` (``ValueError`` naming the first bad one).

    ``options`` checked its own fields when it was built; here, what they
    must agree with (the model, the inputs, the config, the device).
    """
    if not callable(model):
        raise ValueError(f"model: expected a callable, got {model!r:.80}")
    checked_options = _given_options(options)
    attention = checked_options.attention
    builder = attention.metadata_builder
    support = attention_support(model, attention)
    # Checks the config, and resolves the mode against the attention (ModeNotSupportedError if strict).
    dispatcher = CUDAGraphDispatcher(config, attention=support, strict_attention=attention.strict)
    checked = check_inputs_spec(inputs)
    check_bool("strict", strict)
    rows = check_output_rows(checked_options.output_rows)
    _check_request_counts(checked, rows, builder)
    resolved = _check_model(model, checked, resolve_device(device))
    _check_builder_device(builder, resolved)
    factory = checked_options.engine_factory
    no_graphs = (
        f"CUDA graphs need a CUDA device, and the manager's device is {resolved}"
        if factory is None and resolved.type != "cuda"
        else None
    )
    _check_decode_loop(checked_options.decode_loop, config, checked, resolved)
    kv_cache = checked_options.kv_cache
    if kv_cache is not None and kv_cache.device != resolved:
        raise ValueError(
            f"options.kv_cache: its memory is on {kv_cache.device}, the manager's device is {resolved}"
        )
    if strict and no_graphs is not None:
        raise ValueError(f"strict: {no_graphs}; pass strict=False to run every step eagerly")
    capture = CaptureOptions.given(checked_options.capture)
    engines = cast(GraphEngineFactory, graph_engine) if factory is None else factory
    return Arguments(
        dispatcher, checked, capture, rows, resolved, no_graphs, builder, engines, checked_options
    )


def _check_model(model: object, inputs: Mapping[str, StaticInput], device: torch.device) -> torch.device:
    """``device``, once ``model`` is no class, takes ``inputs`` as keywords and has its weights there.

    Else ``ValueError`` naming ``model``: a model that cannot be called so
    would fail inside its first step or capture. A signature that cannot be
    read (a builtin) is not checked; a module's is its ``forward``'s.
    """
    if isinstance(model, type):
        raise ValueError(
            f"model: expected the model to call (an instance or a function), got the class "
            f"{model.__name__}; pass an instance ({model.__name__}(...))"
        )
    call = model.forward if isinstance(model, nn.Module) else model
    try:
        signature = inspect.signature(cast("Callable[..., object]", call))
    except (TypeError, ValueError):
        signature = None
    try:
        if signature is not None:
            signature.bind(**dict.fromkeys(inputs))
    except TypeError as error:
        raise ValueError(
            f"model: cannot take the inputs as keywords ({', '.join(inputs)}): {error}"
        ) from None
    return _model_device(model, device)


def _model_device(model: object, device: torch.device) -> torch.device:
    """``device``, checked against ``model``'s weights: ``ValueError`` if one is on meta, or none is there.

    The model's module (``watched_module``: the model, a bound method's
    object, what was compiled); a function is not checked. Some weights
    kept elsewhere (offloaded to the host) are the model's choice.
    """
    module = watched_module(model)
    if module is None:
        return device
    tensors = [
        *(("parameter", name, t) for name, t in module.named_parameters()),
        *(("buffer", name, t) for name, t in module.named_buffers()),
    ]
    for kind, name, tensor in tensors:
        if tensor.device.type == "meta":
            raise ValueError(
                f"model: its {kind} {name!r} is on meta (it holds no data), but the manager's device is "
                f"{device}; load the weights first (module.to_empty(device=...), then its state dict)"
            )
    if tensors and not any(tensor.device == device for _, _, tensor in tensors):
        first = tensors[0][2].device
        raise ValueError(
            f"model: its parameters and buffers are on {first} ({tensors[0][1]!r}, ...), but the manager's "
            f"device is {device}; move the model there (model.to(device)) or pass device={str(first)!r}"
        )
    return device


def _check_builder_device(builder: object, device: torch.device) -> None:
    """A builder that says where its buffers live (a ``device``) has them on the manager's device.

    Else ``ValueError`` naming it: its metadata would meet the static buffers
    in torch's cross-device error, inside the first step or capture.
    """
    where = getattr(builder, "device", None)
    if isinstance(where, torch.device) and where != device:
        raise ValueError(
            f"options.attention.metadata_builder: its buffers are on {where}, but the manager's device is "
            f"{device}; build it with device={str(device)!r}"
        )


def _given_options(options: ManagerOptions[OutputT] | None) -> ManagerOptions[OutputT]:
    """``options``, or the defaults for ``None``; anything else raises ``ValueError`` naming ``options``."""
    if options is None:
        return ManagerOptions()
    given: object = options
    if not isinstance(given, ManagerOptions):
        hint = _MOVED.get(type(given), "")
        raise ValueError(f"options: expected ManagerOptions or None, got {given!r:.80}{hint}")
    return options


#: Where a value of another option type passed as ``options=`` belongs: a hint in the error.
_MOVED: Final[Mapping[type, str]] = {
    CaptureOptions: "; CaptureOptions go in ManagerOptions(capture=...)",
    AttentionOptions: "; AttentionOptions go in ManagerOptions(attention=...)",
}


def _check_request_counts(
    inputs: Mapping[str, StaticInput], rows: RowsSpec, builder: AttentionMetadataBuilder[object] | None
) -> None:
    """Outputs that follow requests, and a builder (its metadata is per request), need a "reqs" input."""
    if any(spec.rows == "reqs" for spec in inputs.values()):
        return
    if uses_reqs(rows):
        raise ValueError(
            "options.output_rows: an output follows 'reqs', but no input has rows='reqs' to count them"
        )
    if builder is not None:
        raise ValueError(
            "options.attention.metadata_builder: an attention's metadata is per request, but no input "
            "has rows='reqs' to count the requests"
        )


def _check_decode_loop(
    decode_loop: DecodeLoop[OutputT] | None,
    config: DispatchConfig,
    inputs: Mapping[str, StaticInput],
    device: torch.device,
) -> None:
    """A decode loop takes one token per request, counts the requests, and gets the kind it forces.

    The config's uniform decodes must take one token per request, an input
    must count the requests (the loop keeps a token row and an active flag
    per request), and a forced ``LoopKind`` needs a device where loops are
    captured (CUDA): elsewhere ``run_loop`` would loop on the host instead.
    """
    if decode_loop is None:
        return
    if config.uniform_decode_query_len != 1:
        raise ValueError(
            "options.decode_loop: a decode loop takes one token per request, but the config's "
            f"uniform_decode_query_len is {config.uniform_decode_query_len}"
        )
    if not any(spec.rows == "reqs" for spec in inputs.values()):
        raise ValueError(
            "options.decode_loop: a decode loop keeps a row per request (its tokens, its active flag), "
            "but no input has rows='reqs' to count the requests"
        )
    kind = decode_loop.policy.kind
    if kind is not None and device.type != "cuda":
        raise ValueError(
            f"options.decode_loop.policy: LoopKind.{kind.name} was asked for, but decode loops are "
            f"captured on a CUDA device only, and the manager's device is {device}: run_loop would "
            "loop on the host; pass LoopPolicy() (no kind) to let it"
        )
    for i, tensor in enumerate(decode_loop.request_rows or ()):
        _check_request_row(f"options.decode_loop.request_rows[{i}]", tensor, config.max_num_seqs, device)


def _check_request_row(name: str, tensor: torch.Tensor, rows: int, device: torch.device) -> None:
    """A tensor a shrinking loop moves by request: ``rows`` rows or more on ``device``, each contiguous."""
    rowed = tensor.dim() > 0 and tensor.shape[0] >= rows and tensor[0].is_contiguous()
    if tensor.device != device or not rowed:
        raise ValueError(
            f"{name}: expected a tensor on {device} with a contiguous row per request (at least "
            f"max_num_seqs={rows} rows), got a {tensor.dtype} tensor of shape {tuple(tensor.shape)} "
            f"on {tensor.device}"
        )


def attention_support(model: object, attention: AttentionOptions) -> AttentionSupport | None:
    """What the mode is resolved against: ``attention.support``, else what the attention declares.

    ``AttentionOptions.support`` overrides the declaration, said in the log
    (INFO, logger ``cudagraph_manager``) where it differs; ``None``: nothing
    declared (the dispatcher takes ``ALWAYS``).
    """
    builder, given = attention.metadata_builder, attention.support
    if given is None:
        return declared_support(model, builder)
    declared = builder.support if builder is not None else _models_support(model)
    if declared is not None and (given.level, given.piecewise) != (declared.level, declared.piecewise):
        _LOG.info(
            "attention: AttentionOptions.support %s (piecewise=%s) overrides the declared %s "
            "(piecewise=%s) of %r",
            given.level.name,
            given.piecewise,
            declared.level.name,
            declared.piecewise,
            declared.name,
        )
    return given


def declared_support(
    model: object, builder: AttentionMetadataBuilder[object] | None = None
) -> AttentionSupport | None:
    """What the attention declares it can graph: the builder's ``support``, else the model's, else ``None``.

    The model's ``graph_support()`` is looked up on the model, then on the
    object of a bound method (a model passed as ``decoder.step``). A model
    with several backends returns ``AttentionSupport.weakest`` of them. A
    model and a builder that both declare must agree (level and split):
    which one holds is the caller's to say, with ``AttentionOptions.support``.
    """
    models = _models_support(model)
    if builder is None:
        return models
    support = builder.support
    if models is not None and (models.level, models.piecewise) != (support.level, support.piecewise):
        raise ValueError(
            f"options.attention.metadata_builder: its support {support.level.name} "
            f"(piecewise={support.piecewise}) disagrees with the model's graph_support() "
            f"{models.level.name} (piecewise={models.piecewise}); say which holds with "
            "AttentionOptions(support=...)"
        )
    return support


def _models_support(model: object) -> AttentionSupport | None:
    """The model's ``graph_support()`` (on the model, or on a bound method's object); ``None``: none."""
    for owner in (model, getattr(model, "__self__", None)):
        declare = getattr(owner, "graph_support", None)
        if declare is None:
            continue
        support: object = declare() if callable(declare) else declare
        if not isinstance(support, AttentionSupport):
            raise ValueError(f"model: graph_support() returned {support!r:.80}, expected an AttentionSupport")
        return support
    return None
