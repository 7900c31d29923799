"""Checking an attention's declared level: FULL graphs of every batch kind, replayed against eager.

The manager trusts an attention's declaration (``GraphSupport``); a backend
that declares more than it serves replays wrong values silently.
``check_attention_support`` tests it as the manager would use it: per kind of
batch, one strict manager whose FULL graphs serve that kind alone, captured,
then replayed on fresh random batches compared with eager. The verified level
is the highest whose kinds all held (docs/design.md, "Attention support").
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final, Literal, TypeAlias

import torch

from cudagraph_capture.lowlevel import resolve_device
from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    set_forward_context,
)
from cudagraph_dispatch._config import MAX_NUM_SEQS
from cudagraph_dispatch._sizes import MAX_CAPTURE_SIZE
from cudagraph_dispatch.lowlevel import check_int
from cudagraph_dispatch.support import AttentionSupport, GraphSupport

from ._attention._seam import build_extra, check_builder
from ._manager import CUDAGraphManager
from ._memory._outputs import OutputRows, output_leaves
from ._options import AttentionOptions, ManagerOptions
from ._values._batch import BatchShape, StepBatch
from ._values._inputs import StaticInput
from ._values._protocols import AttentionMetadataBuilder, GraphEngineFactory, ModelOutput


class BatchKind(enum.Enum):
    """A kind of batch a FULL graph may serve, and the weakest level that promises it (``level``)."""

    #: Every request has one token (decode).
    UNIFORM_SINGLE_TOKEN = "uniform_single_token"
    #: Every request has the same ``query_len > 1`` tokens (speculative decode).
    UNIFORM = "uniform"
    #: Requests of any lengths (prefill and decode together).
    MIXED = "mixed"

    @property
    def level(self) -> GraphSupport:
        return _PROMISED_BY[self]


_PROMISED_BY: Final = {
    BatchKind.UNIFORM_SINGLE_TOKEN: GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE,
    BatchKind.UNIFORM: GraphSupport.UNIFORM_BATCH,
    BatchKind.MIXED: GraphSupport.ALWAYS,
}

#: ``make_batch(kind, num_tokens, num_reqs, generator)``: a random batch of that kind, on the device.
MakeBatch: TypeAlias = Callable[[BatchKind, int, int, torch.Generator], Mapping[str, torch.Tensor]]

DEFAULT_SIZES: Final = (1, 2, 4, 8, 16)
#: The most random batches ``SupportCheckOptions.trials`` asks for per graph (each is a replay and an
#: eager run): a larger count is a typo, not a check.
MAX_TRIALS: Final = 10_000
#: The seeds ``torch.Generator.manual_seed`` takes: ``SupportCheckOptions.seed``.
_SEEDS: Final = (-(2**63), 2**64 - 1)


@dataclasses.dataclass(frozen=True, slots=True)
class KindCheck:
    """One kind of batch, checked: the graphs replayed, how many batches, the worst error, why it failed.

    ``query_len``: tokens per request (``None`` for mixed batches).
    ``graphs``: the FULL keys the batches were padded to.
    ``batches``: batches replayed and compared with eager.
    ``worst_error``: the largest relative error of a replay against eager
    (``inf`` for a shape mismatch or a non-finite value; 0.0 if none ran).
    ``failure``: why the kind does not hold (an error above ``rtol``, a
    capture or a replay that raised); ``None``: it held.
    """

    kind: BatchKind
    query_len: int | None
    graphs: tuple[BatchDescriptor, ...]
    batches: int
    worst_error: float
    failure: str | None = None

    @property
    def held(self) -> bool:
        return self.failure is None

    def __str__(self) -> str:
        q = "mixed" if self.query_len is None else f"q={self.query_len}"
        what = "held" if self.failure is None else f"FAILED: {self.failure}"
        return (
            f"{self.kind.value} ({q}): {self.batches} batches on {len(self.graphs)} graphs, "
            f"worst relative error {self.worst_error:.3g}; {what}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class SupportCheck:
    """What ``check_attention_support`` found: the declared level, the verified one, each kind's check.

    ``verified``: the highest level whose promised kinds all held (``NEVER``
    if single-token decode batches failed). ``overdeclared``: the declared
    level promises a kind that failed.
    """

    name: str
    declared: GraphSupport
    verified: GraphSupport
    kinds: tuple[KindCheck, ...]
    rtol: float

    @property
    def overdeclared(self) -> bool:
        return self.declared > self.verified

    def kind(self, kind: BatchKind) -> KindCheck:
        return next(check for check in self.kinds if check.kind is kind)

    def __str__(self) -> str:
        head = (
            f"attention {self.name!r}: declared {self.declared.name}, verified {self.verified.name} "
            f"(FULL graphs against eager, rtol {self.rtol:g})"
        )
        return "\n".join([head, *(f"  {check}" for check in self.kinds)])


class SupportLevelError(ValueError):
    """An attention declares a level its FULL graphs do not serve; ``check`` is the whole report."""

    def __init__(self, check: SupportCheck) -> None:
        failed = [
            f"{c.kind.value}: {c.failure}"
            for c in check.kinds
            if c.failure is not None and c.kind.level <= check.declared
        ]
        super().__init__(
            f"attention {check.name!r} declares {check.declared.name}, but its FULL graphs replay "
            f"correctly only up to {check.verified.name}; " + "; ".join(failed)
        )
        self.check: Final = check


@dataclasses.dataclass(frozen=True, slots=True)
class SupportCheckOptions:
    """How ``check_attention_support`` checks (``options=``): the graphs per kind, the batches, the verdict.

    Args:
        sizes, max_num_seqs, query_len: the graphs per kind (``DispatchConfig``'s
            meanings); ``query_len >= 2``: the uniform kind's tokens per request.
        trials: random batches per graph, each padded to it.
        rtol: the largest relative error (L2) of a replay against eager that holds.
        seed: seeds the CPU generator ``make_batch`` draws from.
        on_overdeclared: ``"raise"`` (``SupportLevelError``) or ``"warn"`` when the
            declared level is above the verified one.
        output_rows, engine_factory: as in ``ManagerOptions``.
    """

    sizes: Sequence[int] | CaptureSizes = DEFAULT_SIZES
    max_num_seqs: int = 8
    query_len: int = 2
    trials: int = 2
    rtol: float = 1e-2
    seed: int = 0
    on_overdeclared: Literal["raise", "warn"] = "raise"
    output_rows: OutputRows = "tokens"
    engine_factory: GraphEngineFactory | None = None

    def __post_init__(self) -> None:
        _capture_sizes(self.sizes)
        for name, value, least, most in (
            ("max_num_seqs", self.max_num_seqs, 1, MAX_NUM_SEQS),
            ("query_len", self.query_len, 2, MAX_CAPTURE_SIZE),
            ("trials", self.trials, 1, MAX_TRIALS),
        ):
            check_int(f"options.{name}", value, minimum=least, maximum=most)
        seed: object = self.seed
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"options.seed: expected an integer, got {seed!r}")
        if not _SEEDS[0] <= seed <= _SEEDS[1]:
            raise ValueError(
                f"options.seed: expected an integer in [-2**63, 2**64 - 1] (a torch.Generator's seed), "
                f"got {seed!r}"
            )
        rtol: object = self.rtol
        if not isinstance(rtol, (int, float)) or isinstance(rtol, bool) or not 0.0 < rtol < math.inf:
            raise ValueError(f"options.rtol: expected a finite number > 0, got {rtol!r}")
        if self.on_overdeclared not in ("raise", "warn"):
            raise ValueError(
                f"options.on_overdeclared: expected 'raise' or 'warn', got {self.on_overdeclared!r}"
            )
        ManagerOptions(output_rows=self.output_rows, engine_factory=self.engine_factory)  # their checks

    def manager_options(self, builder: AttentionMetadataBuilder[object]) -> ManagerOptions[ModelOutput]:
        """A kind's manager's options: the builder's FULL graphs forced (``ALWAYS``: nothing downgraded)."""
        forced = AttentionSupport(GraphSupport.ALWAYS, piecewise=False, name=builder.support.name)
        attention = AttentionOptions(support=forced, metadata_builder=builder)
        return ManagerOptions(
            output_rows=self.output_rows, engine_factory=self.engine_factory, attention=attention
        )


