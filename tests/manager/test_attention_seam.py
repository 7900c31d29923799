"""The attention seam on the CPU: which path builds the metadata, for which shape, and what comes back.

A toy attention (``SeamModel``) scales each request's rows by a per-request
value that only its builder holds (``ToyBuilder``: a buffer at a fixed
address, padded with 1), so a step whose metadata was not built for its own
batch gives a visibly wrong answer. The fake engines keep the graph contract:
a FULL replay re-runs the model under what its capture saw (the builder's
buffers), a PIECEWISE replay's eager break reads the step's context.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Final, NamedTuple

import pytest
import torch
from torch import nn

from cudagraph_capture import eager_break_during_capture
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, EagerReason, set_forward_context
from cudagraph_dispatch.support import AttentionSupport, GraphSupport
from cudagraph_manager import CUDAGraphManager, ManagerOptions, StaticInput
from cudagraph_manager.attention import (
    AttentionOptions,
    BatchShape,
    StepBatch,
    attention_metadata,
    metadata_extra,
    pad_rows,
)
from tests.manager.helpers import BACKENDS, Backend, assert_unchanged, config_for, snapshot

M: Final = CUDAGraphMode
DIM: Final = 8
MAX_REQS: Final = 8
INPUTS: Final[Mapping[str, StaticInput]] = {
    "x": StaticInput((DIM,), torch.float32, "tokens", pad_value=0.0),
    "scale": StaticInput((), torch.float32, "reqs", pad_value=1.0),
}


@dataclasses.dataclass(frozen=True, slots=True)
class ToyMetadata:
    shape: BatchShape
    scale: torch.Tensor  # [R]: the builder's buffer


class ToyBuilder:
    """Copies the real ``scale`` into its own buffer, padded with 1; logs every call."""

    def __init__(self, support: AttentionSupport | None = None, device: str = "cpu") -> None:
        self.support = support or AttentionSupport(GraphSupport.ALWAYS, name="toy")
        self.buffer = torch.ones(MAX_REQS, device=device)  # fixed address: what a graph reads
        self.calls: list[tuple[str, int, int, BatchShape]] = []
        self.built: list[ToyMetadata] = []
        self.refuse = False

    def build(self, batch: StepBatch, shape: BatchShape, /) -> ToyMetadata:
        if self.refuse:
            raise ValueError("scale: refused by the builder")
        self.calls.append(("build", batch.num_tokens, batch.num_reqs, shape))
        real = batch.inputs["scale"] if batch.num_reqs else self.buffer[:0]
        meta = ToyMetadata(shape, pad_rows(self.buffer[: shape.num_reqs], real, 1.0))
        self.built.append(meta)
        return meta

    def build_for_capture(self, shape: BatchShape, /) -> ToyMetadata:
        self.calls.append(("capture", 0, 0, shape))
        return ToyMetadata(shape, self.buffer[: shape.num_reqs])


class SeamModel(nn.Module):
    """``x`` times its request's scale (rows past the requests unscaled), read from the builder's metadata.

    Tokens belong to requests one to one, in order (a decode batch); the
    scaling is an eager break, so a PIECEWISE replay runs it for real.
    """

    def __init__(self, builder: ToyBuilder) -> None:
        super().__init__()
        self.builder = builder
        self.weight = nn.Parameter(torch.randn(DIM, DIM, device=builder.buffer.device), requires_grad=False)
        self.seen: list[ToyMetadata] = []
        self._attend = eager_break_during_capture(self._scale)

    def _scale(self, out: torch.Tensor, h: torch.Tensor) -> None:
        meta = attention_metadata(self.builder)  # typed: ToyMetadata
        self.seen.append(meta)
        out.copy_(h)
        k = min(h.shape[0], meta.scale.shape[0])
        out[:k].mul_(meta.scale[:k, None])

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = x @ self.weight  # [T, DIM]
        out = torch.empty_like(h)
        self._attend(out, h)
        return out @ self.weight


def _reference(model: SeamModel, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    scale = batch["scale"]
    h = batch["x"] @ model.weight
    h[: scale.shape[0]] *= scale[:, None]
    return h @ model.weight


def _batch(num_tokens: int, num_reqs: int, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch = {"x": torch.randn(num_tokens, DIM, generator=g), "scale": torch.rand(num_reqs, generator=g) + 2.0}
    return {name: t.to(device) for name, t in batch.items()}


def _manager(
    mode: CUDAGraphMode,
    builder: ToyBuilder,
    support: AttentionSupport | None = None,
    backend: Backend | None = None,
) -> tuple[CUDAGraphManager[torch.Tensor], SeamModel]:
    """A manager of a ``SeamModel`` on ``backend`` (default: the CPU with fake engines)."""
    backend = backend or Backend.of("cpu")
    model = SeamModel(builder)
    config = config_for(mode, sizes=(1, 2, 4, 8), max_num_seqs=MAX_REQS)
    manager = CUDAGraphManager(
        model,
        INPUTS,
        config,
        device=backend.device,
        options=ManagerOptions(
            engine_factory=backend.factory,
            attention=AttentionOptions(support=support, metadata_builder=builder),
        ),
    )
    return manager, model


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("mode", [M.FULL, M.PIECEWISE])
def test_a_replay_builds_for_its_padded_key_and_equals_eager(mode: CUDAGraphMode, backend_name: str) -> None:
    backend = Backend.of(backend_name)
    builder = ToyBuilder(device=backend.device.type)
    manager, model = _manager(mode, builder, backend=backend)
    manager.capture()
    for seed, (tokens, reqs) in enumerate([(3, 2), (5, 5), (1, 1), (7, 3), (2, 2), (8, 8)]):
        builder.calls.clear()
        batch = _batch(tokens, reqs, seed, backend.device.type)
        out = manager.run_batch(batch)
        padded = next(size for size in (1, 2, 4, 8) if size >= tokens)
        num_reqs = padded if mode is M.FULL else min(padded, MAX_REQS)
        assert builder.calls == [("build", tokens, reqs, BatchShape(padded, num_reqs, None, mode))]
        torch.testing.assert_close(out, _reference(model, batch))
    assert sum(manager.stats.replays.values()) == 6
    assert manager.stats.eager_steps == 0


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_piecewise_replay_hands_the_eager_attention_the_steps_metadata(backend_name: str) -> None:
    backend = Backend.of(backend_name)
    builder = ToyBuilder(device=backend.device.type)
    manager, model = _manager(M.PIECEWISE, builder, backend=backend)
    manager.capture()
    model.seen.clear()
    manager.run_batch(_batch(3, 2, 0, backend.device.type))
    assert model.seen == [builder.built[-1]]  # the very object build() returned for this step


def test_a_full_replay_reads_what_its_capture_recorded_with() -> None:
    builder = ToyBuilder()
    manager, model = _manager(M.FULL, builder)
    manager.capture()
    model.seen.clear()
    manager.run_batch(_batch(3, 2, 0))
    (seen,) = model.seen  # the fake graph replays its capture's metadata: the builder's buffers
    assert seen.scale.data_ptr() == builder.buffer.data_ptr()
    assert seen.shape == BatchShape(4, 4, None, M.FULL)


def test_capture_builds_padding_before_warm_ups_and_records_with_build_for_capture() -> None:
    builder = ToyBuilder()
    manager, _ = _manager(M.FULL_AND_PIECEWISE, builder)
    manager.capture()
    keys = {(mode, key) for mode, keys in manager.dispatcher.capture_plan() for key in keys}
    captured = [shape for kind, _, _, shape in builder.calls if kind == "capture"]
    assert sorted(captured, key=repr) == sorted(
        (BatchShape.of_key(mode, key, key.num_reqs or min(key.num_tokens, MAX_REQS)) for mode, key in keys),
        key=repr,
    )
    warmed = [(tokens, reqs, shape) for kind, tokens, reqs, shape in builder.calls if kind == "build"]
    assert warmed
    assert all(tokens == reqs == 0 for tokens, reqs, _ in warmed)  # all padding
    uniform = [shape for shape in captured if shape.uniform]
    assert uniform
    assert all(shape.query_len == 1 and shape.mode is M.FULL for shape in uniform)


def test_an_eager_step_builds_for_the_real_batch() -> None:
    builder = ToyBuilder()
    manager, model = _manager(M.FULL, builder)
    manager.capture()
    builder.calls.clear()
    batch = _batch(2, 2, 1)
    out = manager.run_batch(batch, invalid_modes=frozenset({M.FULL}))  # nothing else is planned
    assert builder.calls == [("build", 2, 2, BatchShape(2, 2, None, M.NONE))]
    torch.testing.assert_close(out, _reference(model, batch))
    builder.calls.clear()
    manager.run_batch(_batch(2, 2, 2), uniform_decode=True, invalid_modes=frozenset({M.FULL}))
    assert builder.calls == [("build", 2, 2, BatchShape(2, 2, 1, M.NONE))]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_released_and_woken_steps_build_on_every_path(backend_name: str) -> None:
    backend = Backend.of(backend_name)
    device = backend.device.type
    builder = ToyBuilder(device=device)
    manager, model = _manager(M.FULL, builder, backend=backend)
    manager.capture()
    manager.release()
    builder.calls.clear()
    batch = _batch(3, 3, 3, device)
    torch.testing.assert_close(manager.run_batch(batch), _reference(model, batch))
    assert builder.calls == [("build", 3, 3, BatchShape(3, 3, None, M.NONE))]
    assert manager.stats.eager_reasons == {EagerReason.RELEASED.value: 1}
    session = manager.start_capture()
    session.wait()
    builder.calls.clear()
    batch = _batch(3, 3, 4, device)
    torch.testing.assert_close(manager.run_batch(batch), _reference(model, batch))
    assert builder.calls == [("build", 3, 3, BatchShape(4, 4, None, M.FULL))]
    assert manager.stats.replays_of(M.FULL) == 1


def test_an_idle_ranks_dummy_step_builds_for_one_padding_row() -> None:
    builder = ToyBuilder()
    manager, model = _manager(M.FULL, builder)
    manager._path.eager.dummy_step()  # what a rank with no tokens runs while the others run eagerly
    assert builder.calls == [("build", 0, 0, BatchShape(1, 1, None, M.NONE))]
    assert model.seen[-1].scale.tolist() == [1.0]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_the_builders_support_resolves_the_mode_and_steps_are_counted(backend_name: str) -> None:
    backend = Backend.of(backend_name)
    decode_only = AttentionSupport(GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE, piecewise=True, name="toy")
    builder = ToyBuilder(decode_only, device=backend.device.type)
    manager, model = _manager(M.FULL, builder, backend=backend)
    resolution = manager.stats.resolution
    assert resolution is not None
    assert resolution.mode is M.FULL_AND_PIECEWISE
    manager.capture()
    mixed, decode = _batch(3, 2, 5, backend.device.type), _batch(3, 3, 6, backend.device.type)
    torch.testing.assert_close(manager.run_batch(mixed), _reference(model, mixed))
    torch.testing.assert_close(manager.run_batch(decode, uniform_decode=True), _reference(model, decode))
    assert dict(manager.stats.replays) == {(M.PIECEWISE, 4): 1, (M.FULL, 4): 1}
    assert [shape.mode for kind, *_, shape in builder.calls[-2:]] == [M.PIECEWISE, M.FULL]
    # ``AttentionOptions.support`` still overrides what the builder declares.
    overridden, _ = _manager(M.FULL, ToyBuilder(decode_only), support=AttentionSupport(name="override"))
    assert overridden.stats.resolution is not None
    assert overridden.stats.resolution.mode is M.FULL


def test_a_builder_that_refuses_a_batch_does_so_before_a_static_buffer_is_touched() -> None:
    builder = ToyBuilder()
    manager, _ = _manager(M.FULL, builder)
    manager.capture()
    manager.run_batch(_batch(3, 2, 7))
    before = snapshot(manager.static_buffers)
    builder.refuse = True
    with pytest.raises(ValueError, match="scale: refused"):
        manager.run_batch(_batch(4, 4, 8))
    assert_unchanged(before, manager.static_buffers)


def test_attention_metadata_outside_a_forward_or_for_another_builder_raises() -> None:
    builder, other = ToyBuilder(), ToyBuilder()
    with pytest.raises(RuntimeError, match="no attention metadata"):
        attention_metadata(builder)
    meta = other.build_for_capture(BatchShape(1, 1, None, M.NONE))
    with (
        set_forward_context(M.NONE, BatchDescriptor(1), **metadata_extra(other, meta)),
        pytest.raises(RuntimeError, match="built by"),
    ):
        attention_metadata(builder)
    with set_forward_context(M.NONE, BatchDescriptor(1), **metadata_extra(other, meta)):
        assert attention_metadata(other) is meta


@pytest.mark.parametrize("bad", [object(), "builder", 3])
def test_a_bad_builder_is_named(bad: object) -> None:
    with pytest.raises(
        ValueError, match=r"^attention\.metadata_builder: expected an AttentionMetadataBuilder"
    ):
        AttentionOptions(metadata_builder=bad)  # type: ignore[arg-type]  # the check under test


def test_a_builder_needs_a_request_input() -> None:
    with pytest.raises(
        ValueError, match=r"^options\.attention\.metadata_builder: .* no input has rows='reqs'"
    ):
        CUDAGraphManager(
            SeamModel(ToyBuilder()),
            {"x": INPUTS["x"]},
            config_for(M.FULL),
            device="cpu",
            options=ManagerOptions(attention=AttentionOptions(metadata_builder=ToyBuilder())),
        )


class _WrongProduct(ToyBuilder):
    """Fills its buffer as ``ToyBuilder`` does, but returns ``product`` (a missing or a tuple return).

    ``build`` does for real batches (a warm-up's padding builds right), else ``build_for_capture``.
    """

    def __init__(self, product: object, *, at_capture: bool = False) -> None:
        super().__init__()
        self.product = product
        self.at_capture = at_capture

    def build(self, batch: StepBatch, shape: BatchShape, /) -> ToyMetadata:
        meta = super().build(batch, shape)
        return meta if self.at_capture or not batch.num_reqs else self.product  # type: ignore[return-value]  # the misuse

    def build_for_capture(self, shape: BatchShape, /) -> ToyMetadata:
        meta = super().build_for_capture(shape)
        return self.product if self.at_capture else meta  # type: ignore[return-value]  # the misuse


_NOT_METADATA: Final = (None, ("meta", 1), [1], 3)


@pytest.mark.parametrize("product", _NOT_METADATA, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize(
    ("mode", "captured"), [(M.NONE, False), (M.FULL, False), (M.FULL, True), (M.PIECEWISE, True)]
)
def test_a_build_that_returns_no_metadata_is_named_on_every_path(
    product: object, mode: CUDAGraphMode, captured: bool
) -> None:
    """Issue 39: ``None`` or a tuple from ``build`` reached the model (``AttributeError``) on eager paths."""
    manager, _ = _manager(mode, _WrongProduct(product))
    if captured:
        manager.capture()
    with pytest.raises(
        ValueError, match=rf"^_WrongProduct\.build: returned .*\(a {type(product).__name__}\)"
    ):
        manager.run_batch(_batch(3, 3, 1))


@pytest.mark.parametrize("mode", [M.FULL, M.PIECEWISE])
def test_a_replays_build_of_another_type_than_the_recordings_is_named(mode: CUDAGraphMode) -> None:
    """A trial's case: ``build`` gave a tensor where the graph recorded ``build_for_capture``'s dataclass."""
    manager, _ = _manager(mode, _WrongProduct(torch.ones(1)))
    manager.capture()
    with pytest.raises(
        ValueError,
        match=r"^_WrongProduct\.build: returned .*\(a Tensor\), but this graph was recorded with a ToyMeta",
    ):
        manager.run_batch(_batch(3, 3, 1))
    assert manager.stats.replays == {}, manager.stats  # refused: not counted


@pytest.mark.parametrize("product", _NOT_METADATA, ids=lambda p: type(p).__name__)
def test_a_build_for_capture_that_returns_no_metadata_is_named(product: object) -> None:
    manager, _ = _manager(M.FULL, _WrongProduct(product, at_capture=True))
    with pytest.raises(ValueError, match=r"_WrongProduct\.build_for_capture: returned "):
        manager.capture()


def test_a_named_tuple_or_a_tensor_is_metadata() -> None:
    class Pair(NamedTuple):
        scale: torch.Tensor

    builder = ToyBuilder()
    for metadata in (Pair(torch.ones(1)), torch.ones(1)):
        with set_forward_context(M.NONE, BatchDescriptor(1), **metadata_extra(builder, metadata)):
            read: object = attention_metadata(builder)
            assert read is metadata


def test_an_override_of_the_builders_declaration_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 39: a builder's NEVER overridden by ``AttentionOptions(support=ALWAYS)`` said nothing."""
    never = AttentionSupport(GraphSupport.NEVER, piecewise=False, name="toy_never")
    with caplog.at_level(logging.INFO, logger="cudagraph_manager"):
        manager, _ = _manager(M.FULL, ToyBuilder(never), support=AttentionSupport(name="forced"))
    assert manager.dispatcher.resolution.mode is M.FULL
    said = [r.getMessage() for r in caplog.records if r.name == "cudagraph_manager"]
    assert said == [
        "attention: AttentionOptions.support ALWAYS (piecewise=True) overrides the declared NEVER "
        "(piecewise=False) of 'toy_never'"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cudagraph_manager"):  # the same level: nothing to say
        _manager(M.FULL, ToyBuilder(never), support=dataclasses.replace(never, name="same"))
    assert not [r for r in caplog.records if r.name == "cudagraph_manager"]


class _Declaring(SeamModel):
    def __init__(self, builder: ToyBuilder, support: AttentionSupport) -> None:
        super().__init__(builder)
        self.support = support

    def graph_support(self) -> AttentionSupport:
        return self.support


@pytest.mark.parametrize(
    ("models", "builders"),
    [
        (GraphSupport.NEVER, GraphSupport.ALWAYS),  # issue 39: the builder's ALWAYS won without a word
        (GraphSupport.ALWAYS, GraphSupport.UNIFORM_BATCH),
    ],
)
def test_a_model_and_a_builder_that_disagree_are_refused(
    models: GraphSupport, builders: GraphSupport
) -> None:
    builder = ToyBuilder(AttentionSupport(builders, name="builder"))
    model = _Declaring(builder, AttentionSupport(models, name="model"))

    def make(support: AttentionSupport | None) -> CUDAGraphManager[torch.Tensor]:
        attention = AttentionOptions(support=support, metadata_builder=builder)
        return CUDAGraphManager(
            model, INPUTS, config_for(M.FULL), device="cpu", options=ManagerOptions(attention=attention)
        )

    with pytest.raises(
        ValueError,
        match=rf"^options\.attention\.metadata_builder: its support {builders.name} .* disagrees with the "
        rf"model's graph_support\(\) {models.name} .* AttentionOptions\(support=\.\.\.\)$",
    ):
        make(None)
    said = AttentionSupport(GraphSupport.NEVER, piecewise=False, name="said")
    assert make(said).dispatcher.resolution.support is said  # the caller said which holds
    model.support = builder.support  # agreeing: no question
    assert make(None).dispatcher.resolution.support is builder.support
