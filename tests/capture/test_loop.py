"""DeviceLoop, the loop engine.

CPU: the fallback order and its reasons, with fakes (graphs that run their
work eagerly, a WHILE layer that runs the condition kernels' rule in Python),
the launches of the fallbacks, the argument checks, and the checks of the
cuda-bindings layer against fake bindings. GPU: the real loop against the
eager loop, bit for bit, for every kind; memory; streams; two loops.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from pathlib import Path
from typing import Final

import pytest
import torch

from cudagraph_capture import (
    CaptureDisabledError,
    CaptureError,
    CaptureOptions,
    DeviceLoop,
    LoopKind,
    LoopPolicy,
    set_capture_enabled,
)
from cudagraph_capture._conditional import (
    LoopFallback,
    LoopUnavailableError,
    compile_kernels,
    open_conditional,
)
from cudagraph_capture._loop import LoopSpec, build_loop, loop_fallback_counts
from cudagraph_dispatch import BatchDescriptor
from tests.capture.helpers import sleep_gpu
from tests.capture.loop_fakes import FakeConditional, FakeGraphs, FakeLoop
from tests.test_readmes import python_blocks

MAX_STEPS: Final = 12
KEY: Final = BatchDescriptor(4, 4, True)
ROOT: Final = Path(__file__).resolve().parents[2]
gpu: Final = pytest.mark.gpu


# ---------------------------------------------------------------------------
# A toy decode step
# ---------------------------------------------------------------------------


class Decoder:
    """x = tanh(x @ w) per step, a token per row per step, stop once a running sum passes a threshold.

    The body leaves everything as it is once ``stop`` is set (what an
    ``UNROLLED`` loop asks of it). The threshold is a device tensor, an input
    the caller refills like ``x``: one capture serves every stop step.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        stop_dtype: torch.dtype = torch.bool,
        batch: int = 4,
        dim: int = 16,
        max_steps: int = MAX_STEPS,
        seed: int = 0,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.device = device
        self.w = (torch.randn(dim, dim, generator=generator) * (1.5 / dim**0.5)).to(device)
        self.x0 = torch.randn(batch, dim, generator=generator).to(device)
        self.x = self.x0.clone()  # [batch, dim]
        self.total = torch.zeros((), device=device)
        self.threshold = torch.zeros((), device=device)
        self.tokens = torch.zeros(max_steps, batch, dtype=torch.int64, device=device)  # [step, batch]
        self.stop = torch.zeros((), dtype=stop_dtype, device=device)

    def body(self, steps: torch.Tensor) -> None:
        live = self.stop == 0  # [] bool
        new = torch.tanh(self.x @ self.w)
        self.x.copy_(torch.where(live, new, self.x))
        self.total.add_(torch.where(live, new.abs().sum(), 0.0))
        index = steps.view(1)
        row = torch.where(live, new.argmax(-1), self.tokens.index_select(0, index)[0])
        self.tokens.index_copy_(0, index, row.unsqueeze(0))
        self.stop.copy_((self.stop != 0) | (self.total > self.threshold))

    def refill(self, threshold: float, x0: torch.Tensor | None = None) -> None:
        self.x.copy_(self.x0 if x0 is None else x0)
        self.total.zero_()
        self.tokens.zero_()
        self.stop.zero_()
        self.threshold.fill_(threshold)

    def state(self) -> tuple[torch.Tensor, ...]:
        return (self.x.clone(), self.total.clone(), self.tokens.clone(), self.stop.clone())

    def threshold_for(self, stop_at: int | None) -> float:
        """The threshold that stops the loop right after iteration ``stop_at`` (1 first); ``None``: never."""
        if stop_at is None:
            return float("inf")
        self.refill(float("inf"))
        steps = torch.zeros((), dtype=torch.int64, device=self.device)
        totals = [0.0]
        for _ in range(stop_at):
            self.body(steps)
            steps += 1
            totals.append(float(self.total))
        return (totals[-2] + totals[-1]) / 2  # the running sum only grows


def eager_loop(decoder: Decoder, max_steps: int) -> int:
    """The loop on the host: the body, then a read-back of stop; the iterations run."""
    steps = torch.zeros((), dtype=torch.int64, device=decoder.device)
    for _ in range(max_steps):
        decoder.body(steps)
        steps += 1
        if bool(decoder.stop.item()):
            break
    return int(steps)


