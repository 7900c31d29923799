"""``run_loop``: many decode steps per call, on the device where the loop was captured, else on the host.

A toy decoder whose next token is a function of its current token and its
request's scale (``ToyDecoder``); its advance writes the next token (-1 for a
finished request, as the loop's contract asks), clears a request at its end
token, and sets stop when none is active. Every path
(eager on the CPU, one-step graphs replayed by the fake engines, the device
loop on a GPU in each ``LoopKind``) must give the tokens of a plain Python
loop over the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import pytest
import torch
from torch import nn

from cudagraph_capture import LoopKind, LoopPolicy
from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import CUDAGraphManager, DecodeLoop, LoopState, ManagerOptions, StaticInput
from cudagraph_manager._values._loop import LoopResult
from tests.manager.helpers import BACKENDS, Backend, config_for

M: Final = CUDAGraphMode
VOCAB: Final = 97
EOS: Final = 0
#: A finished request's token at the steps after its last.
FINISHED: Final = -1
MAX_STEPS: Final = 12
INPUTS: Final[Mapping[str, StaticInput]] = {
    "ids": StaticInput((), torch.int64, "tokens", pad_value=1),
    "scale": StaticInput((), torch.int64, "reqs", pad_value=1),
}


class ToyDecoder(nn.Module):
    """``logits[t, v]`` peaks at ``(ids[t] * scale[t] + 7) % VOCAB``: a deterministic next token."""

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        target = (ids * scale[: ids.shape[0]] + 7) % VOCAB  # [T]
        return torch.nn.functional.one_hot(target, VOCAB).float()  # [T, VOCAB]


def advance(logits: torch.Tensor, inputs: Mapping[str, torch.Tensor], state: LoopState) -> None:
    """Greedy: the next ids; a request is done after its end token; a finished request's tokens are -1."""
    live = state.active  # [R]
    nxt = logits.argmax(-1)  # [R]
    state.tokens.index_copy_(0, state.step.view(1), torch.where(live, nxt, FINISHED)[None])
    inputs["ids"].copy_(torch.where(live, nxt, inputs["ids"]))  # a finished request keeps its input
    live.logical_and_(nxt != EOS)
    torch.logical_not(live.any(), out=state.stop)


def python_loop(ids: list[int], scale: list[int], steps: int) -> list[list[int]]:
    rows, active = [], [True] * len(ids)
    for _ in range(steps):
        nxt = [(i * s + 7) % VOCAB for i, s in zip(ids, scale, strict=True)]
        rows.append([n if a else FINISHED for n, a in zip(nxt, active, strict=True)])
        ids = [n if a else i for n, i, a in zip(nxt, ids, active, strict=True)]
        active = [a and n != EOS for a, n in zip(active, nxt, strict=True)]
        if not any(active):
            break
    return rows


def _manager(backend: Backend, kind: LoopKind | None = None) -> CUDAGraphManager[torch.Tensor]:
    loop = DecodeLoop(advance, max_steps=MAX_STEPS, policy=LoopPolicy(kind, unroll=4))
    return CUDAGraphManager(
        ToyDecoder(),
        INPUTS,
        config_for(M.FULL_AND_PIECEWISE, sizes=(1, 2, 4, 8), max_num_seqs=8),
        device=backend.device,
        options=ManagerOptions(engine_factory=backend.factory, decode_loop=loop),
    )


def _run(
    manager: CUDAGraphManager[torch.Tensor], ids: list[int], scale: list[int], steps: int | None
) -> LoopResult:
    device = manager.device
    return manager.run_loop(
        max_steps=steps,
        ids=torch.tensor(ids, dtype=torch.int64, device=device),
        scale=torch.tensor(scale, dtype=torch.int64, device=device),
    )


#: (ids, scales, max_steps): stops at different steps; one stops at step 1 (7 * 1 + ... = EOS);
#: one never stops (hits the limit); 3 requests pad to 4.
CASES: Final = (
    ([5, 13, 45], [2, 3, 1], MAX_STEPS),
    ([90], [1], MAX_STEPS),  # (90 + 7) % 97 = 0: done at step 1
    ([1, 2, 3, 4, 5], [1, 1, 1, 1, 1], 7),  # +7 each step, never 0 within 7 steps: the limit
    ([11, 22], [5, 6], None),
)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize(("ids", "scale", "steps"), CASES)
def test_run_loop_equals_the_python_loop(
    backend_name: str, ids: list[int], scale: list[int], steps: int | None
) -> None:
    backend = Backend.of(backend_name)
    manager = _manager(backend)
    manager.capture()
    result = _run(manager, ids, scale, steps)
    expected = python_loop(ids, scale, steps or MAX_STEPS)
    assert result.steps == len(expected)
    assert result.tokens.tolist() == expected
    if backend.name == "cuda":
        assert result.kind is not None  # the captured loop ran
    else:
        assert result.kind is None  # no CUDA loop on the CPU: the host loop over the fake graph


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(LoopKind))
def test_each_loop_kind_gives_the_same_tokens(kind: LoopKind) -> None:
    manager = _manager(Backend.of("cuda"), kind)
    report = manager.capture()
    assert sum(g.loop for g in report.graphs) == len(manager.dispatcher.keys(M.FULL))
    for ids, scale, steps in CASES:
        result = _run(manager, ids, scale, steps)
        assert result.kind is kind
        assert result.tokens.tolist() == python_loop(ids, scale, steps or MAX_STEPS)