def check_attention_support(
    model: Callable[..., ModelOutput],
    inputs: Mapping[str, StaticInput],
    builder: AttentionMetadataBuilder[object],
    make_batch: MakeBatch,
    *,
    device: torch.device | str | int | None = None,
    options: SupportCheckOptions | None = None,
) -> SupportCheck:
    """Check the level ``builder`` declares: FULL graphs of each batch kind, replayed against eager.

    Args:
        model, inputs, device: as for ``CUDAGraphManager``.
        builder: the attention's builder; ``builder.support.level`` is checked.
        make_batch: ``make_batch(kind, num_tokens, num_reqs, generator)``, a
            fresh random batch of ``kind`` (input name -> tensor on the device),
            drawn from the CPU ``generator`` (seeded with ``options.seed``).
        options: ``SupportCheckOptions`` (``None``: the defaults).

    Returns:
        What was checked: the declared level, the verified one, each kind's check.

    Raises:
        ValueError: naming a bad argument, before anything runs; naming
            ``make_batch`` where a batch it returns is not one the manager takes.
        SupportLevelError: the declared level is above the verified one,
            where ``options.on_overdeclared`` is ``"raise"`` (else a warning).

    The graphs are freed before it returns. The replays and the eager
    references write the model's state (a KV cache; each eager run repeats
    its replay's batch): check before serving.
    """
    support, checked = _check_arguments(builder, make_batch, options)
    sizes = _capture_sizes(checked.sizes)
    configs = {kind: _config(kind, sizes, checked.max_num_seqs, checked.query_len) for kind in BatchKind}
    managers = _managers(model, inputs, builder, configs, checked, device)
    generator = torch.Generator().manual_seed(checked.seed)
    run = _Run(model, inputs, builder, make_batch, checked.trials, checked.rtol, generator)
    with torch.no_grad():
        kinds = tuple(_check_kind(run, kind, manager) for kind, manager in managers.items())
    result = SupportCheck(
        name=support.name,
        declared=support.level,
        verified=_verified(kinds),
        kinds=kinds,
        rtol=float(checked.rtol),
    )
    if result.overdeclared:
        if checked.on_overdeclared == "raise":
            raise SupportLevelError(result)
        warnings.warn(str(SupportLevelError(result)), UserWarning, stacklevel=2)
    return result


