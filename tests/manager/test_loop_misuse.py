"""Misuse of ``run_loop`` and its decode loop (issue 39): each refused by name, before a buffer is touched.

``run_loop``'s arguments of any wrong type (a tensor, a list or a string
for its batch, a wrong ``max_steps``, ``run``'s own keywords) raise
``ValueError`` starting with ``run_loop:`` and naming the argument; no static
buffer, loop buffer or count changes. Its steps are counted in ``stats``
(``loop_steps``, ``host_loop_steps``, and the replays or eager steps of a
host loop), and ``strict`` refuses a loop on the host as ``run`` refuses an
eager step. A loop kind that is forced where no loop can be captured is
refused when the manager is built (CPU), or makes ``capture()`` raise (GPU).
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Final, cast

import pytest
import torch

from cudagraph_capture import CaptureError, LoopKind, LoopPolicy
from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import (
    CUDAGraphManager,
    DecodeLoop,
    LoopState,
    ManagerOptions,
    NoGraphError,
    StaticInput,
)
from tests.manager.helpers import Backend, FakeEngines, assert_unchanged, config_for, snapshot
from tests.manager.test_run_loop import INPUTS, MAX_STEPS, ToyDecoder, advance, python_loop

M: Final = CUDAGraphMode
CPU: Final = torch.device("cpu")


def loop_manager(
    *,
    engines: FakeEngines | None = None,
    strict: bool = False,
    model: Callable[..., torch.Tensor] | None = None,
    loop: DecodeLoop[torch.Tensor] | None = None,
    device: torch.device = CPU,
) -> CUDAGraphManager[torch.Tensor]:
    """A manager of ``ToyDecoder`` with a decode loop: uniform keys of 1, 2, 4, 8 requests."""
    return CUDAGraphManager(
        ToyDecoder() if model is None else model,
        INPUTS,
        config_for(M.FULL_AND_PIECEWISE, sizes=(1, 2, 4, 8), max_num_seqs=8),
        device=device,
        strict=strict,
        options=ManagerOptions(
            engine_factory=engines,
            decode_loop=DecodeLoop(advance, max_steps=MAX_STEPS) if loop is None else loop,
        ),
    )


def batch_of(ids: list[int], scale: list[int], device: torch.device = CPU) -> dict[str, torch.Tensor]:
    return {
        "ids": torch.tensor(ids, dtype=torch.int64, device=device),
        "scale": torch.tensor(scale, dtype=torch.int64, device=device),
    }


#: 3 requests (padded to the key of 4) that stop after different steps: 12 steps at most.
IDS: Final = [5, 13, 45]
SCALE: Final = [2, 3, 1]
EXPECTED: Final = python_loop(IDS, SCALE, MAX_STEPS)

#: A bad call of ``run_loop`` (given a valid batch of 3 requests), and a pattern its error matches.
BadLoop = Callable[[CUDAGraphManager[torch.Tensor], dict[str, torch.Tensor]], object]


def _loop(*args: object, **kwargs: object) -> BadLoop:
    """``manager.run_loop(*args, **kwargs)`` with arguments of any type (what an untyped caller passes)."""
    return lambda manager, _: cast(Callable[..., object], manager.run_loop)(*args, **kwargs)


def _with(**extra: object) -> BadLoop:
    """``manager.run_loop(**batch, **extra)``: the valid batch, and ``extra`` over it."""
    return lambda manager, batch: cast(Callable[..., object], manager.run_loop)(**{**batch, **extra})


BAD_LOOPS: Final = [
    pytest.param(
        _loop(torch.tensor([1, 2, 3])),
        r"^run_loop: batch: expected a mapping of input names to tensors \(or the inputs as keywords\), "
        r"got a torch\.int64 tensor of shape \(3,\)",
        id="batch-tensor",
    ),
    pytest.param(
        lambda manager, batch: manager.run_loop(cast(Mapping[str, torch.Tensor], list(batch.values()))),
        r"^run_loop: batch: expected a mapping .*, got list \[tensor",
        id="batch-list",
    ),
    pytest.param(_loop("abc"), r"^run_loop: batch: expected a mapping .*, got str 'abc'", id="batch-string"),
    pytest.param(_loop(3), r"^run_loop: batch: expected a mapping .*, got int 3", id="batch-int"),
    pytest.param(
        lambda manager, batch: manager.run_loop(batch, ids=batch["ids"]),
        r"^run_loop: batch: pass the inputs as keywords or in one mapping, not both",
        id="batch-and-keywords",
    ),
    pytest.param(
        lambda manager, batch: manager.run_loop(cast(Mapping[str, torch.Tensor], {0: batch["ids"], 1: None})),
        r"^run_loop: batch: expected input names \(strings\) as keys, got 0",
        id="batch-int-keys",
    ),
    pytest.param(
        _with(max_steps="4"), r"^run_loop: max_steps: expected an integer >= 1, got '4'", id="max-string"
    ),
    pytest.param(
        _with(max_steps=True), r"^run_loop: max_steps: expected an integer >= 1, got True", id="max-bool"
    ),
    pytest.param(_with(max_steps=2.0), r"^run_loop: max_steps: .* got 2\.0", id="max-float"),
    pytest.param(_with(max_steps=0), r"^run_loop: max_steps: expected an integer >= 1, got 0", id="max-zero"),
    pytest.param(
        _with(max_steps=13), r"^run_loop: max_steps: expected an integer <= 12, got 13", id="max-above"
    ),
    pytest.param(
        _with(uniform_decode=True),
        r"^run_loop: uniform_decode: not an argument of run_loop \(a decode loop's batch is always uniform",
        id="uniform_decode-keyword",
    ),
    pytest.param(
        _with(num_active_loras=1),
        r"^run_loop: num_active_loras: not an argument of run_loop",
        id="num_active_loras-keyword",
    ),
    pytest.param(
        _with(invalid_modes=frozenset()),
        r"^run_loop: invalid_modes: not an argument",
        id="invalid_modes-keyword",
    ),
    pytest.param(
        _with(ids=[5, 13, 45]), r"^run_loop: input 'ids': expected a torch\.Tensor, got list", id="input-list"
    ),
    pytest.param(
        _with(scale=torch.tensor([2.0, 3.0, 1.0])),
        r"^run_loop: input 'scale': expected dtype torch\.int64, got torch\.float32",
        id="input-dtype",
    ),
    pytest.param(
        lambda manager, batch: manager.run_loop(ids=batch["ids"]),
        r"^run_loop: missing input\(s\) \['scale'\]",
        id="input-missing",
    ),
    pytest.param(
        _with(idz=torch.tensor([1])), r"^run_loop: unknown input\(s\) \['idz'\]", id="input-unknown"
    ),
    pytest.param(
        _with(ids=torch.tensor([5, 13, 45, 7, 9, 11])),
        r"^run_loop: a decode loop's batch has one token per request; got 6 tokens \(input 'ids'\) "
        r"for 3 requests \(input 'scale'\)",
        id="more-tokens-than-requests",
    ),
    pytest.param(
        _with(scale=torch.tensor([1, 2, 3, 4])),
        r"^run_loop: input 'scale': 4 requests for 3 tokens",
        id="more-requests-than-tokens",
    ),
]


@pytest.mark.parametrize("fake_engines", [False, True], ids=["eager", "fake-graphs"])
@pytest.mark.parametrize(("call", "pattern"), BAD_LOOPS)
def test_a_bad_run_loop_is_named_before_a_buffer_is_touched(
    fake_engines: bool, call: BadLoop, pattern: str
) -> None:
    manager = loop_manager(engines=FakeEngines() if fake_engines else None)
    manager.capture()
    assert manager.run_loop(batch_of(IDS, SCALE)).tokens.tolist() == EXPECTED  # real data everywhere
    before = snapshot(manager.static_buffers)
    loop = manager._parts.loop  # the loop's own buffers: tokens, active, stop
    assert loop is not None
    kept = snapshot({"tokens": loop.tokens, "active": loop.active, "stop": loop.stop, "step": loop.step})
    stats = manager.stats
    with pytest.raises(ValueError, match=pattern):
        call(manager, batch_of([7, 8, 9], [3, 3, 3]))
    assert_unchanged(before, manager.static_buffers)
    assert_unchanged(
        kept, {"tokens": loop.tokens, "active": loop.active, "stop": loop.stop, "step": loop.step}
    )
    assert manager.stats == stats
    assert manager.run_loop(batch_of(IDS, SCALE)).tokens.tolist() == EXPECTED  # still usable


def test_a_loop_above_the_largest_size_names_run_loop() -> None:
    manager = CUDAGraphManager(
        ToyDecoder(),
        INPUTS,
        config_for(M.FULL_AND_PIECEWISE, sizes=(1, 2, 4, 8), max_num_seqs=16),
        device="cpu",
        options=ManagerOptions(decode_loop=DecodeLoop(advance, max_steps=4)),
    )
    with pytest.raises(
        ValueError,
        match=re.escape(
            "run_loop: 10 requests (input 'ids'): a decode loop runs on the static buffers, of at most 8 "
            "tokens (the largest capture size)"
        ),
    ):
        manager.run_loop(batch_of(list(range(1, 11)), [1] * 10), max_steps=4)
    assert manager.stats.loop_steps == 0


def test_run_loop_while_another_thread_runs_names_run_loop() -> None:
    entered, release = threading.Event(), threading.Event()

    def blocking(ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        entered.set()
        release.wait(10)
        return ToyDecoder().forward(ids, scale)

    manager = loop_manager(model=blocking)
    worker = threading.Thread(target=lambda: manager.run_batch(batch_of(IDS, SCALE), uniform_decode=True))
    worker.start()
    try:
        assert entered.wait(10)
        with pytest.raises(RuntimeError, match=r"^CUDAGraphManager\.run_loop: another thread is inside"):
            manager.run_loop(batch_of(IDS, SCALE))
    finally:
        release.set()
        worker.join(10)


# ---------------------------------------------------------------------------
# stats and strict
# ---------------------------------------------------------------------------


def test_a_host_loop_without_graphs_counts_its_eager_steps() -> None:
    manager = loop_manager()  # the CPU: no graphs, every step eager on the padded buffers
    result = manager.run_loop(batch_of(IDS, SCALE))
    steps = len(EXPECTED)
    assert result.steps == steps
    stats = manager.stats
    assert (stats.loop_steps, stats.host_loop_steps) == (steps, steps)
    assert stats.eager_steps == steps
    assert dict(stats.eager_reasons) == {"no_cuda": steps}
    assert stats.padded_tokens == steps  # 3 requests padded to the key of 4
    assert stats.num_replays == 0
    assert f"{steps} loop steps ({steps} on the host)" in str(stats)
    manager.reset_stats()
    assert (manager.stats.loop_steps, manager.stats.host_loop_steps, manager.stats.eager_steps) == (0, 0, 0)


def test_a_host_loop_over_replays_counts_them() -> None:
    manager = loop_manager(engines=FakeEngines())  # one-step graphs, no loops (a loop is a CUDA graph)
    manager.capture()
    steps = manager.run_loop(batch_of(IDS, SCALE)).steps
    stats = manager.stats
    assert (stats.loop_steps, stats.host_loop_steps) == (steps, steps)
    assert dict(stats.replays) == {(M.FULL, 4): steps}
    assert stats.eager_steps == 0
    assert stats.padded_tokens == steps


def test_a_loop_of_no_request_is_an_idle_step() -> None:
    manager = loop_manager()
    assert manager.run_loop(batch_of([], [])).steps == 0
    assert (manager.stats.idle_steps, manager.stats.loop_steps) == (1, 0)


def test_a_host_loop_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    manager = loop_manager(engines=FakeEngines())
    manager.capture()
    with caplog.at_level("INFO", logger="cudagraph_manager"):
        manager.run_loop(batch_of(IDS, SCALE))
        manager.run_loop(batch_of(IDS, SCALE))
    lines = [r.getMessage() for r in caplog.records if "run_loop" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "loops on the host" in lines[0]


@pytest.mark.parametrize("captured", [False, True])
def test_strict_refuses_a_loop_on_the_host_before_a_buffer_is_touched(captured: bool) -> None:
    manager = loop_manager(engines=FakeEngines(), strict=True)
    if captured:
        manager.capture()  # one-step graphs only: no loop to run on the device
    before = snapshot(manager.static_buffers)
    with pytest.raises(NoGraphError, match=r"run_loop would loop on the host") as info:
        manager.run_loop(batch_of(IDS, SCALE))
    assert info.value.num_tokens == 3
    why = "on a CUDA device only" if captured else "was not captured yet; capture() captures it and its loop"
    assert why in str(info.value)
    assert_unchanged(before, manager.static_buffers)
    assert manager.stats.loop_steps == manager.stats.eager_steps == 0
    assert manager.run_loop(batch_of([], [])).steps == 0  # an idle loop is no fallback


# ---------------------------------------------------------------------------
# The decode loop's settings
# ---------------------------------------------------------------------------


def test_a_loop_takes_advance_once_per_step_with_three_arguments() -> None:
    seen: list[tuple[int, int]] = []

    class Advance:
        def __call__(
            self, logits: torch.Tensor, inputs: Mapping[str, torch.Tensor], state: LoopState
        ) -> None:
            seen.append((logits.shape[0], state.active.shape[0]))
            advance(logits, inputs, state)

    manager = loop_manager(loop=DecodeLoop(Advance(), max_steps=MAX_STEPS))
    assert manager.run_loop(batch_of(IDS, SCALE)).tokens.tolist() == EXPECTED
    assert seen == [(4, 4)] * len(EXPECTED)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("kind", "strict"), [(LoopKind.WHILE, False), (LoopKind.UNROLLED, False), (None, True)]
)
def test_gpu_a_loop_that_must_be_captured_makes_capture_raise(kind: LoopKind | None, strict: bool) -> None:
    """A forced kind, or strict, is never left to loop on the host: the failed loop's capture raises."""

    def refusing(logits: torch.Tensor, inputs: Mapping[str, torch.Tensor], state: LoopState) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("this advance cannot be captured")
        advance(logits, inputs, state)

    device = Backend.of("cuda").device
    manager = loop_manager(
        loop=DecodeLoop(refusing, max_steps=MAX_STEPS, policy=LoopPolicy(kind)), strict=strict, device=device
    )
    # The advance's refusal, or (a forced WHILE where cuda-bindings or the driver cannot build one) that.
    with pytest.raises(CaptureError, match=r"this advance cannot be captured|WHILE was asked for"):
        manager.capture()
    assert manager.num_captured > 0  # the one-step graphs before the loop stay captured


