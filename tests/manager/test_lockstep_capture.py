"""``start_capture()`` with ranks: the lockstep protocol's table, turns, stop, wait and release.

And the eager step's ``num_tokens_across_dp`` (issue 41), which the EP example reads.

The protocol's table (docs/design.md, "With ranks") is checked here on one
rank with a scripted peer; the two-rank behaviour (each rank starting at its
own step, one rank's graphs cleared, released or faulted, wait() on one rank
while the other steps) runs in ``test_ranks_that_differ.py``; here also a
world of one rank over gloo, in this process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import pytest
import torch
import torch.distributed as dist

from cudagraph_capture import CaptureError
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, get_forward_context, set_forward_context
from cudagraph_manager import CaptureReport, CUDAGraphManager, ManagerOptions, NoGraphError
from cudagraph_manager._graphs._lockstep import (
    EVERY_KEY,
    IDLE,
    RUNNING,
    STOPPED,
    Lockstep,
    LockstepField,
    Together,
)
from cudagraph_manager._memory._device import CaptureTotals
from cudagraph_manager._values._reports import CapturedGraph
from cudagraph_manager.ranks import NUM_TOKENS_ACROSS_DP, RankAgreement, RanksDisagreeError
from examples.ep.decoder import step_tokens
from tests.manager.helpers import (
    INPUTS,
    TOL,
    FakeEngines,
    FirstRecordingGate,
    ToyModel,
    config_for,
    make_batch,
    rel_err,
)

_KEYS = [BatchDescriptor(n) for n in (8, 4, 2, 1)]  # a plan, largest first
WAIT_S = 120.0
_DIGEST = 0x1234


class _Peer:
    """Rank 0 of two, its peer scripted: each exchange answers with the peer's row of that width."""

    rank = 0
    world_size = 2

    def __init__(self, peer_keys: Sequence[BatchDescriptor] = (), peer_fails: bool = False) -> None:
        self.peer_keys = list(peer_keys)
        self.peer_fails = peer_fails
        self.widths: list[int] = []

    def exchange(self, row: Sequence[int]) -> list[tuple[int, ...]]:
        self.widths.append(len(row))
        if len(row) == 2:  # a key's outcome: (failed, worth retrying)
            peer: tuple[int, ...] = (int(self.peer_fails), int(self.peer_fails))
        else:  # the union's bit mask
            peer = (sum(1 << _KEYS.index(key) for key in self.peer_keys),)
        return [tuple(row), peer]


class _Jobs:
    """The captures of rank 0: ``pending`` keys without a graph; each capture_together scripted."""

    def __init__(self, pending: Sequence[BatchDescriptor], outcomes: Sequence[str] = ()) -> None:
        self.pending = list(pending)
        self.outcomes = list(outcomes)  # per call: "ok" (default), "retry", "fail"
        self.captured: list[BatchDescriptor] = []

    def start_totals(self) -> CaptureTotals:
        return CaptureTotals(torch.device("cpu"))

    def report(
        self, totals: CaptureTotals, graphs: Sequence[CapturedGraph], why: str | None
    ) -> CaptureReport:
        return cast(CaptureReport, ("report", len(graphs), why))

    def pending_keys(self) -> list[BatchDescriptor]:
        return list(self.pending)

    def why_not_capture(self) -> str | None:
        return None

    def capture_together(self, key: BatchDescriptor) -> Together:
        outcome = self.outcomes.pop(0) if self.outcomes else "ok"
        if outcome != "ok":
            return Together(None, CaptureError(outcome, key), retry=outcome == "retry")
        self.captured.append(key)
        if key in self.pending:
            self.pending.remove(key)
        return Together(cast(CapturedGraph, key), None, retry=False)


def _lockstep(jobs: _Jobs, peer: _Peer, idle: Callable[[], None] = lambda: None) -> Lockstep:
    ranks = cast(RankAgreement, peer)
    return Lockstep(ranks, jobs, _KEYS, _DIGEST, lambda: idle)


def _field(state: int, keys_left: int = 0, per_turn: int = 1, plan: int = _DIGEST) -> tuple[int, ...]:
    if state != RUNNING:
        return tuple(LockstepField(state, 0, 0, 0))
    return tuple(LockstepField(state, plan, keys_left, per_turn))


def test_a_rank_that_holds_every_key_takes_part_until_every_rank_is_done() -> None:
    """The issue's case: rank 0 has nothing left, rank 1 three keys; rank 0 records them too."""
    jobs, peer = _Jobs([]), _Peer(_KEYS[1:])
    lockstep = _lockstep(jobs, peer)
    session = lockstep.start(keys_per_step=1)
    assert lockstep.field() == _field(RUNNING, 0)  # participating, nothing left: never "not started"
    assert session.progress == (0, 0)
    for step in range(3):
        assert lockstep.stepped([lockstep.field(), _field(RUNNING, 3 - step, per_turn=2)]) is True
        peer.peer_keys = peer.peer_keys[1:]
    assert jobs.captured == _KEYS[1:]  # the union, in plan order, one key a turn (the fewer per turn)
    assert session.done  # the union's last key: ends in that step, on every rank alike
    assert session.progress == (3, 3)
    assert peer.widths == [1] * 3  # per turn, one exchange of the keys left (each key's: the capturer's)