@pytest.mark.gpu
def test_a_loop_is_released_and_recaptured() -> None:
    manager = _manager(Backend.of("cuda"))
    manager.capture()
    manager.release()
    ids, scale, steps = CASES[0]
    result = _run(manager, ids, scale, steps)
    assert result.kind is None  # released: the host loop, eagerly
    assert result.tokens.tolist() == python_loop(ids, scale, steps)
    manager.capture()
    result = _run(manager, ids, scale, steps)
    assert result.kind is not None
    assert result.tokens.tolist() == python_loop(ids, scale, steps)


def test_run_loop_needs_a_decode_loop_and_checks_its_arguments() -> None:
    plain = CUDAGraphManager(ToyDecoder(), INPUTS, config_for(M.FULL), device="cpu")
    with pytest.raises(RuntimeError, match=r"built without ManagerOptions\(decode_loop=\.\.\.\)"):
        _run(plain, [1], [1], None)
    manager = _manager(Backend.of("cpu"))
    with pytest.raises(ValueError, match=r"^run_loop: max_steps: expected an integer <= 12"):
        _run(manager, [1], [1], 13)
    with pytest.raises(ValueError, match=r"^run_loop: a decode loop's batch has one token per request"):
        manager.run_loop(ids=torch.tensor([1, 2]), scale=torch.tensor([1]))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"advance": "advance", "max_steps": 4}, "advance"),
        ({"advance": advance, "max_steps": 0}, "max_steps"),
        ({"advance": advance, "max_steps": True}, "max_steps"),
        ({"advance": advance, "max_steps": 4, "policy": "while"}, "policy"),
        ({"advance": advance, "max_steps": 4, "policy": None}, "policy"),
    ],
)
def test_a_bad_decode_loop_is_named(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named}: "):
        DecodeLoop(**kwargs)  # type: ignore[arg-type]  # the checks under test


def test_a_decode_loop_needs_one_token_per_request() -> None:
    with pytest.raises(ValueError, match=r"^options\.decode_loop: a decode loop takes one token per request"):
        CUDAGraphManager(
            ToyDecoder(),
            INPUTS,
            config_for(M.FULL, query_len=2),
            device="cpu",
            options=ManagerOptions(decode_loop=DecodeLoop(advance, max_steps=4)),
        )
    with pytest.raises(
        ValueError, match=r"^options\.decode_loop: expected a DecodeLoop or None, got <function"
    ):
        ManagerOptions(decode_loop=advance)  # type: ignore[arg-type]  # the check under test


@pytest.mark.gpu
def test_the_estimate_counts_the_loops_it_will_capture() -> None:
    manager = _manager(Backend.of("cuda"))
    estimate = manager.estimate_memory()
    report = manager.capture()
    loops = [g for g in report.graphs if g.loop]
    assert len(loops) == len(manager.dispatcher.keys(M.FULL))
    assert estimate.num_graphs == report.num_graphs
    assert any(p.loop for p in estimate.probes)
    assert abs(estimate.total_bytes - report.device_bytes) <= max(0.015 * report.device_bytes, 32 * 2**20)


def test_a_loop_above_the_largest_size_is_refused_before_a_buffer_is_touched() -> None:
    manager = CUDAGraphManager(
        ToyDecoder(),
        INPUTS,
        config_for(M.FULL_AND_PIECEWISE, sizes=(1, 2, 4, 8), max_num_seqs=16),
        device="cpu",
        options=ManagerOptions(decode_loop=DecodeLoop(advance, max_steps=4)),
    )
    before = {name: t.clone() for name, t in manager.static_buffers.items()}
    with pytest.raises(
        ValueError, match=r"^run_loop: 10 requests \(input 'ids'\): a decode loop runs on the static"
    ):
        _run(manager, list(range(1, 11)), [1] * 10, 4)  # 10 requests: above the largest size, 8
    for name, kept in before.items():
        assert torch.equal(manager.static_buffers[name], kept), name


def test_a_loop_of_no_request_runs_nothing() -> None:
    calls: list[int] = []

    def counting(logits: torch.Tensor, inputs: Mapping[str, torch.Tensor], state: LoopState) -> None:
        calls.append(1)
        advance(logits, inputs, state)

    manager = CUDAGraphManager(
        ToyDecoder(),
        INPUTS,
        config_for(M.FULL_AND_PIECEWISE, sizes=(1, 2, 4, 8), max_num_seqs=8),
        device="cpu",
        options=ManagerOptions(decode_loop=DecodeLoop(counting, max_steps=4)),
    )
    result = _run(manager, [], [], None)
    assert result.steps == 0
    assert tuple(result.tokens.shape) == (0, 0)
    assert not calls


@pytest.mark.gpu
def test_a_loop_that_fails_to_capture_leaves_its_key_on_the_host_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def refusing(logits: torch.Tensor, inputs: Mapping[str, torch.Tensor], state: LoopState) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("this advance cannot be captured")
        advance(logits, inputs, state)

    manager = CUDAGraphManager(
        ToyDecoder(),
        INPUTS,
        config_for(M.FULL_AND_PIECEWISE, sizes=(1, 2, 4, 8), max_num_seqs=8),
        device="cuda",
        options=ManagerOptions(decode_loop=DecodeLoop(refusing, max_steps=MAX_STEPS)),
    )
    with caplog.at_level("WARNING", logger="cudagraph_manager"):
        report = manager.capture()
    assert not any(g.loop for g in report.graphs)
    assert report.num_graphs == len(manager.dispatcher.keys(M.FULL)) + len(
        manager.dispatcher.keys(M.PIECEWISE)
    )
    assert "not captured, its run_loop loops on the host" in caplog.text
    ids, scale, steps = CASES[0]
    result = _run(manager, ids, scale, steps)
    assert result.kind is None
    assert result.tokens.tolist() == python_loop(ids, scale, steps)