def expected(
    decoder: Decoder, threshold: float, max_steps: int, x0: torch.Tensor | None = None
) -> tuple[int, tuple[torch.Tensor, ...]]:
    """The eager loop's iterations and end state from a refill; leaves the decoder refilled again."""
    decoder.refill(threshold, x0)
    steps = eager_loop(decoder, max_steps)
    state = decoder.state()
    decoder.refill(threshold, x0)
    return steps, state


def assert_like(loop: DeviceLoop, decoder: Decoder, steps: int, state: tuple[torch.Tensor, ...]) -> None:
    assert int(loop.steps_taken) == steps
    for name, got, want in zip(("x", "total", "tokens", "stop"), decoder.state(), state, strict=True):
        assert torch.equal(got, want), name


def fake_loop(
    decoder: Decoder,
    *,
    graphs: FakeGraphs | None = None,
    conditional: FakeConditional | None = None,
    max_steps: int = MAX_STEPS,
    unroll: int = 4,
    kind: LoopKind | None = None,
    check_every: int = 4,
) -> DeviceLoop:
    policy = LoopPolicy(kind, unroll, check_every)
    spec = LoopSpec.checked(decoder.body, decoder.stop, max_steps, policy, KEY)
    return build_loop(spec, graphs or FakeGraphs(), conditional or FakeConditional())


CPU: Final = torch.device("cpu")


# ---------------------------------------------------------------------------
# CPU: every kind runs the eager loop's iterations
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("stop_at", [1, 5, MAX_STEPS, None], ids=["first", "mid", "at_limit", "never"])
@pytest.mark.parametrize(
    ("kind", "unroll"),
    [(None, 4), (LoopKind.UNROLLED, 4), (LoopKind.UNROLLED, 5), (LoopKind.HOST_LOOP, 4)],
    ids=["while", "unrolled_4", "unrolled_5", "host_loop"],
)
@pytest.mark.parametrize("stop_dtype", [torch.bool, torch.int32], ids=["bool", "int32"])
def test_every_kind_runs_the_eager_loop(
    kind: LoopKind | None, unroll: int, stop_at: int | None, stop_dtype: torch.dtype
) -> None:
    decoder = Decoder(CPU, stop_dtype=stop_dtype)
    loop = fake_loop(decoder, kind=kind, unroll=unroll)
    assert loop.kind is (kind or LoopKind.WHILE)
    threshold = decoder.threshold_for(stop_at)
    steps, state = expected(decoder, threshold, MAX_STEPS)
    assert steps == (stop_at or MAX_STEPS)
    loop.launch()
    assert_like(loop, decoder, steps, state)


@pytest.mark.parametrize("kind", [None, LoopKind.UNROLLED, LoopKind.HOST_LOOP])
@pytest.mark.parametrize("limit", [1, 3, 7])
def test_a_launch_may_run_fewer_steps_than_captured(kind: LoopKind | None, limit: int) -> None:
    decoder = Decoder(CPU)
    loop = fake_loop(decoder, kind=kind, unroll=4)
    steps, state = expected(decoder, float("inf"), limit)
    loop.launch(limit)
    assert_like(loop, decoder, steps, state)
    steps, state = expected(decoder, float("inf"), MAX_STEPS)  # and the full count again after it
    loop.launch()
    assert_like(loop, decoder, steps, state)


@pytest.mark.parametrize("check_every", [1, 2, 3, 4, 5, 12, 20])
@pytest.mark.parametrize("stop_at", [1, 2, 5, 8, 11, MAX_STEPS, None])
@pytest.mark.parametrize("limit", [1, 4, 7, MAX_STEPS])
def test_a_while_loop_checking_every_k_steps_runs_the_eager_loop(
    check_every: int, stop_at: int | None, limit: int
) -> None:
    """The steps after stop run masked and count nothing; the limit is never passed, whatever k."""
    decoder = Decoder(CPU)
    conditional = FakeConditional()
    loop = fake_loop(decoder, conditional=conditional, check_every=check_every)
    steps, state = expected(decoder, decoder.threshold_for(stop_at), limit)
    loop.launch(limit)
    assert_like(loop, decoder, steps, state)
    (built,) = conditional.built
    assert isinstance(built, FakeLoop)
    every = min(check_every, MAX_STEPS)
    assert built.plan.every == every
    assert built.iterations == _while_iterations(every, limit, stop_at)