@pytest.mark.parametrize(
    ("peer", "everywhere", "done"),
    [
        (_field(IDLE), False, False),  # the peer has not started: no turn, no exchange
        (_field(STOPPED), False, True),  # the peer stopped: every running capture ends here
        (_field(RUNNING, 0, plan=99), True, True),  # plans differ: ends, the error kept
        (_field(RUNNING, 0), True, True),  # nothing left anywhere: done
    ],
)
def test_the_table_without_a_turn(peer: tuple[int, ...], everywhere: bool, done: bool) -> None:
    jobs, ranks = _Jobs([]), _Peer()
    lockstep = _lockstep(jobs, ranks)
    session = lockstep.start(keys_per_step=1)
    assert lockstep.stepped([lockstep.field(), peer]) is everywhere
    assert session.done is done
    assert ranks.widths == []  # no turn: no exchange beyond the step's
    if peer[1] == 99:
        (error,) = session.errors
        assert isinstance(error, RanksDisagreeError)
        assert "the capture plan" in str(error)
    assert lockstep.field() == (_field(IDLE) if done else _field(RUNNING, 0))


def test_stop_ends_here_now_and_everywhere_at_the_next_exchange() -> None:
    jobs, ranks = _Jobs(_KEYS), _Peer()
    lockstep = _lockstep(jobs, ranks)
    session = lockstep.start(keys_per_step=1)
    session.stop()
    assert session.done  # never a collective: wait() returns at once
    report: object = session.wait()  # the stand-in jobs' report
    assert report == ("report", 0, "stopped (stop() or release() here) with 4 keys left")
    assert lockstep.field() == _field(STOPPED)
    again = lockstep.start(keys_per_step=1)  # a wake right after release(): joins after the announcement
    assert lockstep.stepped([lockstep.field(), _field(RUNNING, 2)]) is False
    assert not again.done
    assert lockstep.field() == _field(RUNNING, 4)


def test_a_failure_on_any_rank_is_retried_by_every_rank_alike() -> None:
    """A key every rank failed as an invalidated capture is tried again; another failure gives up."""
    jobs, ranks = _Jobs(_KEYS[:2], ["retry", "ok", "fail"]), _Peer()
    lockstep = _lockstep(jobs, ranks)
    session = lockstep.start(keys_per_step=EVERY_KEY)
    assert lockstep.stepped([lockstep.field(), _field(RUNNING, 0, per_turn=EVERY_KEY)]) is True
    assert session.done
    assert session.retries == 1
    assert [getattr(error, "descriptor", None) for error in session.errors] == [_KEYS[1]]
    assert jobs.captured == [_KEYS[0]]
    assert session.progress == (2, 2)


def test_wait_takes_steps_of_0_tokens_until_the_capture_ends() -> None:
    jobs, ranks = _Jobs(_KEYS), _Peer()
    steps: list[tuple[int, ...]] = []
    lockstep: Lockstep

    def idle() -> None:  # the manager's idle step: one exchange, then the turn
        steps.append(lockstep.field())
        peer = _field(RUNNING, 0, per_turn=EVERY_KEY) if len(steps) > 1 else _field(IDLE)  # the peer waits
        lockstep.stepped([lockstep.field(), peer])

    lockstep = _lockstep(jobs, ranks, idle)
    session = lockstep.start(keys_per_step=1)
    with pytest.raises(TimeoutError):
        session.wait(0)
    report: object = session.wait()  # the stand-in jobs' report
    assert report == ("report", 4, None)
    # The first step found the peer idle; the second captured every key left, in one turn.
    assert [LockstepField(*field).keys_per_turn for field in steps] == [EVERY_KEY, EVERY_KEY]
    assert jobs.captured == _KEYS


@pytest.fixture
def ranks() -> Iterator[RankAgreement]:
    """A world of one rank over gloo (an in-memory store), torn down after the test."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    store = dist.HashStore()  # type: ignore[attr-defined]  # exported by torch.distributed, untyped there
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield RankAgreement()
    finally:
        dist.destroy_process_group()


def _manager(
    ranks: RankAgreement, *, strict: bool = False
) -> tuple[CUDAGraphManager[torch.Tensor], ToyModel]:
    model = ToyModel(torch.device("cpu"))
    manager = CUDAGraphManager(
        model,
        INPUTS,
        config_for(CUDAGraphMode.FULL),
        device="cpu",
        strict=strict,
        options=ManagerOptions(engine_factory=FakeEngines(), ranks=ranks),
    )
    return manager, model


@pytest.mark.parametrize("strict", [False, True])
def test_the_steps_capture_keys_per_step_keys_and_switch_the_graphs_in(
    ranks: RankAgreement, strict: bool
) -> None:
    """``strict`` too: the steps before every key is captured run eagerly, as a background capture's may."""
    manager, model = _manager(ranks, strict=strict)
    planned = 7  # FULL over sizes 1, 2, 4, 8, 16, 24, 32
    session = manager.start_capture(keys_per_step=3)
    assert session.progress == (0, planned)
    captured = []
    for step in range(5):
        batch = make_batch(5, 3, torch.device("cpu"), seed=step)
        assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
        captured.append(manager.num_captured)
    assert captured == [3, 6, 7, 7, 7]
    assert session.progress == (7, 7)
    assert session.done
    assert not session.errors
    assert manager.stats.replays  # the last steps replayed
    assert len(session.wait().graphs) == 7
    manager.clear()


