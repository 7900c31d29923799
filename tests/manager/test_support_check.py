"""``check_attention_support``: a declared level checked by FULL graphs replayed against eager.

The toy attention below is a causal sum of ``v = x W`` over each request's
earlier tokens, computed as a loop of ``max_query_len - 1`` shifted adds: the
loop bound is a host value of its metadata, which a FULL graph bakes, as
FlashAttention's ``max_seqlen_q`` or a split count is baked. A bound at least
the batch's longest request is right; a smaller one drops terms. The toy
builder serves a level (``serves``: the host values it gives the shapes it
serves depend on the shape alone) and declares one (``declares``): honest
when the two agree, over-declared when it declares more. For a graph shape it
does not serve it gives the capture the value of a decode batch (1), as a
backend that assumes single-token decode does, so the baked loop is wrong.

On the CPU a graph is simulated by ``BakingEngine``: its replay re-runs the
model under the forward context its recording saw, so the host values of
``build_for_capture`` are baked while the builder's persistent buffers
(positions) are refilled per step, as on a GPU. The ``gpu`` tests run the same
toy with the real engines.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Final, Generic, TypeVar, cast

import pytest
import torch
from torch import nn

from cudagraph_capture import CaptureOptions
from cudagraph_capture.lowlevel import RecordSeconds
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, get_forward_context, set_forward_context
from cudagraph_dispatch.support import AttentionSupport, GraphSupport
from cudagraph_manager import StaticInput
from cudagraph_manager._support_check import KindCheck, SupportCheck
from cudagraph_manager.attention import (
    BatchKind,
    BatchShape,
    StepBatch,
    SupportCheckOptions,
    SupportLevelError,
    attention_metadata,
    check_attention_support,
)
from tests.test_readmes import ROOT, python_blocks
from tests.torch_support import as_tensor, highest_fp32_matmul_precision

if TYPE_CHECKING:
    from examples.paged.split_decode import Prefill

R = TypeVar("R")

DIM: Final = 16
SIZES: Final = (1, 2, 4, 8, 16)
MAX_NUM_SEQS: Final = 8
INPUTS: Final[Mapping[str, StaticInput]] = {
    "x": StaticInput((DIM,), torch.float32, "tokens"),
    "query_lens": StaticInput((), torch.int64, "reqs", pad_value=0),
}
ALWAYS: Final = GraphSupport.ALWAYS
UNIFORM_BATCH: Final = GraphSupport.UNIFORM_BATCH
SINGLE: Final = GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
NEVER: Final = GraphSupport.NEVER


# ---------------------------------------------------------------------------
# The toy attention: a builder, a model, batches
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ToyMetadata:
    """``positions [T]``: each token's index in its request (a view of the builder's buffer).

    ``max_query_len``: the loop bound, a host value (a FULL graph bakes it).
    """

    positions: torch.Tensor
    max_query_len: int


class ToyBuilder:
    """Serves ``serves``, declares ``declares`` (``support``); positions in a buffer sized once."""

    def __init__(self, serves: GraphSupport, declares: GraphSupport, device: torch.device) -> None:
        self.support = AttentionSupport(declares, piecewise=False, name=f"toy {serves.name.lower()}")
        self.serves = serves
        self.builds = 0
        self._positions = torch.zeros(max(SIZES), dtype=torch.int64, device=device)  # [max tokens]

    def build(self, batch: StepBatch, shape: BatchShape, /) -> ToyMetadata:
        self.builds += 1
        positions = self._positions[: shape.num_tokens]
        real = batch.num_tokens
        lens = batch.inputs.get("query_lens")  # [num_reqs]; None for an all-padding batch
        if lens is not None and real:
            starts = torch.cumsum(lens, 0) - lens  # [num_reqs]
            reqs = torch.arange(batch.num_reqs, device=lens.device)
            of_token = torch.repeat_interleave(reqs, lens, output_size=real)  # [real]
            positions[:real].copy_(torch.arange(real, device=lens.device) - starts[of_token])
        # One padding request holds every padding token (as pad_offsets lays them out).
        positions[real:].copy_(torch.arange(shape.num_tokens - real, device=positions.device))
        longest = int(lens.max()) if lens is not None and real else 0
        if shape.mode is CUDAGraphMode.NONE:  # eager: the real batch's own bound
            return ToyMetadata(positions, max(longest, shape.num_tokens - real, 1))
        return ToyMetadata(positions, self._graph_bound(shape, max(longest, 1)))

    def build_for_capture(self, shape: BatchShape, /) -> ToyMetadata:
        return ToyMetadata(self._positions[: shape.num_tokens], self._graph_bound(shape, 1))

    def _graph_bound(self, shape: BatchShape, of_batch: int) -> int:
        """Shape-only where it serves the shape; else the batch's own (at capture: a decode batch's, 1)."""
        q = shape.query_len
        if (q == 1 and self.serves >= SINGLE) or (q is not None and self.serves >= UNIFORM_BATCH):
            return q
        if q is None and self.serves >= ALWAYS:
            return shape.num_tokens  # no request of the shape is longer
        return of_batch


class ToyAttentionModel(nn.Module):
    """``out[t] = sum of v[s]`` over the tokens ``s <= t`` of ``t``'s request, ``v = x W``: ``[T, DIM]``."""

    def __init__(self, builder: ToyBuilder, device: torch.device) -> None:
        super().__init__()
        self.builder = builder
        self.w = nn.Parameter(torch.randn(DIM, DIM, device=device) / math.sqrt(DIM), requires_grad=False)
        self.calls = 0

    def forward(self, x: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor:
        # x: [T, DIM]; query_lens: [R] (read by the builder, not here)
        self.calls += 1
        meta = attention_metadata(self.builder)
        v = x @ self.w  # [T, DIM]
        out = v.clone()
        for j in range(1, min(meta.max_query_len, x.shape[0])):  # the baked host value
            earlier = torch.zeros_like(v)
            earlier[j:] = v[:-j]  # token t sees v[t - j]
            out += earlier * (meta.positions >= j)[:, None]  # if t - j is in t's request
        return out


def toy_batches(
    device: torch.device,
) -> Callable[[BatchKind, int, int, torch.Generator], dict[str, torch.Tensor]]:
    """``make_batch``: random ``x``; uniform lengths, or one long request among one-token ones."""

    def make(
        kind: BatchKind, num_tokens: int, num_reqs: int, generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        if kind is BatchKind.MIXED:
            lens = torch.ones(num_reqs, dtype=torch.int64)
            lens[int(torch.randint(num_reqs, (), generator=generator))] += num_tokens - num_reqs
        else:
            lens = torch.full((num_reqs,), num_tokens // num_reqs, dtype=torch.int64)
        x = torch.randn(num_tokens, DIM, generator=generator)
        return {"x": x.to(device), "query_lens": lens.to(device)}

    return make


# ---------------------------------------------------------------------------
# A FULL graph on the CPU: the recording's host values baked into the replay
# ---------------------------------------------------------------------------


def _callers_extra() -> Mapping[str, object]:
    context = get_forward_context()
    return {} if context is None else dict(context.extra)


class BakedEntry(Generic[R]):
    """A replay re-runs the model on the kept inputs under the recording's context (its metadata)."""

    def __init__(
        self, engine: BakingEngine[R], descriptor: BatchDescriptor, inputs: dict[str, torch.Tensor]
    ) -> None:
        self._engine = engine
        self.descriptor = descriptor
        self.seconds = RecordSeconds(0.0, 0.0)
        self._inputs = inputs
        self._extra = _callers_extra()  # what build_for_capture gave the recording: baked
        self._output = self._run()

    @property
    def output(self) -> R:
        return self._output

    @property
    def replay(self) -> Callable[[], object]:
        return self._replay

    def _run(self) -> R:
        with set_forward_context(self._engine.mode, self.descriptor, **self._extra):
            return self._engine.model(**self._inputs)

    def _replay(self) -> None:
        as_tensor(self._output).copy_(as_tensor(self._run()))


class BakingEngine(Generic[R]):
    """A ``GraphEngine`` whose entries bake the recording's forward context (see the module docstring)."""

    def __init__(self, model: Callable[..., R], mode: CUDAGraphMode) -> None:
        self.model = model
        self.mode = mode
        self.entries: weakref.WeakSet[BakedEntry[R]] = weakref.WeakSet()
        self.recorded = 0

    def warm_up(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> None:
        with set_forward_context(CUDAGraphMode.NONE, descriptor, **_callers_extra()):
            self.model(**inputs)

    def record(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> BakedEntry[R]:
        entry = BakedEntry(self, descriptor, dict(inputs))
        self.entries.add(entry)
        self.recorded += 1
        return entry


class BakingEngines:
    """A ``GraphEngineFactory`` of ``BakingEngine``s that keeps what it built."""

    def __init__(self) -> None:
        self.engines: list[BakingEngine[object]] = []

    def __call__(
        self, model: Callable[..., R], mode: CUDAGraphMode, options: CaptureOptions
    ) -> BakingEngine[R]:
        engine = BakingEngine(model, mode)
        self.engines.append(engine)  # type: ignore[arg-type]  # kept for counting only
        return engine


# ---------------------------------------------------------------------------
# Running the check
# ---------------------------------------------------------------------------

BACKENDS: Final = ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))


@dataclasses.dataclass(frozen=True, slots=True)
class Toy:
    builder: ToyBuilder
    model: ToyAttentionModel
    device: torch.device
    engines: BakingEngines | None

    @classmethod
    def of(cls, backend: str, serves: GraphSupport, declares: GraphSupport) -> Toy:
        torch.manual_seed(0)
        device = (
            torch.device("cpu") if backend == "cpu" else torch.device("cuda", torch.cuda.current_device())
        )
        builder = ToyBuilder(serves, declares, device)
        return cls(
            builder, ToyAttentionModel(builder, device), device, BakingEngines() if backend == "cpu" else None
        )

    def check(self, **fields: object) -> SupportCheck:
        with highest_fp32_matmul_precision():  # no TF32: held kinds replay eager's values to rounding
            return self._check(fields)

    def _check(self, fields: Mapping[str, object]) -> SupportCheck:
        options = SupportCheckOptions(
            sizes=SIZES,
            max_num_seqs=MAX_NUM_SEQS,
            engine_factory=self.engines,
            **fields,  # type: ignore[arg-type]  # the tests' option fields, checked when built
        )
        return check_attention_support(
            self.model, INPUTS, self.builder, toy_batches(self.device), device=self.device, options=options
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", [SINGLE, UNIFORM_BATCH, ALWAYS])
def test_an_honest_backend_is_verified_at_its_level(backend: str, level: GraphSupport) -> None:
    check = Toy.of(backend, serves=level, declares=level).check()
    assert (check.declared, check.verified, check.overdeclared) == (level, level, False)
    for kind in check.kinds:
        assert kind.held == (kind.kind.level <= level), kind
        if kind.held:
            assert kind.worst_error < 1e-5, kind


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("serves", "declares"), [(UNIFORM_BATCH, ALWAYS), (SINGLE, ALWAYS), (SINGLE, UNIFORM_BATCH)]
)
def test_an_overdeclared_backend_is_caught(
    backend: str, serves: GraphSupport, declares: GraphSupport
) -> None:
    with pytest.raises(
        SupportLevelError, match=f"declares {declares.name}.*only up to {serves.name}"
    ) as raised:
        Toy.of(backend, serves=serves, declares=declares).check()
    check = raised.value.check
    assert (check.declared, check.verified, check.overdeclared) == (declares, serves, True)
    failed = [kind for kind in check.kinds if not kind.held]
    assert [kind.kind.level for kind in failed] == [
        level for level in (UNIFORM_BATCH, ALWAYS) if level > serves
    ]
    for kind in failed:
        assert kind.worst_error > 0.1, kind  # garbage, not rounding
        assert kind.failure is not None
        assert "relative error" in kind.failure
        assert "rtol 0.01" in kind.failure
        assert (kind.failure in str(raised.value)) == (
            kind.kind.level <= declares
        )  # what the declaration promised


def test_warn_returns_the_report_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="declares ALWAYS, but its FULL graphs replay correctly only up to"):
        check = Toy.of("cpu", serves=UNIFORM_BATCH, declares=ALWAYS).check(on_overdeclared="warn")
    assert check.verified is UNIFORM_BATCH
    assert check.overdeclared


def test_an_underdeclared_backend_passes_and_reports_its_real_level() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check = Toy.of("cpu", serves=ALWAYS, declares=SINGLE).check(on_overdeclared="warn")
    assert (check.declared, check.verified, check.overdeclared) == (SINGLE, ALWAYS, False)


def test_every_kind_replays_every_graph_trials_times_and_frees_them() -> None:
    toy = Toy.of("cpu", serves=ALWAYS, declares=ALWAYS)
    check = toy.check(trials=3, query_len=4)
    single, uniform, mixed = (check.kind(kind) for kind in BatchKind)
    assert [k.num_tokens for k in single.graphs] == [1, 2, 4, 8]
    assert (single.query_len, single.batches) == (1, 12)
    assert [(k.num_tokens, k.num_reqs) for k in uniform.graphs] == [(4, 1), (8, 2), (16, 4)]
    assert (uniform.query_len, uniform.batches) == (4, 9)
    assert [k.num_tokens for k in mixed.graphs] == [2, 4, 8, 16]  # a mixed batch has 2 tokens at least
    assert (mixed.query_len, mixed.batches) == (None, 12)
    assert all(g.uniform for g in single.graphs + uniform.graphs)
    assert not any(g.uniform for g in mixed.graphs)
    assert toy.engines is not None
    assert [engine.mode for engine in toy.engines.engines] == [CUDAGraphMode.FULL] * 3  # FULL graphs only
    assert sum(engine.recorded for engine in toy.engines.engines) == 4 + 3 + 5  # the 1-token mixed key too
    gc.collect()
    assert not any(engine.entries for engine in toy.engines.engines), "graphs left alive"


def test_the_report_reads_as_a_table() -> None:
    check = Toy.of("cpu", serves=UNIFORM_BATCH, declares=UNIFORM_BATCH).check()
    lines = str(check).splitlines()
    assert lines[0] == (
        "attention 'toy uniform_batch': declared UNIFORM_BATCH, verified UNIFORM_BATCH "
        "(FULL graphs against eager, rtol 0.01)"
    )
    assert lines[1].startswith("  uniform_single_token (q=1): 8 batches on 4 graphs")
    assert lines[1].endswith("; held")
    assert lines[3].startswith("  mixed (mixed): 8 batches on 4 graphs")
    assert "FAILED: relative error" in lines[3]


class FailingCaptureBuilder(ToyBuilder):
    """Declares ALWAYS; its ``build_for_capture`` raises: no kind can be captured."""

    def build_for_capture(self, shape: BatchShape, /) -> ToyMetadata:
        raise RuntimeError("no capture metadata here")


class FailingMixedReplayBuilder(ToyBuilder):
    """Serves ALWAYS, except that ``build`` of a mixed graph's batch raises (at replay time)."""

    def build(self, batch: StepBatch, shape: BatchShape, /) -> ToyMetadata:
        if batch.num_tokens and shape.query_len is None and shape.mode is CUDAGraphMode.FULL:
            raise RuntimeError("mixed batches are not supported")
        return ToyBuilder.build(self, batch, shape)


def test_a_kind_whose_capture_raises_fails_with_the_error() -> None:
    toy = Toy.of("cpu", serves=ALWAYS, declares=ALWAYS)
    builder = FailingCaptureBuilder(ALWAYS, ALWAYS, toy.device)
    with pytest.raises(SupportLevelError, match="only up to NEVER") as raised:
        dataclasses.replace(toy, builder=builder, model=ToyAttentionModel(builder, toy.device)).check()
    for kind in raised.value.check.kinds:
        assert (kind.batches, kind.worst_error) == (0, 0.0)
        assert kind.failure is not None
        assert kind.failure.startswith("the capture raised CaptureError")
        assert "no capture metadata here" in kind.failure


def test_a_replay_that_raises_fails_its_kind() -> None:
    toy = Toy.of("cpu", serves=ALWAYS, declares=ALWAYS)
    builder = FailingMixedReplayBuilder(ALWAYS, ALWAYS, toy.device)
    with pytest.warns(UserWarning, match="mixed: a batch of"):
        check = dataclasses.replace(toy, builder=builder, model=ToyAttentionModel(builder, toy.device)).check(
            on_overdeclared="warn"
        )
    mixed = check.kind(BatchKind.MIXED)
    assert mixed.batches == 0
    assert mixed.failure is not None
    assert "raised RuntimeError: mixed batches are not supported" in mixed.failure
    assert check.verified is UNIFORM_BATCH


def test_the_same_seed_draws_the_same_batches() -> None:
    first = Toy.of("cpu", serves=SINGLE, declares=SINGLE).check(seed=7)
    second = Toy.of("cpu", serves=SINGLE, declares=SINGLE).check(seed=7)
    assert first == second
    other = Toy.of("cpu", serves=SINGLE, declares=SINGLE).check(seed=8)
    assert other != first  # another seed draws other batches (their errors differ): no vacuous equality


# ---------------------------------------------------------------------------
# Argument checks: before anything runs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "fields", "match"),
    [
        ({"make_batch": "not callable"}, {}, "^make_batch: expected a callable"),
        ({"builder": None}, {}, "^builder: expected an AttentionMetadataBuilder, got None"),
        ({"builder": object()}, {}, "^builder: expected an AttentionMetadataBuilder.*lacks build"),
        ({"model": 3}, {}, "^model: expected a callable"),
        ({"inputs": [1]}, {}, "inputs"),
        ({"options": {"sizes": (1,)}}, {}, r"^options: expected SupportCheckOptions or None, got \{'sizes'"),
        ({}, {"sizes": ()}, r"^options\.sizes: expected at least one size"),
        ({}, {"sizes": (0, 2)}, r"^options\.sizes\[0\]: expected an integer >= 1"),
        ({}, {"sizes": "12"}, r"^options\.sizes: expected a sequence of integers"),
        ({}, {"sizes": 4}, r"^options\.sizes: expected a sequence of integers"),
        ({}, {"sizes": (3,)}, r"^options\.sizes: \(3,\) plan no FULL graph for uniform batches of 2 token"),
        ({}, {"sizes": (16,)}, r"^options\.sizes: .* plan no FULL graph for uniform batches of 1 token"),
        ({}, {"max_num_seqs": 0}, r"^options\.max_num_seqs: expected an integer >= 1, got 0"),
        ({}, {"max_num_seqs": True}, r"^options\.max_num_seqs: expected an integer >= 1, got True"),
        ({}, {"query_len": 1}, r"^options\.query_len: expected an integer >= 2, got 1"),
        ({}, {"query_len": 2.0}, r"^options\.query_len: expected an integer >= 2, got 2.0"),
        ({}, {"trials": 0}, r"^options\.trials: expected an integer >= 1, got 0"),
        ({}, {"rtol": 0.0}, r"^options\.rtol: expected a finite number > 0, got 0.0"),
        ({}, {"rtol": math.nan}, r"^options\.rtol: expected a finite number > 0, got nan"),
        ({}, {"rtol": True}, r"^options\.rtol: expected a finite number > 0, got True"),
        ({}, {"rtol": "1e-2"}, r"^options\.rtol: expected a finite number > 0"),
        ({}, {"seed": 1.5}, r"^options\.seed: expected an integer, got 1.5"),
        ({}, {"seed": False}, r"^options\.seed: expected an integer, got False"),
        (
            {},
            {"on_overdeclared": "ignore"},
            r"^options\.on_overdeclared: expected 'raise' or 'warn', got 'ignore'",
        ),
        (
            {},
            {"engine_factory": None},
            r"^device: checking FULL graphs needs a CUDA device or an options\.engine_factory",
        ),
        ({}, {"engine_factory": 3}, r"^options\.engine_factory: expected None or a GraphEngineFactory"),
        (
            {},
            {"output_rows": "rows"},
            r"^options\.output_rows: expected 'tokens', 'reqs' or None, got 'rows'",
        ),
    ],
)
def test_bad_arguments_raise_before_anything_runs(
    arguments: dict[str, object], fields: dict[str, object], match: str
) -> None:
    """A bad argument raises when the check is called; a bad option field when its options are built."""
    toy = Toy.of("cpu", serves=ALWAYS, declares=ALWAYS)
    make_options = cast(Callable[..., SupportCheckOptions], SupportCheckOptions)  # fields of any type

    def check() -> SupportCheck:
        given: dict[str, object] = {
            "model": toy.model,
            "inputs": INPUTS,
            "builder": toy.builder,
            "make_batch": toy_batches(toy.device),
            "device": "cpu",
            "options": make_options(
                **{"sizes": SIZES, "max_num_seqs": MAX_NUM_SEQS, "engine_factory": toy.engines, **fields}
            ),
            **arguments,
        }
        return check_attention_support(**given)  # type: ignore[arg-type]  # deliberately wrong arguments

    with pytest.raises(ValueError, match=match):
        check()
    assert (toy.model.calls, toy.builder.builds) == (0, 0)


def test_a_bad_batch_names_make_batch() -> None:
    toy = Toy.of("cpu", serves=ALWAYS, declares=ALWAYS)
    good = toy_batches(toy.device)

    def short(kind: BatchKind, num_tokens: int, num_reqs: int, g: torch.Generator) -> dict[str, torch.Tensor]:
        batch = good(kind, num_tokens, num_reqs, g)
        return {"x": batch["x"][:-1], "query_lens": batch["query_lens"]}

    with pytest.raises(ValueError, match="make_batch: input 'x' of a uniform_single_token batch of 1 tokens"):
        check_attention_support(
            toy.model,
            INPUTS,
            toy.builder,
            short,
            device="cpu",
            options=SupportCheckOptions(engine_factory=toy.engines),
        )
    with pytest.raises(ValueError, match="make_batch: expected a mapping with the inputs"):
        check_attention_support(
            toy.model,
            INPUTS,
            toy.builder,
            lambda *_: {"x": torch.zeros(1, DIM)},
            device="cpu",
            options=SupportCheckOptions(engine_factory=toy.engines),
        )


def test_the_report_types_are_frozen() -> None:
    check = Toy.of("cpu", serves=ALWAYS, declares=ALWAYS).check()
    with pytest.raises(dataclasses.FrozenInstanceError):
        check.verified = NEVER  # type: ignore[misc]  # frozen on purpose
    with pytest.raises(dataclasses.FrozenInstanceError):
        check.kinds[0].failure = "x"  # type: ignore[misc]  # frozen on purpose
    assert isinstance(check.kinds[0], KindCheck)
    assert issubclass(SupportLevelError, ValueError)
    assert [kind.level for kind in BatchKind] == [SINGLE, UNIFORM_BATCH, ALWAYS]


# ---------------------------------------------------------------------------
# The README's example: the seam example's builder, checked
# ---------------------------------------------------------------------------


def _readme_check(*, baking: bool) -> SupportCheck:
    blocks = python_blocks(ROOT / "packages/manager/README.md")
    (seam,) = [block for block in blocks if "metadata_builder=builder" in block]
    (example,) = [block for block in blocks if "check_attention_support(" in block]
    if baking:  # the graphs' stand-in, which needs no GPU
        example = example.replace(
            "max_num_seqs=MAX_REQS", "max_num_seqs=MAX_REQS, engine_factory=BakingEngines()"
        )
    namespace: dict[str, object] = {"__name__": "__main__", "BakingEngines": BakingEngines}
    exec(compile(seam + "\n" + example, "packages/manager/README.md", "exec", dont_inherit=True), namespace)
    check = namespace["check"]
    assert isinstance(check, SupportCheck)
    return check


def test_the_readme_example_verifies_the_seam_examples_builder() -> None:
    check = _readme_check(baking=True)
    assert (check.declared, check.verified) == (ALWAYS, ALWAYS)
    assert all(kind.held and kind.batches > 0 for kind in check.kinds)


@pytest.mark.gpu
def test_the_readme_example_runs_as_written() -> None:
    check = _readme_check(baking=False)
    assert (check.declared, check.verified) == (ALWAYS, ALWAYS)


# ---------------------------------------------------------------------------
# A paged example backend: split_decode serves single-token decodes only
# ---------------------------------------------------------------------------


def _split_decode_check(
    backend: str, declare: GraphSupport, prefill: Prefill = "planned", dtype: torch.dtype = torch.float32
) -> SupportCheck:
    """The check over ``SplitDecodeAttention`` in ``test_paged_kernels``' one-layer model, in ``dtype``."""
    from examples.paged.batch import paged_static_inputs
    from examples.paged.split_decode import SplitDecodeAttention
    from tests.manager.test_paged_kernels import _AttentionModel, _layout, random_step

    device = torch.device("cpu") if backend == "cpu" else torch.device("cuda", torch.cuda.current_device())
    layout = _layout()
    attention = SplitDecodeAttention(
        layout, max_tokens=32, max_reqs=8, device=device, declare=declare, prefill=prefill
    )
    torch.manual_seed(0)
    model = _AttentionModel(attention).to(device, dtype)
    model.kv_cache = model.kv_cache.to(device, dtype)

    def make(kind: BatchKind, num_tokens: int, num_reqs: int, g: torch.Generator) -> dict[str, torch.Tensor]:
        longest = num_tokens - num_reqs + 1 if kind is BatchKind.MIXED else num_tokens // num_reqs
        lens = (longest,) + (num_tokens // num_reqs if kind is not BatchKind.MIXED else 1,) * (num_reqs - 1)
        step = random_step(layout, lens, seed=int(torch.randint(2**31, (), generator=g)))
        inputs = dict(step.inputs, input_ids=torch.randint(0, 50, (num_tokens,), generator=g))
        return {name: t.to(device) for name, t in inputs.items()}

    with highest_fp32_matmul_precision():
        return check_attention_support(
            model,
            paged_static_inputs(layout),
            attention,
            make,
            device=device,
            options=SupportCheckOptions(
                sizes=(1, 2, 4, 8, 16, 32),
                max_num_seqs=8,
                engine_factory=BakingEngines() if backend == "cpu" else None,
            ),
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_decode_is_verified_at_its_level_or_above(backend: str) -> None:
    check = _split_decode_check(backend, SINGLE)
    # Its FULL uniform graphs of q > 1 hold too: a uniform key's shape plan is every uniform batch's plan.
    assert (check.declared, check.verified, check.overdeclared) == (SINGLE, UNIFORM_BATCH, False)
    assert check.kind(BatchKind.UNIFORM_SINGLE_TOKEN).worst_error < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_decode_over_declared_is_caught(backend: str) -> None:
    with pytest.raises(
        SupportLevelError,
        match=r"'split_decode' declares ALWAYS.*only up to UNIFORM_BATCH; mixed: relative error",
    ) as raised:
        _split_decode_check(backend, ALWAYS)
    assert raised.value.check.kind(BatchKind.MIXED).worst_error > 0.1


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_decode_with_the_varlen_prefill_is_verified_always(backend: str) -> None:
    """Its mixed batches take the varlen backend's path: every level holds, ``ALWAYS`` included.

    On CUDA in bfloat16: ``varlen_attn`` computes in half precision there.
    """
    dtype = torch.float32 if backend == "cpu" else torch.bfloat16
    check = _split_decode_check(backend, ALWAYS, prefill="varlen", dtype=dtype)
    assert (check.declared, check.verified, check.overdeclared) == (ALWAYS, ALWAYS, False)
    # A replay runs eager's kernels on the same inputs; bfloat16 leaves room for its rounding only.
    assert check.kind(BatchKind.MIXED).worst_error < (1e-4 if dtype == torch.float32 else 1e-2)


def _altered(name: str, alter: Callable[[torch.Tensor], object]) -> Callable[..., dict[str, object]]:
    """``toy_batches``' batches with input ``name`` altered: a ``make_batch`` of the wrong product."""
    good = toy_batches(torch.device("cpu"))

    def make(kind: BatchKind, num_tokens: int, num_reqs: int, g: torch.Generator) -> dict[str, object]:
        batch: dict[str, object] = dict(good(kind, num_tokens, num_reqs, g))
        batch[name] = alter(good(kind, num_tokens, num_reqs, g)[name])
        return batch

    return make


@pytest.mark.parametrize(
    ("name", "alter", "got"),
    [
        ("query_lens", lambda t: t.float(), "torch.float32"),  # issue 39: reported as "verified NEVER"
        ("query_lens", lambda t: t.to(torch.int32), "torch.int32"),
        ("x", lambda t: torch.cat([t, t[:, :1]], 1), f"shape (1, {DIM + 1})"),
        ("x", lambda t: t.to("meta"), "on meta"),
        ("x", lambda t: t.tolist(), "got [["),
    ],
)
def test_a_batch_the_manager_would_refuse_names_make_batch(
    name: str, alter: Callable[[torch.Tensor], object], got: str
) -> None:
    toy = Toy.of("cpu", serves=ALWAYS, declares=ALWAYS)
    with pytest.raises(
        ValueError, match=rf"^make_batch: input '{name}' of a uniform_single_token batch"
    ) as info:
        check_attention_support(
            toy.model,
            INPUTS,
            toy.builder,
            cast(Callable[..., dict[str, torch.Tensor]], _altered(name, alter)),  # the wrong product
            device="cpu",
            options=SupportCheckOptions(engine_factory=toy.engines),
        )
    assert got in str(info.value)
