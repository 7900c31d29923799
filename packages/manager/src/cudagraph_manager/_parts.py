"""A manager's parts, built once from its checked arguments: what its steps, captures and loops share.

``build_parts`` checks every argument of ``CUDAGraphManager(...)`` before
anything is allocated (each bad one raises ``ValueError`` naming it, in the
order of the signature's concerns: the model first, then the options' type,
the config, the inputs, and what the options must agree with), then builds
``ManagerParts`` from the checked values. The options checked their own
fields when they were built (``_options``). Each fact has one owner: the
device is the static buffers' (where the graphs read their inputs), the
mode resolution the dispatcher's, what the caller chose the options',
why nothing is captured (``no_graphs``) the parts'. The step lock
(``StepLock``) is here too: one call at a time holds the static buffers,
and a call from inside that call is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Final, Generic, cast

import torch
from torch import nn

from cudagraph_capture import CaptureOptions, graph_engine
from cudagraph_capture.lowlevel import resolve_device
from cudagraph_dispatch import CUDAGraphDispatcher, DispatchConfig
from cudagraph_dispatch._support import ModeResolution
from cudagraph_dispatch.lowlevel import check_bool
from cudagraph_dispatch.support import AttentionSupport

from ._memory._buffers import LoopBuffers, StaticBuffers
from ._memory._kv import KVCacheMemory
from ._memory._outputs import LayoutCell, RowsSpec, check_output_rows, uses_reqs
from ._memory._weights import watched_module
from ._options import AttentionOptions, ManagerOptions
from ._values._inputs import StaticInput, check_inputs_spec, signature_of
from ._values._loop import DecodeLoop
from ._values._protocols import AttentionMetadataBuilder, GraphEngineFactory, OutputT
from ._values._reports import KVCacheBacking, StepCounts
from .ranks import RankAgreement

_logger: Final = logging.getLogger("cudagraph_manager")


class StepLock:
    """One call at a time holds a manager's static buffers; a call from inside that call is refused at once.

    ``acquire``, ``release`` and ``locked`` are the lock's own (C functions:
    the replay's path adds no Python call). ``owner``: the thread holding
    it (0: none), set by the holder right after acquiring and cleared right
    before releasing, so a thread that finds itself the owner is inside a
    call of this manager (its model, builder or advance calls back), where
    waiting would deadlock. ``capturing``: the thread of a background
    capture while it runs the model (it holds no lock: the steps go on).
    Another thread is told the manager is busy (``run``) or waits (the rest).
    """

    __slots__ = ("acquire", "capturing", "locked", "owner", "release")

    def __init__(self) -> None:
        lock = threading.Lock()
        self.acquire: Final = lock.acquire
        self.release: Final = lock.release
        self.locked: Final = lock.locked
        self.owner = 0
        self.capturing = 0

    def refused(self, what: str) -> RuntimeError:
        """The error of ``what()``, which found the lock taken (or runs on the background capture thread)."""
        me = threading.get_ident()
        if me == self.capturing:
            return RuntimeError(f"{what}(): {_INSIDE_CAPTURE}")
        if me == self.owner:
            return RuntimeError(f"{what}(): {_INSIDE_STEP}")
        return RuntimeError(f"CUDAGraphManager.{what}: {_BUSY}")

    @contextlib.contextmanager
    def held(self, what: str) -> Iterator[None]:
        """Hold the lock for ``what()``, waiting for another thread; refused at once from inside a call."""
        me = threading.get_ident()
        if me == self.owner or me == self.capturing:
            raise self.refused(what)
        self.acquire()
        self.owner = me
        try:
            yield
        finally:
            self.owner = 0
            self.release()

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        """This thread runs the model for a background capture: its calls on the manager are refused."""
        self.capturing = threading.get_ident()
        try:
            yield
        finally:
            self.capturing = 0


_INSIDE_STEP: Final = (
    "called from inside a step of this manager (the model, attention builder or decode loop's advance "
    "that its run(), run_batch(), run_loop() or capture() is running); that call holds the static "
    "buffers, so this one would wait for itself: call it after that call returns"
)
_INSIDE_CAPTURE: Final = (
    "called from inside this manager's background capture (the model, attention builder or decode "
    "loop's advance, warmed up or recorded on the capture thread); the capture cannot wait for itself: "
    "call it from the serving thread"
)
_BUSY: Final = (
    "another thread is inside run(), capture(), clear(), start_capture(), release() or "
    "estimate_memory() of this manager; its static buffers serve one step at a time "
    "(serialize the calls, or use a manager per thread)"
)


@dataclasses.dataclass(frozen=True, slots=True)
class ManagerParts(Generic[OutputT]):
    """What the layers of one manager share: its model, dispatcher, buffers, counters and options.

    ``options``: the ``ManagerOptions`` as given (the defaults for
    ``None``), whose ``ranks``, ``attention.metadata_builder``,
    ``decode_loop`` and ``kv_cache`` the parts read (``ranks``, ``builder``,
    ``kv_cache``); ``capture_options`` and ``engine_factory``: the capture
    engines' options and factory, the defaults filled in; ``loop``: the
    decode loop's state (``None``: no ``decode_loop``); ``no_graphs``: why
    the manager captures nothing (``None``: it captures); ``strict``: steps
    without a graph raise; ``lock``: the step lock.
    """

    model: Callable[..., OutputT]
    options: ManagerOptions[OutputT]
    dispatcher: CUDAGraphDispatcher
    buffers: StaticBuffers
    layout: LayoutCell
    loop: LoopBuffers[OutputT] | None
    counts: StepCounts
    lock: StepLock
    capture_options: CaptureOptions
    engine_factory: GraphEngineFactory
    no_graphs: str | None
    strict: bool

    @property
    def device(self) -> torch.device:
        """Where the static buffers live, and so every graph, step and loop of the manager."""
        return self.buffers.device

    @property
    def resolution(self) -> ModeResolution:
        """The mode the graphs follow (the dispatcher's), for the reports."""
        return self.dispatcher.resolution

    @property
    def ranks(self) -> RankAgreement | None:
        """The ranks the manager steps with (``ManagerOptions.ranks``)."""
        return self.options.ranks

    @property
    def builder(self) -> AttentionMetadataBuilder[object] | None:
        """The attention's metadata builder (``None``: the model builds its metadata itself)."""
        return self.options.attention.metadata_builder

    @property
    def kv_cache(self) -> KVCacheMemory | None:
        """The KV cache's reserved memory (``ManagerOptions.kv_cache``), if any."""
        return self.options.kv_cache

    def kv_backing(self) -> KVCacheBacking | None:
        """How much of the KV cache is backed now (``KVCacheMemory.backing``), if the manager has one."""
        kv_cache = self.options.kv_cache
        return None if kv_cache is None else kv_cache.backing()


def build_parts(
    model: Callable[..., OutputT],
    inputs: Mapping[str, StaticInput],
    config: DispatchConfig,
    device: torch.device | str | int | None,
    strict: bool,
    options: ManagerOptions[OutputT] | None,
) -> ManagerParts[OutputT]:
    """Check every argument of ``CUDAGraphManager(...)``, then build the manager's parts from them.

    The first bad argument raises ``ValueError`` naming it, before anything is
    allocated (a mode the attention cannot serve: ``ModeNotSupportedError``,
    where ``AttentionOptions.strict`` says so).
    """
    if not callable(model):
        raise ValueError(f"model: expected a callable, got {model!r:.80}")
    given = _given_options(options)
    attention = given.attention
    builder = attention.metadata_builder
    support = attention_support(model, attention)
    # Checks the config, and resolves the mode against the attention (ModeNotSupportedError if strict).
    dispatcher = CUDAGraphDispatcher(config, attention=support, strict_attention=attention.strict)
    checked = check_inputs_spec(inputs)
    check_bool("strict", strict)
    rows = check_output_rows(given.output_rows)
    _check_request_counts(checked, rows, builder)
    where = resolve_device(device)
    _check_model(model, checked)
    _check_model_device(model, where)
    _check_options(given, config, checked, where)
    factory = given.engine_factory
    no_graphs = None
    if factory is None and where.type != "cuda":
        no_graphs = f"CUDA graphs need a CUDA device, and the manager's device is {where}"
    if strict and no_graphs is not None:
        raise ValueError(f"strict: {no_graphs}; pass strict=False to run every step eagerly")
    buffers = StaticBuffers(
        checked,
        max_tokens=config.capture_sizes.max,
        max_num_seqs=config.max_num_seqs,
        uniform_decode_query_len=config.uniform_decode_query_len,
        device=where,
    )
    decode_loop = given.decode_loop
    return ManagerParts(
        model=model,
        options=given,
        dispatcher=dispatcher,
        buffers=buffers,
        layout=LayoutCell(rows),
        loop=None if decode_loop is None else LoopBuffers(decode_loop, config.max_num_seqs, where),
        counts=StepCounts(),
        lock=StepLock(),
        capture_options=CaptureOptions.given(given.capture),
        engine_factory=cast(GraphEngineFactory, graph_engine) if factory is None else factory,
        no_graphs=no_graphs,
        strict=strict,
    )


def _check_model(model: object, inputs: Mapping[str, StaticInput]) -> None:
    """``model`` is no class and takes ``inputs`` as keywords: else ``ValueError`` naming ``model``.

    A model that cannot be called so would fail inside its first step or
    capture. A signature that cannot be read (a builtin) is not checked; a
    module's is its ``forward``'s.
    """
    if isinstance(model, type):
        raise ValueError(
            f"model: expected the model to call (an instance or a function), got the class "
            f"{model.__name__}; pass an instance ({model.__name__}(...))"
        )
    signature = signature_of(model.forward if isinstance(model, nn.Module) else model)
    if signature is None:
        return
    try:
        signature.bind(**dict.fromkeys(inputs))
    except TypeError as error:
        raise ValueError(
            f"model: cannot take the inputs as keywords ({', '.join(inputs)}): {error}"
        ) from None


def _check_model_device(model: object, device: torch.device) -> None:
    """``model``'s weights on ``device``: ``ValueError`` if one is on meta, or none is there.

    The model's module (``watched_module``: the model, a bound method's
    object, what was compiled); a function is not checked. Some weights
    kept elsewhere (offloaded to the host) are the model's choice.
    """
    module = watched_module(model)
    if module is None:
        return
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


def _check_options(
    options: ManagerOptions[OutputT],
    config: DispatchConfig,
    inputs: Mapping[str, StaticInput],
    device: torch.device,
) -> None:
    """What the options must agree with besides the inputs: the config and the device.

    The builder's buffers, the decode loop and the KV cache's memory on the
    manager's device, the loop's one token per request; ``ValueError``
    naming the option.
    """
    _check_builder_device(options.attention.metadata_builder, device)
    _check_decode_loop(options.decode_loop, config, inputs, device)
    kv_cache = options.kv_cache
    if kv_cache is not None and kv_cache.device != device:
        raise ValueError(
            f"options.kv_cache: its memory is on {kv_cache.device}, the manager's device is {device}"
        )


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
        _logger.info(
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