def _managers(
    model: Callable[..., ModelOutput],
    inputs: Mapping[str, StaticInput],
    builder: AttentionMetadataBuilder[object],
    configs: Mapping[BatchKind, DispatchConfig],
    options: SupportCheckOptions,
    device: torch.device | str | int | None,
) -> dict[BatchKind, CUDAGraphManager[ModelOutput]]:
    """One strict manager per kind, its FULL graphs forced (``ALWAYS``: nothing downgraded); none captured."""
    if options.engine_factory is None and resolve_device(device).type != "cuda":
        raise ValueError(
            "device: checking FULL graphs needs a CUDA device or an options.engine_factory, "
            f"and the device is {resolve_device(device)}"
        )
    manager_options = options.manager_options(builder)
    managers = {
        kind: CUDAGraphManager(model, inputs, config, device=device, strict=True, options=manager_options)
        for kind, config in configs.items()
    }
    for kind, manager in managers.items():
        if not _replayed_keys(kind, manager):
            sizes = configs[kind].capture_sizes.sizes
            raise ValueError(f"options.sizes: {sizes} plan no FULL graph for {_what(kind, configs[kind])}")
    return managers


def _check_arguments(
    builder: object, make_batch: object, options: object
) -> tuple[AttentionSupport, SupportCheckOptions]:
    """The builder's declared support, and the options (``None``: the defaults); ``ValueError`` naming one."""
    if builder is None:
        raise ValueError("builder: expected an AttentionMetadataBuilder, got None")
    checked = check_builder("builder", builder)
    assert checked is not None
    if not callable(make_batch):
        raise ValueError(f"make_batch: expected a callable, got {make_batch!r:.80}")
    if options is None:
        return checked.support, SupportCheckOptions()
    if not isinstance(options, SupportCheckOptions):
        raise ValueError(f"options: expected SupportCheckOptions or None, got {options!r:.80}")
    return checked.support, options


def _capture_sizes(sizes: object) -> CaptureSizes:
    """``sizes`` as ``CaptureSizes`` (a ``CaptureSizes`` or an iterable of ints); ``ValueError`` naming it."""
    if isinstance(sizes, CaptureSizes):
        return sizes
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise ValueError(f"options.sizes: expected a sequence of integers >= 1, got {sizes!r:.80}")
    try:
        return CaptureSizes(sizes)
    except ValueError as error:
        raise ValueError(f"options.sizes{str(error).removeprefix('capture_sizes')}") from None


