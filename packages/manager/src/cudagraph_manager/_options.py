"""``CUDAGraphManager``'s options, as typed values: ``ManagerOptions`` and its ``AttentionOptions``.

Each value checks its own fields when it is built (``ValueError`` naming
``options.<field>`` or ``attention.<field>`` and the value), so a bad option
fails where it is written. The checks that need the model, the inputs or the
config (an output that follows requests needs a ``"reqs"`` input, a decode
loop needs one token per request) are the constructor's (``_parts.build_parts``).
"""

from __future__ import annotations

import dataclasses
from typing import Final, Generic, Literal, TypeAlias

from cudagraph_capture import CaptureOptions
from cudagraph_dispatch.lowlevel import check_bool
from cudagraph_dispatch.support import AttentionSupport

from ._attention._seam import check_builder
from ._memory._kv import KVCacheMemory
from ._memory._outputs import OutputRows, check_output_rows
from ._values._inputs import signature_of
from ._values._loop import DecodeLoop
from ._values._protocols import AttentionMetadataBuilder, GraphEngineFactory, OutputT
from .ranks import RankAgreement

#: ``capture()``'s warm-up policy (``ManagerOptions.warm_ups``; ``_graphs/_warm_up`` says each).
WarmUpPolicy: TypeAlias = Literal["auto", "every_key", "per_class"]
WARM_UP_POLICIES: Final[tuple[WarmUpPolicy, ...]] = ("auto", "every_key", "per_class")


def _check_engine_factory(factory: object) -> None:
    """``ValueError`` naming ``options.engine_factory`` unless it is ``None`` or callable as a factory.

    Its products are checked when made (``_graphs/_capturer.make_engine``).
    """
    if factory is None:
        return
    if not callable(factory):
        raise ValueError(
            f"options.engine_factory: expected None or a GraphEngineFactory, got {factory!r:.80}"
        )
    signature = signature_of(factory)
    if signature is None:  # no signature to read (a builtin): its call is checked when made
        return
    try:
        signature.bind(None, None, None)
    except TypeError:
        raise ValueError(
            "options.engine_factory: expected a GraphEngineFactory, called as factory(model, mode, options), "
            f"got {factory!r:.80}, which does not take those 3 arguments"
        ) from None


def _check_optional(field: str, value: object, kind: type[object], expected: str) -> None:
    """``ValueError`` naming ``field`` and ``value`` unless ``value`` is ``None`` or a ``kind``."""
    if value is not None and not isinstance(value, kind):
        raise ValueError(f"{field}: expected {expected}, got {value!r:.80}")


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionOptions:
    """The model's attention, as the manager sees it (``ManagerOptions.attention``).

    Args:
        support: what a FULL graph of the attention replays correctly; the
            configured mode is resolved against it (default: the builder's
            ``support``, else the model's ``graph_support()``, else ``ALWAYS``); an
            override of a declaration is logged, and a builder and a model that
            disagree are refused unless it says which holds.
        strict: raise ``ModeNotSupportedError`` instead of downgrading the mode.
        metadata_builder: the attention's ``AttentionMetadataBuilder``, called on
            every path (``attention_metadata(builder)`` reads its metadata back).
    """

    support: AttentionSupport | None = None
    strict: bool = False
    metadata_builder: AttentionMetadataBuilder[object] | None = None

    def __post_init__(self) -> None:
        _check_optional("attention.support", self.support, AttentionSupport, "an AttentionSupport or None")
        check_bool("attention.strict", self.strict)
        check_builder("attention.metadata_builder", self.metadata_builder)


@dataclasses.dataclass(frozen=True, slots=True)
class ManagerOptions(Generic[OutputT]):
    """What a ``CUDAGraphManager`` may be given besides its model, inputs and config (``options=``).

    Args:
        capture: the capture engines' ``CaptureOptions`` (``None``: the defaults).
        engine_factory: builds the capture engines instead of
            ``cudagraph_capture.graph_engine`` (another engine, or a fake).
        output_rows: which count each output's rows follow: ``"tokens"``,
            ``"reqs"``, ``None`` (not batched), or a mapping or tuple of them.
        check_overwritten_outputs: a debug check: outputs become unreadable
            once a later replay may have overwritten them.
        ranks: the data- or tensor-parallel ranks that capture one plan and
            take one route per step.
        attention: the model's attention (``AttentionOptions``).
        decode_loop: lets ``run_loop`` take many decode steps per call.
        warm_ups: which keys ``capture()`` warms up before recording them:
            ``"every_key"`` (each key's first capture), ``"per_class"`` (the
            first key of each class: its mode, uniform flag and LoRA fields;
            the other sizes record without a warm-up of their own), or
            ``"auto"`` (the default: ``"per_class"`` while dynamo has compiled
            nothing in the process and there are no ``ranks``, else
            ``"every_key"``).
        kv_cache: the KV cache's reserved memory (``KVCacheMemory``), sized
            after the capture: ``back_kv_cache`` backs it from the free
            memory the capture left, grows or shrinks it, ``drop_kv_cache``
            gives it back for a sleep that keeps the graphs; the capture
            report and ``stats`` say how much of it is backed.

    Generic over the model's output type, which ``decode_loop``'s ``advance``
    takes: built inside the manager's call it is inferred; a variable holding
    options without a loop is annotated (``ManagerOptions[torch.Tensor]``).
    """

    capture: CaptureOptions | None = None
    engine_factory: GraphEngineFactory | None = None
    output_rows: OutputRows = "tokens"
    check_overwritten_outputs: bool = False
    ranks: RankAgreement | None = None
    attention: AttentionOptions = AttentionOptions()
    decode_loop: DecodeLoop[OutputT] | None = None
    warm_ups: WarmUpPolicy = "auto"
    kv_cache: KVCacheMemory | None = None

    def __post_init__(self) -> None:
        _check_optional("options.capture", self.capture, CaptureOptions, "CaptureOptions or None")
        _check_engine_factory(self.engine_factory)
        try:
            check_output_rows(self.output_rows)
        except ValueError as error:  # its message starts with the field's name
            raise ValueError(f"options.{error}") from None
        check_bool("options.check_overwritten_outputs", self.check_overwritten_outputs)
        _check_optional("options.ranks", self.ranks, RankAgreement, "a RankAgreement or None")
        attention: object = self.attention
        if not isinstance(attention, AttentionOptions):
            hint = (
                "; it goes in AttentionOptions(support=...)"
                if isinstance(attention, AttentionSupport)
                else ""
            )
            raise ValueError(f"options.attention: expected AttentionOptions, got {attention!r:.80}{hint}")
        _check_optional("options.decode_loop", self.decode_loop, DecodeLoop, "a DecodeLoop or None")
        warm_ups: object = self.warm_ups  # untyped callers pass anything
        if not isinstance(warm_ups, str) or warm_ups not in WARM_UP_POLICIES:
            raise ValueError(
                f"options.warm_ups: expected one of {WARM_UP_POLICIES}, got {self.warm_ups!r:.80}"
            )
        _check_optional("options.kv_cache", self.kv_cache, KVCacheMemory, "a KVCacheMemory or None")
        if self.decode_loop is not None and self.ranks is not None:
            raise ValueError(
                "options.decode_loop: ranks step together through run(); a loop would step alone"
            )