def _while_iterations(every: int, limit: int, stop_at: int | None) -> int:
    """A check per ``every`` steps while they fit under the limit and none set stop, then one per step."""
    iterations = done = 0
    while done + every <= limit:
        iterations, done = iterations + 1, done + every
        if stop_at is not None and stop_at <= done:
            return iterations  # stopped in this iteration: its later steps ran masked
    taken = limit if stop_at is None else min(stop_at, limit)
    return iterations + taken - done


@pytest.mark.parametrize(
    ("kind", "unroll", "limit", "launches"),
    [
        (LoopKind.HOST_LOOP, 4, 5, 5),  # one graph per iteration
        (LoopKind.UNROLLED, 4, 8, 2),  # two of four
        (LoopKind.UNROLLED, 4, 10, 2 + 2),  # two of four, then two of one (no read-back after those)
        (LoopKind.UNROLLED, 4, 3, 3),  # fewer than unroll: three of one
        (LoopKind.UNROLLED, 20, MAX_STEPS, 1),  # unroll above max_steps: one graph of max_steps
    ],
)
def test_the_fallbacks_launch_their_graphs_up_to_the_limit(
    kind: LoopKind, unroll: int, limit: int, launches: int
) -> None:
    decoder = Decoder(CPU)
    graphs = FakeGraphs()
    loop = fake_loop(decoder, graphs=graphs, kind=kind, unroll=unroll)
    decoder.refill(float("inf"))
    loop.launch(limit)
    assert graphs.replays() == launches
    assert int(loop.steps_taken) == limit


def test_an_unrolled_launch_stops_at_the_first_read_back_after_stop() -> None:
    """Stop in the first of three launches of four: one launch runs, steps counts up to stop only."""
    decoder = Decoder(CPU)
    graphs = FakeGraphs()
    loop = fake_loop(decoder, graphs=graphs, kind=LoopKind.UNROLLED, unroll=4)
    threshold = decoder.threshold_for(2)
    steps, state = expected(decoder, threshold, MAX_STEPS)
    loop.launch()
    assert_like(loop, decoder, steps, state)
    assert steps == 2


# ---------------------------------------------------------------------------
# CPU: the fallback order and its reasons
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("reason", list(LoopFallback))
@pytest.mark.parametrize(("unroll", "kind"), [(4, LoopKind.UNROLLED), (1, LoopKind.HOST_LOOP)])
def test_without_while_a_loop_falls_back_and_says_why(
    reason: LoopFallback, unroll: int, kind: LoopKind, caplog: pytest.LogCaptureFixture
) -> None:
    before = loop_fallback_counts().get(reason, 0)
    first = before == 0
    conditional = FakeConditional(reason)
    with caplog.at_level(logging.WARNING, logger="cudagraph_capture"):
        loops = [fake_loop(Decoder(CPU), conditional=conditional, unroll=unroll) for _ in range(2)]
    for loop in loops:
        assert loop.kind is kind
        assert loop.fallback is reason
        assert loop.fallback_reason == f"{reason.value}: the fake says no"
    assert loop_fallback_counts()[reason] == before + 2
    logged = [r for r in caplog.records if r.name == "cudagraph_capture" and reason.value in r.getMessage()]
    assert len(logged) == (1 if first else 0)  # once per reason and process
    assert all(r.levelno == logging.WARNING for r in logged)


def test_a_driver_that_refuses_the_loop_frees_the_body_graph_and_falls_back() -> None:
    graphs = FakeGraphs()
    loop = fake_loop(Decoder(CPU), graphs=graphs, conditional=FakeConditional(refuse_build=True))
    assert loop.kind is LoopKind.UNROLLED
    assert loop.fallback is LoopFallback.DRIVER_REFUSED
    assert loop.fallback_reason is not None
    assert "refused the body" in loop.fallback_reason
    # The WHILE body (recorded, not instantiated) is gone; the fallback's two graphs live.
    assert [instantiate for _, instantiate in graphs.recorded] == [False, True, True]
    assert graphs.recorded[0][0]() is None
    assert graphs.live() == 2