def _config(kind: BatchKind, sizes: CaptureSizes, max_num_seqs: int, query_len: int) -> DispatchConfig:
    """The kind's manager: decode-only FULL graphs of its query length, or FULL graphs of mixed batches."""
    if kind is BatchKind.MIXED:
        return DispatchConfig(CUDAGraphMode.FULL, sizes, max_num_seqs)
    q = 1 if kind is BatchKind.UNIFORM_SINGLE_TOKEN else query_len
    return DispatchConfig(CUDAGraphMode.FULL_DECODE_ONLY, sizes, max_num_seqs, q)


def _what(kind: BatchKind, config: DispatchConfig) -> str:
    """The batches of ``kind`` in words, and the sizes they need."""
    if kind is BatchKind.MIXED:
        return "mixed batches (a size >= 2 is needed)"
    q = config.uniform_decode_query_len
    return (
        f"uniform batches of {q} token(s) per request (a multiple of {q} up to "
        f"{q} * max_num_seqs = {q * config.max_num_seqs} is needed)"
    )


def _replayed_keys(kind: BatchKind, manager: CUDAGraphManager[ModelOutput]) -> list[BatchDescriptor]:
    """The manager's FULL keys that batches of ``kind`` are padded to, smallest first (mixed: 2+ tokens)."""
    keys = sorted(manager.dispatcher.keys(CUDAGraphMode.FULL), key=lambda key: key.num_tokens)
    return [key for key in keys if kind is not BatchKind.MIXED or key.num_tokens >= 2]


def _verified(kinds: Sequence[KindCheck]) -> GraphSupport:
    """The highest level whose promised kinds all held (levels are cumulative)."""
    verified = GraphSupport.NEVER
    for check in sorted(kinds, key=lambda check: check.kind.level):
        if not check.held:
            break
        verified = check.kind.level
    return verified


@dataclasses.dataclass(frozen=True, slots=True)
class _Run:
    """What every kind's check shares: the model and its seam, the batches, the tolerance."""

    model: Callable[..., ModelOutput]
    inputs: Mapping[str, StaticInput]
    builder: AttentionMetadataBuilder[object]
    make_batch: MakeBatch
    trials: int
    rtol: float
    generator: torch.Generator


def _check_kind(run: _Run, kind: BatchKind, manager: CUDAGraphManager[ModelOutput]) -> KindCheck:
    """Capture ``kind``'s graphs, replay random batches of the kind on them, compare with eager; free them."""
    keys = _replayed_keys(kind, manager)
    query_len = None if kind is BatchKind.MIXED else keys[0].num_tokens // (keys[0].num_reqs or 1)
    checked = functools.partial(KindCheck, kind=kind, query_len=query_len, graphs=tuple(keys))
    try:
        try:
            manager.capture(progress=False)
        except Exception as error:  # a capture that raises serves no batch of the kind
            return checked(batches=0, worst_error=0.0, failure=f"the capture raised {_describe(error)}")
        worst, worst_at, batches = 0.0, "", 0
        for num_tokens, num_reqs, key in _counts(run, kind, keys):
            batch = _batch(run, kind, num_tokens, num_reqs, manager.device)
            where = f"a batch of {num_tokens} tokens, {num_reqs} requests (graph of {key.num_tokens} tokens)"
            try:
                replayed = [
                    t.clone() for t in _leaves(manager.run_batch(batch, uniform_decode=query_len is not None))
                ]
            except Exception as error:  # the replay's own error: the kind does not hold
                return checked(
                    batches=batches, worst_error=worst, failure=f"{where} raised {_describe(error)}"
                )
            relative = _error(replayed, _eager(run, batch, num_tokens, num_reqs, query_len is not None))
            batches += 1
            if relative > worst or batches == 1:
                worst, worst_at = relative, where
    finally:
        manager.clear()
    failure = None if worst <= run.rtol else f"relative error {worst:.3g} > rtol {run.rtol:g} on {worst_at}"
    return checked(batches=batches, worst_error=worst, failure=failure)