def test_stop_then_wait_captures_nothing_more_and_says_so(ranks: RankAgreement) -> None:
    manager, _ = _manager(ranks)
    session = manager.start_capture()
    manager.run_batch(make_batch(5, 3, torch.device("cpu"), seed=0))
    session.stop()
    manager.run_batch(make_batch(5, 3, torch.device("cpu"), seed=1))  # no turn: this rank carries 0
    report = session.wait()
    assert manager.num_captured == 1
    assert len(report.graphs) == 1
    assert session.done
    assert manager.capture().graphs
    assert manager.num_captured == 7
    manager.clear()


def test_wait_captures_the_rest_and_release_stops_a_capture(ranks: RankAgreement) -> None:
    manager, _ = _manager(ranks)
    session = manager.start_capture()
    with pytest.raises(RuntimeError, match="a background capture of this manager is running"):
        manager.capture()
    assert len(session.wait().graphs) == 7
    assert manager.num_captured == 7
    manager.release()
    again = manager.start_capture()  # the wake
    manager.release()  # stops it: nothing captured, nothing left running
    assert again.done
    assert manager.num_captured == 0
    assert "stopped" in str(again.wait().no_graphs)


def test_an_eager_step_with_ranks_carries_every_ranks_count(ranks: RankAgreement) -> None:
    """``extra["num_tokens_across_dp"]``: the counts this step's exchange agreed on (no second exchange)."""
    seen: list[object] = []
    toy = ToyModel(torch.device("cpu"))

    def model(**inputs: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        seen.append(None if context is None else context.extra.get(NUM_TOKENS_ACROSS_DP))
        out: torch.Tensor = toy(**inputs)
        return out

    manager = CUDAGraphManager(
        model, INPUTS, config_for(CUDAGraphMode.FULL), device="cpu", options=ManagerOptions(ranks=ranks)
    )
    manager.run_batch(make_batch(5, 3, torch.device("cpu"), seed=0))
    assert seen == [(5,)]


def test_the_expert_parallel_decoder_reads_the_agreed_counts_without_a_collective() -> None:
    """No process group here: an all-reduce would raise; the eager context's counts give the step's T."""
    assert not dist.is_initialized()
    with set_forward_context(CUDAGraphMode.NONE, BatchDescriptor(3), **{NUM_TOKENS_ACROSS_DP: (3, 9)}):
        assert step_tokens(3, torch.device("cpu"), None) == 9
    with set_forward_context(CUDAGraphMode.NONE, BatchDescriptor(1), **{NUM_TOKENS_ACROSS_DP: (0, 4)}):
        assert step_tokens(1, torch.device("cpu"), None) == 4  # an idle rank's dummy row


def test_a_strict_step_with_ranks_names_the_graph_that_is_not_captured(ranks: RankAgreement) -> None:
    """The reason the same step gives without ranks (the planned graph), not the dispatcher's route."""
    manager, _ = _manager(ranks, strict=True)
    why = r"its FULL graph BatchDescriptor\(num_tokens=4, .*\) was not captured yet; call capture\(\) first"
    with pytest.raises(NoGraphError, match=why):
        manager.run_batch(make_batch(3, 2, torch.device("cpu"), seed=0))


def test_the_eager_warning_says_which_capture_is_running(caplog: pytest.LogCaptureFixture) -> None:
    """While a capture thread records, a step it has not captured yet says so (not "call capture()")."""
    model = ToyModel(torch.device("cpu"))
    gate = FirstRecordingGate(WAIT_S)
    manager = gate.manager_on_cpu(model)
    with caplog.at_level(logging.WARNING, logger="cudagraph_manager"):
        handle = manager.start_capture()
        try:
            assert gate.entered.wait(WAIT_S)  # the largest key is being recorded
            manager.run_batch(make_batch(3, 2, torch.device("cpu"), seed=0))
        finally:
            gate.open()
            handle.wait(WAIT_S)
    messages = [record.getMessage() for record in caplog.records]
    (warning,) = [message for message in messages if "eagerly (not_captured)" in message]
    assert (
        "not captured yet: a background capture (start_capture()) is running and captures it next" in warning
    )