def test_while_records_the_body_alone_uninstantiated_after_one_warm_up() -> None:
    graphs = FakeGraphs()
    conditional = FakeConditional()
    loop = fake_loop(Decoder(CPU), graphs=graphs, conditional=conditional)
    assert (loop.kind, loop.fallback, loop.fallback_reason) == (LoopKind.WHILE, None, None)
    assert (conditional.loads, graphs.warm_ups) == (1, 1)
    assert [instantiate for _, instantiate in graphs.recorded] == [False]
    assert graphs.live() == 1  # kept by the loop: the loop graph's nodes use its memory


@pytest.mark.parametrize("kind", [LoopKind.UNROLLED, LoopKind.HOST_LOOP])
def test_a_forced_fallback_never_asks_for_while_and_has_no_reason(kind: LoopKind) -> None:
    conditional = FakeConditional()
    before = loop_fallback_counts()
    loop = fake_loop(Decoder(CPU), conditional=conditional, kind=kind)
    assert (loop.kind, loop.fallback, loop.fallback_reason, conditional.loads) == (kind, None, None, 0)
    assert loop_fallback_counts() == before


def test_a_forced_while_that_cannot_be_built_raises_naming_the_descriptor() -> None:
    graphs = FakeGraphs()
    before = loop_fallback_counts()
    with pytest.raises(CaptureError, match="WHILE was asked for") as caught:
        fake_loop(
            Decoder(CPU), graphs=graphs, conditional=FakeConditional(refuse_build=True), kind=LoopKind.WHILE
        )
    assert caught.value.descriptor == KEY
    assert graphs.live() == 0
    assert loop_fallback_counts() == before


@pytest.mark.parametrize("kind", [None, LoopKind.UNROLLED])
def test_a_failed_capture_raises_naming_the_descriptor_and_keeps_nothing(kind: LoopKind | None) -> None:
    graphs = FakeGraphs(fail=RuntimeError("operation not permitted when stream is capturing"))
    with pytest.raises(CaptureError, match="DeviceLoop: capture failed with RuntimeError") as caught:
        fake_loop(Decoder(CPU), graphs=graphs, kind=kind)
    assert caught.value.descriptor == KEY
    assert graphs.live() == 0
    assert not graphs.in_session


def test_a_body_that_fails_in_its_warm_up_raises_a_capture_error() -> None:
    def body(steps: torch.Tensor) -> None:
        raise ValueError("a bad body")

    spec = LoopSpec.checked(body, torch.zeros((), dtype=torch.bool), 4, LoopPolicy(unroll=2), KEY)
    with pytest.raises(CaptureError, match="a bad body"):
        build_loop(spec, FakeGraphs(), FakeConditional())


# ---------------------------------------------------------------------------
# CPU: arguments
# ---------------------------------------------------------------------------


