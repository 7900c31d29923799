"""``run_loop`` on a shrinking loop: the batch's requests finish, the loop moves to smaller keys.

CPU: the manager's bookkeeping with the loop engine's device layer faked
(``tests.capture.loop_fakes``: the kernels' rules in Python), so the whole
road runs without a GPU: the loops captured on shared cells and combined per
class, the rows the manager names (static inputs, the builder's, the decode
loop's), the tokens in the caller's order, the steps per key in ``stats``,
and every reason not to shrink. A toy whose requests end after a countdown
(``CountdownDecoder``) gives exact schedules; the paged decoder with each of
the four backends on the CPU gives the host loop's tokens.
GPU: the real loops, against the host loop, on random stop schedules.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Final

import pytest
import torch
from torch import nn

import cudagraph_manager._graphs._loops as loops_module
from cudagraph_capture import CaptureOptions, DeviceLoop, LoopKind, LoopPolicy
from cudagraph_capture._conditional import LoopFallback
from cudagraph_capture._loop import LoopBody, LoopSpec, build_loop, shrink_loops
from cudagraph_capture.lowlevel import LoopRows
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode
from cudagraph_dispatch.support import AttentionSupport, GraphSupport
from cudagraph_manager import CUDAGraphManager, DecodeLoop, LoopState, ManagerOptions, StaticInput
from cudagraph_manager._graphs._capturer import Capturer
from cudagraph_manager._values._loop import LoopResult
from cudagraph_manager._values._reports import CapturedGraph
from cudagraph_manager.attention import AttentionOptions, BatchShape, StepBatch
from examples.paged import PagedDecoder as PagedDecoderT
from examples.paged import paged_static_inputs
from examples.paged.loop import PagedAdvance, greedy
from tests.capture.loop_fakes import FakeConditional, FakeGraphs
from tests.manager.helpers import FakeEngines, config_for
from tests.manager.test_decode_loop import (
    CPU_CASES,
    CPU_MAX_STEPS,
    _cpu_case,
    eos_from_eager_steps,
    finish_steps,
    run_loop_and_reference,
    runner_up,
)

M: Final = CUDAGraphMode
VOCAB: Final = 97
MAX_STEPS: Final = 12
SIZES: Final = (1, 2, 4, 8)
FINISHED: Final = -1
INPUTS: Final[Mapping[str, StaticInput]] = {
    "ids": StaticInput((), torch.int64, "tokens", pad_value=1),
    "scale": StaticInput((), torch.int64, "reqs", pad_value=1),
    "left": StaticInput((), torch.int64, "reqs", pad_value=1),
}


class CountdownDecoder(nn.Module):
    """``logits[t, v]`` peaks at ``(ids[t] * scale[t] + 7) % VOCAB``; ``left`` is the advance's."""

    def forward(self, ids: torch.Tensor, scale: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
        target = (ids * scale[: ids.shape[0]] + 7) % VOCAB  # [T]
        return torch.nn.functional.one_hot(target, VOCAB).float()  # [T, VOCAB]


def advance(logits: torch.Tensor, inputs: Mapping[str, torch.Tensor], state: LoopState) -> None:
    """The next ids; a request ends when its countdown ``left`` reaches 0; -1 once it ended."""
    live = state.active
    nxt = logits.argmax(-1)  # [R]
    state.tokens.index_copy_(0, state.step.view(1), torch.where(live, nxt, FINISHED)[None])
    inputs["ids"].copy_(torch.where(live, nxt, inputs["ids"]))
    left = inputs["left"]
    left.sub_(live.long())
    live.logical_and_(left > 0)
    torch.logical_not(live.any(), out=state.stop)


def python_loop(ids: list[int], scale: list[int], left: list[int], steps: int) -> list[list[int]]:
    rows: list[list[int]] = []
    active = [True] * len(ids)
    for _ in range(steps):
        nxt = [(i * s + 7) % VOCAB for i, s in zip(ids, scale, strict=True)]
        rows.append([n if a else FINISHED for n, a in zip(nxt, active, strict=True)])
        ids = [n if a else i for n, i, a in zip(nxt, ids, active, strict=True)]
        left = [v - a for v, a in zip(left, active, strict=True)]
        active = [a and v > 0 for a, v in zip(active, left, strict=True)]
        if not any(active):
            break
    return rows


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """Eager FlexAttention warns that it is unfused (the CPU path); downgrades warn once (GPU)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*downgrad.*", category=UserWarning)
        yield


# ---------------------------------------------------------------------------
# The device layer faked: DeviceLoop's capture and shrinking on fake graphs
# ---------------------------------------------------------------------------


class FakeDeviceLoops:
    """Stands for ``DeviceLoop`` in the manager's loop capture: the real loops on fake graphs."""

    def __init__(self, conditional: FakeConditional) -> None:
        self.conditional = conditional
        self.shrunk = 0

    def capture(
        self,
        body: LoopBody,
        *,
        stop: torch.Tensor,
        max_steps: int,
        policy: LoopPolicy,
        options: CaptureOptions,
        descriptor: BatchDescriptor,
        shared_with: DeviceLoop | None,
    ) -> DeviceLoop:
        spec = LoopSpec.checked(body, stop, max_steps, policy, descriptor)
        cells = None if shared_with is None else shared_with._cells
        return build_loop(spec, FakeGraphs(), self.conditional, cells)

    def shrinking(self, loops: Sequence[DeviceLoop], *, rows: LoopRows) -> DeviceLoop:
        self.shrunk += 1
        return shrink_loops(loops, rows, self.conditional)


def _capture_loops_anywhere(self: Capturer[torch.Tensor]) -> tuple[list[CapturedGraph], str | None]:
    """``Capturer._capture_loops`` without its CUDA gate (the fakes run on the CPU)."""
    loops = self._loops
    return ([], None) if loops is None else loops.capture_missing(self._options)


@pytest.fixture
def fake_loops(monkeypatch: pytest.MonkeyPatch) -> FakeDeviceLoops:
    fakes = FakeDeviceLoops(FakeConditional())
    monkeypatch.setattr(loops_module, "DeviceLoop", fakes)
    monkeypatch.setattr(Capturer, "_capture_loops", _capture_loops_anywhere)
    return fakes


def countdown_manager(
    *,
    sizes: Sequence[int] = SIZES,
    check_every: int = 4,
    request_rows: Sequence[torch.Tensor] = (),
    builder: object = None,
    mode: CUDAGraphMode = M.FULL_AND_PIECEWISE,
    shrink: bool = True,
) -> CUDAGraphManager[torch.Tensor]:
    loop = DecodeLoop(advance, MAX_STEPS, LoopPolicy(check_every=check_every), request_rows, shrink)
    attention = AttentionOptions(metadata_builder=builder)  # type: ignore[arg-type]  # a test's builder
    return CUDAGraphManager(
        CountdownDecoder(),
        INPUTS,
        config_for(mode, sizes=tuple(sizes), max_num_seqs=max(sizes)),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines(), decode_loop=loop, attention=attention),
    )