def _counts(
    run: _Run, kind: BatchKind, keys: Sequence[BatchDescriptor]
) -> list[tuple[int, int, BatchDescriptor]]:
    """``(num_tokens, num_reqs, key)`` of ``run.trials`` random batches padded to each key, smallest first.

    Uniform: ``num_reqs`` above the previous key's and up to the key's,
    ``query_len`` tokens each. Mixed: 2+ tokens above the previous key's
    and up to the key's, in fewer requests than tokens (one request at least
    holds two), at most ``max_num_seqs`` (the key's own request rows).
    """
    drawn: list[tuple[int, int, BatchDescriptor]] = []
    previous_tokens = previous_reqs = 0
    for key in keys:
        key_reqs = key.num_reqs or 1
        for _ in range(run.trials):
            if kind is BatchKind.MIXED:
                num_tokens = _draw(run.generator, max(previous_tokens + 1, 2), key.num_tokens)
                num_reqs = _draw(run.generator, 1, min(num_tokens - 1, key_reqs))
            else:
                num_reqs = _draw(run.generator, previous_reqs + 1, key_reqs)
                num_tokens = num_reqs * (key.num_tokens // key_reqs)
            drawn.append((num_tokens, num_reqs, key))
        previous_tokens, previous_reqs = key.num_tokens, key_reqs
    return drawn


def _draw(generator: torch.Generator, low: int, high: int) -> int:
    """A uniform integer in ``[low, high]``."""
    return int(torch.randint(low, high + 1, (), generator=generator).item())


def _batch(
    run: _Run, kind: BatchKind, num_tokens: int, num_reqs: int, device: torch.device
) -> Mapping[str, torch.Tensor]:
    """``make_batch``'s batch, checked as a step's inputs are (``ValueError`` naming ``make_batch``).

    Its names, and each tensor's rows, trailing shape, dtype and device: a
    batch the manager would refuse is ``make_batch``'s fault, never the
    attention's (the kind's check would report it as failing).
    """
    batch: object = run.make_batch(kind, num_tokens, num_reqs, run.generator)
    if not isinstance(batch, Mapping) or set(batch) != set(run.inputs):
        raise ValueError(
            f"make_batch: expected a mapping with the inputs {sorted(run.inputs)}, got {batch!r:.120}"
        )
    for name, spec in run.inputs.items():
        tensor: object = batch[name]
        rows = num_tokens if spec.rows == "tokens" else num_reqs if spec.rows == "reqs" else None
        shape = spec.shape if rows is None else (rows, *spec.shape)
        if (
            not isinstance(tensor, torch.Tensor)
            or tuple(tensor.shape) != shape
            or tensor.dtype != spec.dtype
            or tensor.device != device
        ):
            got = (
                f"shape {tuple(tensor.shape)} of {tensor.dtype} on {tensor.device}"
                if isinstance(tensor, torch.Tensor)
                else f"{tensor!r:.80}"
            )
            raise ValueError(
                f"make_batch: input {name!r} of a {kind.value} batch of {num_tokens} tokens and "
                f"{num_reqs} requests: expected a tensor of shape {shape} of {spec.dtype} on {device}, "
                f"got {got}"
            )
    return batch


def _eager(
    run: _Run, batch: Mapping[str, torch.Tensor], num_tokens: int, num_reqs: int, uniform: bool
) -> list[torch.Tensor]:
    """The reference: the model on the real batch under NONE, with the builder's metadata (an eager step)."""
    descriptor = BatchDescriptor(num_tokens, num_reqs, True) if uniform else BatchDescriptor(num_tokens)
    shape = BatchShape.eager(num_tokens, num_reqs, uniform)
    extra = build_extra(run.builder, StepBatch(num_tokens, num_reqs, batch), shape)
    with set_forward_context(CUDAGraphMode.NONE, descriptor, **extra):
        return _leaves(run.model(**batch))


def _leaves(output: object) -> list[torch.Tensor]:
    """The tensors of a model's output (a tensor, or a flat tuple, list or dict of them)."""
    leaves = output_leaves(output)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if len(tensors) != len(leaves):  # not a tensor, or a leaf that is none
        raise TypeError(
            f"model: expected a tensor or a flat tuple, list or dict of tensors, got {output!r:.80}"
        )
    return tensors


def _error(replayed: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> float:
    """The largest relative error (L2, float64) of the outputs; ``inf``: a mismatch or a non-finite value."""
    if len(replayed) != len(expected):
        return math.inf
    worst = 0.0
    for actual, reference in zip(replayed, expected, strict=True):
        if actual.shape != reference.shape:
            return math.inf
        a, b = actual.detach().to(torch.float64), reference.detach().to(torch.float64)
        diff = float(torch.linalg.vector_norm(a - b).item())
        norm = float(torch.linalg.vector_norm(b).item())
        error = diff / norm if norm > 0.0 else (0.0 if diff == 0.0 else math.inf)
        worst = max(worst, error if math.isfinite(error) else math.inf)
    return worst


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