def _capture_kwargs(**changes: object) -> dict[str, object]:
    decoder = Decoder(CPU)
    kwargs: dict[str, object] = {"body": decoder.body, "stop": decoder.stop, "max_steps": 4}
    return {**kwargs, **changes}


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"body": None}, "body"),
        ({"stop": torch.zeros(2, dtype=torch.bool)}, "stop"),
        ({"stop": torch.zeros(())}, "stop"),
        ({"stop": True}, "stop"),
        ({"stop": torch.zeros((), dtype=torch.bool)}, "stop: expected a CUDA tensor"),
        ({"max_steps": 0}, "max_steps"),
        ({"max_steps": True}, "max_steps"),
        ({"max_steps": 4.0}, "max_steps"),
        ({"policy": "while"}, "policy"),
        ({"policy": LoopKind.WHILE}, "policy"),
        ({"descriptor": 8}, "descriptor"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(changes: dict[str, object], named: str) -> None:
    kwargs = _capture_kwargs(**changes)
    with pytest.raises(ValueError, match=named):
        DeviceLoop.capture(**kwargs)  # type: ignore[arg-type]  # checked at run time, as untyped callers call it


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"unroll": 0}, "unroll"),
        ({"unroll": True}, "unroll"),
        ({"unroll": 2.0}, "unroll"),
        ({"kind": "while"}, "kind"),
        ({"check_every": 0}, "check_every"),
        ({"check_every": True}, "check_every"),
        ({"check_every": 65}, "check_every"),
    ],
)
def test_a_bad_loop_policy_raises_value_error_naming_the_field(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        LoopPolicy(**fields)  # type: ignore[arg-type]  # checked at run time, as untyped callers call it


def test_the_spec_keeps_a_view_of_the_callers_flag() -> None:
    stop = torch.zeros(1, dtype=torch.int32)
    spec = LoopSpec.checked(lambda steps: None, stop, 4, LoopPolicy(unroll=2), None)
    assert spec.stop.shape == ()
    assert spec.stop.data_ptr() == stop.data_ptr()


@pytest.mark.parametrize("limit", [0, MAX_STEPS + 1, True, 2.0])
def test_launch_refuses_a_limit_outside_the_capture(limit: object) -> None:
    loop = fake_loop(Decoder(CPU))
    with pytest.raises(ValueError, match="max_steps"):
        loop.launch(limit)  # type: ignore[arg-type]  # checked at run time


# ---------------------------------------------------------------------------
# CPU: the cuda-bindings layer's checks, against fake bindings
# ---------------------------------------------------------------------------


def _fake_nvrtc(*, compiles: bool) -> types.SimpleNamespace:
    sources: list[bytes] = []

    def create(
        source: bytes, name: bytes, count: int, headers: list[bytes], names: list[bytes]
    ) -> tuple[int, str]:
        sources.append(source)
        return 0, "program"

    return types.SimpleNamespace(
        sources=sources,
        nvrtcCreateProgram=create,
        nvrtcCompileProgram=lambda program, count, options: (0 if compiles else 6,),
        nvrtcGetProgramLogSize=lambda program: (0, 8),
        nvrtcGetProgramLog=lambda program, buffer: (0,),
        nvrtcGetCUBINSize=lambda program: (0, 4),
        nvrtcGetCUBIN=lambda program, cubin: (0,),
        nvrtcDestroyProgram=lambda program: (0,),
    )


def _importer(
    *, driver_version: int = 13030, conditional: bool = True, compiles: bool = True
) -> tuple[Callable[[str], object], types.SimpleNamespace]:
    driver = types.SimpleNamespace(cuDriverGetVersion=lambda: (0, driver_version), cuGraphAddNode=object())
    if conditional:
        driver.cuGraphConditionalHandleCreate = object()
    nvrtc = _fake_nvrtc(compiles=compiles)
    modules = {
        "cuda.bindings": types.SimpleNamespace(__version__="13.3.1"),
        "cuda.bindings.driver": driver,
        "cuda.bindings.nvrtc": nvrtc,
    }
    return modules.__getitem__, nvrtc


def test_missing_bindings_are_the_first_reason() -> None:
    def missing(name: str) -> object:
        raise ModuleNotFoundError(f"No module named {name!r}", name="cuda")

    with pytest.raises(LoopUnavailableError) as caught:
        open_conditional(0, (9, 0), missing)
    assert caught.value.reason is LoopFallback.NO_BINDINGS
    assert "cannot import cuda" in str(caught.value)


def test_bindings_without_conditional_nodes_count_as_missing() -> None:
    importer, _ = _importer(conditional=False)
    with pytest.raises(LoopUnavailableError) as caught:
        open_conditional(0, (9, 0), importer)
    assert caught.value.reason is LoopFallback.NO_BINDINGS


def test_an_old_driver_is_refused_before_anything_compiles() -> None:
    importer, nvrtc = _importer(driver_version=12020)
    with pytest.raises(LoopUnavailableError) as caught:
        open_conditional(0, (9, 0), importer)
    assert caught.value.reason is LoopFallback.OLD_DRIVER
    assert "12020" in caught.value.detail
    assert nvrtc.sources == []


def test_nvrtc_failing_tries_both_preludes_then_gives_the_reason() -> None:
    importer, nvrtc = _importer(compiles=False)
    with pytest.raises(LoopUnavailableError) as caught:
        open_conditional(0, (9, 0), importer)
    assert caught.value.reason is LoopFallback.NVRTC_FAILED
    assert len(nvrtc.sources) == 2
    assert b"typedef" not in nvrtc.sources[0]
    assert b"typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle" in nvrtc.sources[1]


def test_the_condition_kernels_compile_for_the_devices_architecture() -> None:
    nvrtc = _fake_nvrtc(compiles=True)
    options: list[list[bytes]] = []
    compiled = nvrtc.nvrtcCompileProgram

    def compile_program(program: object, count: int, opts: list[bytes]) -> tuple[int]:
        options.append(opts)
        result: tuple[int] = compiled(program, count, opts)
        return result

    nvrtc.nvrtcCompileProgram = compile_program
    assert compile_kernels(nvrtc, (9, 0)) == b"    "
    assert options == [[b"--gpu-architecture=sm_90"]]
    (source,) = nvrtc.sources
    needed = (
        b"loop_begin",
        b"loop_count",
        b"loop_check",
        b"loop_tail",
        b"loop_choose",
        b"loop_restore",
        b"choose_replay",
        b"cudaGraphSetConditional",
        b"c[RUNNING] && c[STEPS] + every <= c[LIMIT]",
    )
    for name in needed:
        assert name in source


# ---------------------------------------------------------------------------
# GPU: the real loop
# ---------------------------------------------------------------------------


def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def captured(
    decoder: Decoder,
    *,
    kind: LoopKind | None = None,
    unroll: int = 8,
    options: CaptureOptions | None = None,
    check_every: int = 4,
) -> DeviceLoop:
    loop = DeviceLoop.capture(
        decoder.body,
        stop=decoder.stop,
        max_steps=MAX_STEPS,
        policy=LoopPolicy(kind, unroll, check_every),
        options=options,
        descriptor=KEY,
    )
    if kind is None:
        assert loop.kind is LoopKind.WHILE, loop.fallback_reason
    return loop


@gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("stop_at", [1, 5, MAX_STEPS, None], ids=["first", "mid", "at_limit", "never"])
@pytest.mark.parametrize(
    "kind", [None, LoopKind.UNROLLED, LoopKind.HOST_LOOP], ids=["while", "unrolled", "host"]
)
@pytest.mark.parametrize("stop_dtype", [torch.bool, torch.int32], ids=["bool", "int32"])
@pytest.mark.parametrize("check_every", [1, 4, 5], ids=["every1", "every4", "every5"])
def test_gpu_loop_is_bit_identical_to_the_eager_loop(
    kind: LoopKind | None, stop_at: int | None, stop_dtype: torch.dtype, check_every: int
) -> None:
    if kind is not None and check_every != 4:
        pytest.skip("check_every is the WHILE loop's")
    decoder = Decoder(cuda(), stop_dtype=stop_dtype, batch=8, dim=256)
    loop = captured(decoder, kind=kind, unroll=5, check_every=check_every)
    threshold = decoder.threshold_for(stop_at)
    steps, state = expected(decoder, threshold, MAX_STEPS)
    assert steps == (stop_at or MAX_STEPS)
    loop.launch()
    torch.cuda.synchronize()
    assert_like(loop, decoder, steps, state)


@gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize(
    "kind", [None, LoopKind.UNROLLED, LoopKind.HOST_LOOP], ids=["while", "unrolled", "host"]
)
def test_gpu_loop_replays_many_times_with_refilled_inputs(kind: LoopKind | None) -> None:
    decoder = Decoder(cuda(), batch=8, dim=256)
    loop = captured(decoder, kind=kind, unroll=4, check_every=3)
    generator = torch.Generator().manual_seed(7)
    for round_ in range(20):
        x0 = torch.randn(decoder.x0.shape, generator=generator).to(decoder.device)
        limit = 1 + round_ % MAX_STEPS
        decoder.x0.copy_(x0)
        threshold = decoder.threshold_for(1 + (3 * round_) % MAX_STEPS) if round_ % 3 else float("inf")
        steps, state = expected(decoder, threshold, limit, x0)
        loop.launch(limit)
        torch.cuda.synchronize()
        assert_like(loop, decoder, steps, state)


@gpu
@pytest.mark.usefixtures("clean_capture_state")
def test_gpu_loop_launches_on_the_callers_stream_after_its_work() -> None:
    """A long kernel, the refill and the launch queued on a side stream: the loop must wait for both."""
    decoder = Decoder(cuda(), batch=8, dim=256)
    loop = captured(decoder)
    threshold = decoder.threshold_for(6)
    steps, state = expected(decoder, threshold, MAX_STEPS)
    decoder.refill(float("inf"))  # a wrong fill, corrected on the side stream below
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sleep_gpu()
        decoder.refill(threshold)
        loop.launch()
    torch.cuda.synchronize()
    assert_like(loop, decoder, steps, state)


def _pool_bytes(pool: tuple[int, int]) -> int:
    segments = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    return sum(int(s["total_size"]) for s in segments if tuple(s.get("segment_pool_id", ())) == tuple(pool))


@gpu
@pytest.mark.usefixtures("clean_capture_state")
def test_gpu_loop_body_allocates_from_the_pool_and_launches_allocate_nothing() -> None:
    decoder = Decoder(cuda(), batch=256, dim=1024)  # a body temporary: 1 MiB
    pool = torch.cuda.graph_pool_handle()
    options = CaptureOptions(pool=pool, warmup_runs=0)
    decoder.refill(float("inf"))
    decoder.body(torch.zeros((), dtype=torch.int64, device=decoder.device))  # the warm-up, by hand
    torch.cuda.synchronize()
    assert _pool_bytes(pool) == 0
    loop = captured(decoder, options=options)
    assert _pool_bytes(pool) >= 256 * 1024 * 4  # the body's temporaries came from the pool
    loop.launch()
    torch.cuda.synchronize()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    for _ in range(10):
        decoder.refill(float("inf"))
        loop.launch()
    torch.cuda.synchronize()
    assert (torch.cuda.memory_reserved(), torch.cuda.memory_allocated()) == (reserved, allocated)


@gpu
@pytest.mark.usefixtures("clean_capture_state")
def test_gpu_two_loops_on_one_device_stay_apart() -> None:
    decoders = (Decoder(cuda(), batch=8, dim=256, seed=1), Decoder(cuda(), batch=8, dim=128, seed=2))
    loops = (captured(decoders[0]), captured(decoders[1]))
    for stop_at in ((3, None), (None, 9), (MAX_STEPS, 1)):
        wanted = [
            expected(decoder, decoder.threshold_for(at), MAX_STEPS)
            for decoder, at in zip(decoders, stop_at, strict=True)
        ]  # each decoder is left refilled for its loop
        for loop in loops:
            loop.launch()
        torch.cuda.synchronize()
        for loop, decoder, (steps, state) in zip(loops, decoders, wanted, strict=True):
            assert_like(loop, decoder, steps, state)


@gpu
@pytest.mark.usefixtures("clean_capture_state")
def test_gpu_capture_errors_name_the_descriptor_and_the_next_capture_works() -> None:
    decoder = Decoder(cuda(), batch=8, dim=64)

    def failing(steps: torch.Tensor) -> None:
        decoder.body(steps)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a bad body")

    with pytest.raises(CaptureError, match="a bad body") as caught:
        DeviceLoop.capture(failing, stop=decoder.stop, max_steps=4, descriptor=KEY)
    assert caught.value.descriptor == KEY
    set_capture_enabled(False)
    with pytest.raises(CaptureDisabledError, match=r"capture is disabled") as disabled:
        DeviceLoop.capture(decoder.body, stop=decoder.stop, max_steps=4, descriptor=KEY)
    assert disabled.value.descriptor == KEY
    set_capture_enabled(True)
    loop = captured(decoder)
    steps, state = expected(decoder, decoder.threshold_for(2), MAX_STEPS)
    loop.launch()
    torch.cuda.synchronize()
    assert_like(loop, decoder, steps, state)


@gpu
def test_gpu_the_readmes_loop_example_runs() -> None:
    (block,) = [b for b in python_blocks(ROOT / "packages/capture/README.md") if "DeviceLoop" in b]
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(block, "packages/capture/README.md", "exec"), namespace)
    loop = namespace["loop"]
    assert isinstance(loop, DeviceLoop)
    assert loop.kind is LoopKind.WHILE, loop.fallback_reason
