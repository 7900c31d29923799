"""``start_capture()`` with ranks: the lockstep capture's agreement field, turns, stop, wait and release.

And the eager step's ``num_tokens_across_dp`` (issue 41), which the EP example reads.

The two-rank behaviour (each rank starting at its own step, a failure on one
rank, the keys captured together) is in ``test_ranks.py`` (``faults``) and
``test_ep_moe.py``; here a world of one rank over gloo, in this process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, get_forward_context, set_forward_context
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.ranks import RankAgreement, RanksDisagreeError
from cudagraph_manager.ranks._agreement import _capture_together
from examples.ep.decoder import step_tokens
from tests.manager.helpers import INPUTS, TOL, FakeEngines, ToyModel, config_for, make_batch, rel_err


def test_every_rank_captures_only_when_all_carry_the_same_keys_left() -> None:
    assert _capture_together([0, 0]) is False  # nobody started
    assert _capture_together([7, 0]) is False  # rank 1 has not started (or stopped, or is done)
    assert _capture_together([7, 7, 7]) is True
    with pytest.raises(RanksDisagreeError, match=r"the keys left to capture \(rank 0: digest 0x7, rank 1: "):
        _capture_together([7, 8])


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
        seen.append(None if context is None else context.extra.get("num_tokens_across_dp"))
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
    with set_forward_context(CUDAGraphMode.NONE, BatchDescriptor(3), num_tokens_across_dp=(3, 9)):
        assert step_tokens(3, torch.device("cpu"), None) == 9
    with set_forward_context(CUDAGraphMode.NONE, BatchDescriptor(1), num_tokens_across_dp=(0, 4)):
        assert step_tokens(1, torch.device("cpu"), None) == 4  # an idle rank's dummy row