@pytest.mark.gpu
def test_gpu_a_captured_loop_counts_its_steps_on_the_device() -> None:
    device = Backend.of("cuda").device
    manager = loop_manager(device=device, strict=True)
    manager.capture()
    result = manager.run_loop(batch_of(IDS, SCALE, device))
    assert result.kind is not None
    assert result.tokens.tolist() == EXPECTED
    stats = manager.stats
    assert (stats.loop_steps, stats.host_loop_steps) == (result.steps, 0)
    assert stats.num_replays == stats.eager_steps == 0
    assert sum(stats.device_loop_steps.values()) == result.steps
    # 3 requests pad to the key of 4 (one row a step); a smaller key, once some finished, pads none.
    assert stats.padded_tokens == stats.device_loop_steps[4]


def test_a_loop_input_that_requires_grad_is_warned_about_at_the_callers_line() -> None:
    """``run_loop``'s warning names its caller's line, as ``run``'s does (it named the manager's module)."""

    def stop(out: torch.Tensor, inputs: Mapping[str, torch.Tensor], state: LoopState) -> None:
        state.stop.fill_(True)

    inputs = {"x": StaticInput(), "n": StaticInput(dtype=torch.int64, rows="reqs")}
    manager: CUDAGraphManager[torch.Tensor] = CUDAGraphManager(
        lambda x, n: x * 2,
        inputs,
        config_for(M.FULL_AND_PIECEWISE, sizes=(1, 2, 4), max_num_seqs=4),
        device="cpu",
        options=ManagerOptions(decode_loop=DecodeLoop(stop, max_steps=2)),
    )
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        manager.run_loop(x=torch.ones(2, requires_grad=True), n=torch.zeros(2, dtype=torch.int64))
    assert [(w.category, w.filename) for w in warned] == [(UserWarning, __file__)]