def run(
    manager: CUDAGraphManager[torch.Tensor], case: tuple[list[int], list[int], list[int]], steps: int | None
) -> LoopResult:
    ids, scale, left = case
    return manager.run_loop(
        max_steps=steps,
        ids=torch.tensor(ids),
        scale=torch.tensor(scale),
        left=torch.tensor(left),
    )


def _case(n: int, seed: int, longest: int = MAX_STEPS + 3) -> tuple[list[int], list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
    scale = torch.randint(2, VOCAB, (n,), generator=g).tolist()
    left = torch.randint(1, longest, (n,), generator=g).tolist()
    return ids, scale, left


# ---------------------------------------------------------------------------
# CPU: the manager's shrinking road, the device layer faked
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("check_every", [1, 4])
@pytest.mark.parametrize("n", [1, 3, 5, 8])
@pytest.mark.parametrize("steps", [None, 1, 5])
def test_run_loop_shrinks_and_gives_the_python_loops_tokens(
    fake_loops: FakeDeviceLoops, n: int, steps: int | None, check_every: int
) -> None:
    manager = countdown_manager(check_every=check_every)
    report = manager.capture()
    assert report.shrink_fallback is None
    assert fake_loops.shrunk == 1  # one class: the uniform keys
    for seed in range(4):
        case = _case(n, seed)
        before = manager.stats.device_loop_steps
        result = run(manager, case, steps)
        expected = python_loop(*case, steps or MAX_STEPS)
        assert result.kind is LoopKind.WHILE
        assert result.steps == len(expected)
        assert result.tokens.tolist() == expected
        after = manager.stats.device_loop_steps
        ran = {size: after.get(size, 0) - before.get(size, 0) for size in SIZES}
        assert sum(ran.values()) == result.steps
        assert max(s for s, k in ran.items() if k) == min(s for s in SIZES if s >= n)  # the batch's key first


def test_the_steps_run_on_the_smallest_key_holding_the_live_requests(fake_loops: FakeDeviceLoops) -> None:
    """Eight requests ending after 1..8 steps, checked every step: keys 8, 8, 8, 8, 4, 4, 2, 1."""
    manager = countdown_manager(check_every=1)
    manager.capture()
    case = ([5, 6, 7, 8, 9, 10, 11, 12], [3] * 8, [5, 1, 8, 3, 6, 2, 7, 4])
    result = run(manager, case, None)
    assert result.tokens.tolist() == python_loop(*case, MAX_STEPS)
    stats = manager.stats
    assert dict(stats.device_loop_steps) == {8: 4, 4: 2, 2: 1, 1: 1}
    assert stats.loop_steps == 8
    assert stats.padded_tokens == 0  # eight requests on the key of eight: the smaller keys pad nothing
    assert "on the device by key size: 1: 1, 2: 1, 4: 2, 8: 4" in str(stats)
    run(manager, ([5, 6, 7], [3] * 3, [2, 2, 2]), None)  # three requests on the key of four, twice
    assert manager.stats.padded_tokens == 2


def test_the_last_requests_finish_in_the_callers_order_whatever_rows_they_took(
    fake_loops: FakeDeviceLoops,
) -> None:
    """The first request runs longest: every partition moves it; its tokens stay in column 0.

    Then the longest in every other column in turn, and random finishes: each
    request's tokens stay in its column, wherever the partitions moved it.
    """
    manager = countdown_manager(check_every=1)
    manager.capture()
    case = ([11, 22, 33, 44, 55, 66, 77], [5, 6, 7, 8, 9, 10, 11], [12, 1, 1, 2, 3, 3, 1])
    result = run(manager, case, None)
    expected = python_loop(*case, MAX_STEPS)
    assert result.tokens.tolist() == expected
    assert finish_steps(result.tokens) == [12, 1, 1, 2, 3, 3, 1]
    for longest in range(1, 7):
        left = [1 + (3 * i) % 5 for i in range(7)]
        left[longest] = MAX_STEPS
        case = (case[0], case[1], left)
        result = run(manager, case, None)
        assert result.tokens.tolist() == python_loop(*case, MAX_STEPS), longest
        assert finish_steps(result.tokens) == left, longest
    for seed in range(6):
        case = _case(7, seed, longest=MAX_STEPS + 1)
        result = run(manager, case, None)
        assert result.tokens.tolist() == python_loop(*case, MAX_STEPS), seed
        assert finish_steps(result.tokens) == case[2], seed


def test_a_class_of_one_key_does_not_shrink_and_says_why(
    fake_loops: FakeDeviceLoops, caplog: pytest.LogCaptureFixture
) -> None:
    manager = countdown_manager(sizes=(4,))
    with caplog.at_level(logging.INFO, logger="cudagraph_manager"):
        report = manager.capture()
    assert report.shrink_fallback is not None
    assert report.shrink_fallback.startswith("one_graph: ")
    assert "decode loops do not shrink: one_graph" in str(report)
    assert "decode loops do not shrink (one_graph)" in caplog.text
    case = _case(3, seed=1)
    result = run(manager, case, None)
    assert result.tokens.tolist() == python_loop(*case, MAX_STEPS)
    assert set(manager.stats.device_loop_steps) == {4}


class _Meta:
    """Metadata the model does not read."""


class _NoRowsBuilder:
    """A builder whose metadata is nothing the model reads, without ``request_rows``."""

    support = AttentionSupport(GraphSupport.ALWAYS)

    def build(self, batch: StepBatch, shape: BatchShape, /) -> _Meta:
        return _Meta()

    def build_for_capture(self, shape: BatchShape, /) -> _Meta:
        return _Meta()


class _RowsBuilder(_NoRowsBuilder):
    def __init__(self, rows: Sequence[torch.Tensor] | None) -> None:
        self.rows = rows

    def request_rows(self) -> Sequence[torch.Tensor] | None:
        return self.rows


@pytest.mark.parametrize(
    ("options", "detail"),
    [
        ({"builder": _NoRowsBuilder()}, "_NoRowsBuilder does not say which of its buffers"),
        ({"builder": _RowsBuilder(None)}, "_RowsBuilder does not say which of its buffers"),
    ],
)
def test_rows_that_cannot_move_keep_each_loop_on_its_key(
    fake_loops: FakeDeviceLoops, options: dict[str, object], detail: str
) -> None:
    manager = countdown_manager(**options)  # type: ignore[arg-type]  # the cases above
    report = manager.capture()
    assert report.shrink_fallback == f"no_row_order: {detail}" or (
        report.shrink_fallback is not None
        and report.shrink_fallback.startswith("no_row_order:")
        and detail in report.shrink_fallback
    )
    assert fake_loops.shrunk == 0
    case = _case(5, seed=2)
    assert run(manager, case, None).tokens.tolist() == python_loop(*case, MAX_STEPS)
    assert set(manager.stats.device_loop_steps) == {8}


def test_a_loop_not_asked_to_shrink_keeps_each_key_and_says_nothing(fake_loops: FakeDeviceLoops) -> None:
    """``DecodeLoop(shrink=False)``, the default: every key keeps its own loop, run on the batch's key."""
    manager = countdown_manager(shrink=False)
    report = manager.capture()
    assert report.shrink_fallback is None  # nothing to explain: it was not asked for
    assert fake_loops.shrunk == 0
    case = _case(5, seed=2)
    assert run(manager, case, None).tokens.tolist() == python_loop(*case, MAX_STEPS)
    assert set(manager.stats.device_loop_steps) == {8}
    for n in (1, 2, 3, 8):  # every batch on its own key's loop, whatever its requests leave
        before = dict(manager.stats.device_loop_steps)
        case = _case(n, seed=n)
        result = run(manager, case, None)
        assert result.tokens.tolist() == python_loop(*case, MAX_STEPS)
        after = manager.stats.device_loop_steps
        ran = {size for size in SIZES if after.get(size, 0) > before.get(size, 0)}
        assert ran == {min(s for s in SIZES if s >= n)}, (n, ran)


def test_a_builders_and_a_decode_loops_rows_move_with_the_requests(fake_loops: FakeDeviceLoops) -> None:
    """A per-request tensor of the builder and one of the advance's, each moved with the requests."""
    of_builder = torch.arange(8, dtype=torch.int64) * 10
    of_loop = torch.arange(8, dtype=torch.float32)[:, None].repeat(1, 3)

    def tracking(logits: torch.Tensor, inputs: Mapping[str, torch.Tensor], state: LoopState) -> None:
        rows = state.active.shape[0]
        live = state.active.clone()
        advance(logits, inputs, state)
        # Where each request's own row went: the request's tensors moved with it.
        assert torch.equal((of_builder[:rows] // 10)[live], (of_loop[:rows, 1].long())[live])

    manager = CUDAGraphManager(
        CountdownDecoder(),
        INPUTS,
        config_for(M.FULL_AND_PIECEWISE, sizes=SIZES, max_num_seqs=8),
        device="cpu",
        options=ManagerOptions(
            engine_factory=FakeEngines(),
            decode_loop=DecodeLoop(tracking, MAX_STEPS, LoopPolicy(check_every=1), (of_loop,), shrink=True),
            attention=AttentionOptions(metadata_builder=_RowsBuilder((of_builder,))),
        ),
    )
    assert manager.capture().shrink_fallback is None
    case = ([5, 6, 7, 8, 9, 10, 11, 12], [3] * 8, [5, 1, 8, 3, 6, 2, 7, 4])
    assert run(manager, case, None).tokens.tolist() == python_loop(*case, MAX_STEPS)
    assert sorted((of_builder // 10).tolist()) == list(range(8))  # a permutation of the rows
    assert torch.equal(of_builder // 10, of_loop[:, 0].long())  # moved together


def test_a_builders_bad_rows_are_named_at_capture(fake_loops: FakeDeviceLoops) -> None:
    manager = countdown_manager(builder=_RowsBuilder((torch.zeros(2),)))
    with pytest.raises(ValueError, match=r"_RowsBuilder\.request_rows\(\)\[0\]: expected at least 8 rows"):
        manager.capture()


def test_a_decode_loops_bad_rows_are_named_at_construction() -> None:
    with pytest.raises(
        ValueError, match=r"^options\.decode_loop\.request_rows\[0\]: expected a tensor on cpu"
    ):
        countdown_manager(request_rows=(torch.zeros(2),))
    with pytest.raises(ValueError, match=r"^request_rows: expected a sequence of tensors"):
        DecodeLoop(advance, 4, request_rows=[1, 2])  # type: ignore[list-item]  # the check under test


@pytest.mark.parametrize(
    ("conditional", "kind"),
    [
        (FakeConditional(LoopFallback.NO_BINDINGS), LoopKind.UNROLLED),
        (FakeConditional(refuse_build=True), LoopKind.UNROLLED),
    ],
    ids=["no_bindings", "driver_refused"],
)
def test_loops_that_are_not_while_keep_their_keys_and_say_why(
    fake_loops: FakeDeviceLoops,
    conditional: FakeConditional,
    kind: LoopKind,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake_loops.conditional = conditional
    manager = countdown_manager()
    with caplog.at_level(logging.WARNING, logger="cudagraph_manager"):
        report = manager.capture()
    assert report.shrink_fallback is not None
    assert report.shrink_fallback.startswith("no_device_choice: the loops run as UNROLLED here")
    assert "decode loops do not shrink (no_device_choice)" in caplog.text
    case = _case(6, seed=3)
    result = run(manager, case, None)
    assert result.kind is kind
    assert result.tokens.tolist() == python_loop(*case, MAX_STEPS)


class _NoChoice(FakeConditional):
    """WHILE loops of one body, but neither a SWITCH node nor IF nodes."""

    def build(self, plan: object) -> object:  # type: ignore[override]  # the fake's loop or a refusal
        from cudagraph_capture._conditional import LoopPlan, LoopUnavailableError

        assert isinstance(plan, LoopPlan)
        if plan.rows is not None:
            raise LoopUnavailableError(LoopFallback.DRIVER_REFUSED, "no conditional node may choose here")
        return super().build(plan)


def test_a_choice_the_driver_refuses_keeps_each_loop_on_its_key(fake_loops: FakeDeviceLoops) -> None:
    fake_loops.conditional = _NoChoice()
    manager = countdown_manager()
    report = manager.capture()
    assert report.shrink_fallback is not None
    assert report.shrink_fallback.startswith("no_device_choice: DeviceLoop.shrinking: neither a SWITCH node")
    case = _case(6, seed=4)
    result = run(manager, case, None)
    assert result.kind is LoopKind.WHILE
    assert result.tokens.tolist() == python_loop(*case, MAX_STEPS)
    assert set(manager.stats.device_loop_steps) == {8}


def test_a_recapture_shrinks_again_and_a_release_drops_the_loop(fake_loops: FakeDeviceLoops) -> None:
    manager = countdown_manager()
    manager.capture()
    manager.release()
    case = _case(5, seed=5)
    assert run(manager, case, None).kind is None  # released: the host loop
    assert manager.capture().shrink_fallback is None
    assert fake_loops.shrunk == 2
    result = run(manager, case, None)
    assert result.kind is LoopKind.WHILE
    assert result.tokens.tolist() == python_loop(*case, MAX_STEPS)


def test_mode_full_shrinks_over_its_exact_keys(fake_loops: FakeDeviceLoops) -> None:
    manager = countdown_manager(mode=M.FULL)
    assert manager.capture().shrink_fallback is None
    case = _case(7, seed=6)
    assert run(manager, case, None).tokens.tolist() == python_loop(*case, MAX_STEPS)


@pytest.mark.parametrize(("backend", "page_size"), CPU_CASES)
def test_the_paged_decoder_shrinks_with_every_backend(
    fake_loops: FakeDeviceLoops, backend: str, page_size: int
) -> None:
    """The host loop's tokens (``manager.run`` per step, every request kept) on a shrinking loop."""
    model, batch, max_len = _cpu_case(backend, page_size)
    eos_id = eos_from_eager_steps(model, batch, max_len=max_len, max_steps=CPU_MAX_STEPS)
    sample: Callable[[torch.Tensor], torch.Tensor] = runner_up
    advance_ = PagedAdvance(model, eos_id, max_len, sample=sample)
    dispatch = config_for(M.FULL_DECODE_ONLY, sizes=(1, 2, 4, 8), max_num_seqs=model.config.max_num_seqs)
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(model.layout),
        dispatch,
        device="cpu",
        options=ManagerOptions(
            engine_factory=FakeEngines(),
            decode_loop=DecodeLoop(
                advance_, max_steps=CPU_MAX_STEPS, policy=LoopPolicy(check_every=2), shrink=True
            ),
            attention=AttentionOptions(metadata_builder=model.backend),
        ),
    )
    assert manager.capture().shrink_fallback is None
    result, expected = run_loop_and_reference(manager, advance_, batch, max_steps=CPU_MAX_STEPS)
    assert result.kind is LoopKind.WHILE
    assert result.steps == expected.shape[0]
    assert torch.equal(result.tokens, expected)
    assert len(set(finish_steps(expected))) >= 3
    assert len(manager.stats.device_loop_steps) >= 2  # it moved to a smaller key


# ---------------------------------------------------------------------------
# GPU: the real loops against the host loop
# ---------------------------------------------------------------------------

GPU_SIZES: Final = (1, 2, 4, 8, 16, 32)
GPU_MAX_LEN: Final = 96
GPU_MAX_STEPS: Final = 24


def _gpu_countdown(check_every: int) -> CUDAGraphManager[torch.Tensor]:
    loop = DecodeLoop(advance, MAX_STEPS, LoopPolicy(check_every=check_every), shrink=True)
    return CUDAGraphManager(
        CountdownDecoder(),
        INPUTS,
        config_for(M.FULL_AND_PIECEWISE, sizes=SIZES, max_num_seqs=8),
        device="cuda",
        options=ManagerOptions(decode_loop=loop),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("check_every", [1, 4])
def test_gpu_run_loop_shrinks_and_gives_the_python_loops_tokens(check_every: int) -> None:
    manager = _gpu_countdown(check_every)
    report = manager.capture()
    assert report.shrink_fallback is None, report.shrink_fallback
    for n in (1, 3, 5, 8):
        for seed in range(3):
            ids, scale, left = _case(n, seed)
            before = dict(manager.stats.device_loop_steps)
            result = manager.run_loop(
                ids=torch.tensor(ids, device="cuda"),
                scale=torch.tensor(scale, device="cuda"),
                left=torch.tensor(left, device="cuda"),
            )
            assert result.kind is LoopKind.WHILE
            assert result.tokens.tolist() == python_loop(ids, scale, left, MAX_STEPS), (n, seed)
            after = manager.stats.device_loop_steps
            assert sum(after.values()) - sum(before.values()) == result.steps


@pytest.mark.gpu
def test_gpu_the_smallest_key_holding_the_live_requests_runs() -> None:
    manager = _gpu_countdown(1)
    manager.capture()
    ids, scale, left = [5, 6, 7, 8, 9, 10, 11, 12], [3] * 8, [5, 1, 8, 3, 6, 2, 7, 4]
    result = manager.run_loop(
        ids=torch.tensor(ids, device="cuda"),
        scale=torch.tensor(scale, device="cuda"),
        left=torch.tensor(left, device="cuda"),
    )
    assert result.tokens.tolist() == python_loop(ids, scale, left, MAX_STEPS)
    assert dict(manager.stats.device_loop_steps) == {8: 4, 4: 2, 2: 1, 1: 1}


def _gpu_paged(backend: str, page_size: int, dtype: torch.dtype, seed: int) -> PagedDecoderT:
    from examples import DecoderConfig
    from examples.paged import PagedDecoder, PagedLayout

    torch.manual_seed(seed)
    config = DecoderConfig(num_layers=2, max_num_seqs=max(GPU_SIZES), max_seq_len=256, dtype=dtype)
    layout = PagedLayout.for_config(config, page_size=page_size)
    return PagedDecoder(config, layout=layout, backend=backend, device="cuda")


def _stop_schedule_batch(model: PagedDecoderT, num_reqs: int, seed: int) -> dict[str, torch.Tensor]:
    """Prompts whose lengths stop each request at a random step of the loop (or never, past it)."""
    from examples.paged.loop import decode_batch

    generator = torch.Generator().manual_seed(seed)
    stops = torch.randint(1, GPU_MAX_STEPS + 6, (num_reqs,), generator=generator)  # some past the limit
    lens = (GPU_MAX_LEN - stops).clamp(min=1).tolist()
    return decode_batch(model, lens, max_len=GPU_MAX_LEN, generator=generator, device="cuda")


#: (backend, page size): flex with pages of 64 (its kernel's key block), the others of 16.
GPU_BACKENDS: Final = (("flex", 64), ("gather", 16), ("varlen", 16), ("split_decode", 16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("backend", "page_size"), GPU_BACKENDS, ids=[b for b, _ in GPU_BACKENDS])
def test_gpu_the_paged_decoder_shrinks_on_random_stop_schedules(
    backend: str, page_size: int, dtype: torch.dtype
) -> None:
    """The host loop's tokens (``manager.run`` per step, every request kept), below 64 rows: exact."""
    if backend == "varlen" and dtype == torch.float32:
        pytest.skip("FlashAttention (varlen_attn) computes in float16 or bfloat16")
    seed = GPU_BACKENDS.index((backend, page_size))
    model = _gpu_paged(backend, page_size, dtype, seed)
    sample = runner_up if dtype == torch.float32 else greedy
    advance_ = PagedAdvance(model, None, GPU_MAX_LEN, sample=sample)
    dispatch = config_for(M.FULL_DECODE_ONLY, sizes=GPU_SIZES, max_num_seqs=max(GPU_SIZES))
    manager = CUDAGraphManager(
        model,
        paged_static_inputs(model.layout),
        dispatch,
        options=ManagerOptions(
            decode_loop=DecodeLoop(advance_, max_steps=GPU_MAX_STEPS, shrink=True),
            attention=AttentionOptions(metadata_builder=model.backend),
        ),
    )
    with torch.no_grad():
        report = manager.capture(progress=False)
    assert report.shrink_fallback is None, report.shrink_fallback
    for num_reqs in (3, 13, 32):
        batch = _stop_schedule_batch(model, num_reqs, seed=100 * seed + num_reqs)
        before = sum(manager.stats.device_loop_steps.values())
        result, expected = run_loop_and_reference(manager, advance_, batch, max_steps=GPU_MAX_STEPS)
        assert result.kind is LoopKind.WHILE
        assert result.steps == expected.shape[0]
        assert torch.equal(result.tokens.cpu(), expected), (num_reqs, result.tokens, expected)
        assert sum(manager.stats.device_loop_steps.values()) - before == result.steps
    assert len(manager.stats.device_loop_steps) >= 3  # it moved to smaller keys
