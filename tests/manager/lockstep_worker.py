"""A rank of the lockstep capture's misuse cases (``test_lockstep_ranks.py``): 2 ranks over gloo, CPU.

The model holds a collective (``CollectiveToy``): a rank that runs the model
while the other raises, or captures a key the other does not, leaves the
other waiting, and the test fails by its hard timeout.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence

import torch

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.ranks import RankAgreement
from tests.manager.helpers import INPUTS, FakeEngines, ToyModel, config_for, make_batch
from tests.manager.rank_worker import CollectiveToy, _setup
from tests.ranks_support import Result, rank_main

_CPU = torch.device("cpu")


def _manager(strict: bool) -> CUDAGraphManager[torch.Tensor]:
    model = CollectiveToy(ToyModel(_CPU))
    options: ManagerOptions[torch.Tensor] = ManagerOptions(
        engine_factory=FakeEngines(), ranks=RankAgreement()
    )
    return CUDAGraphManager(
        model, INPUTS, config_for(CUDAGraphMode.FULL), device=_CPU, strict=strict, options=options
    )


def _steps(
    manager: CUDAGraphManager[torch.Tensor], sizes: Sequence[int], before: Callable[[int], None]
) -> list[str]:
    """Each step's outcome: ``ok <captured>`` or the error's type (the model ran, or it raised)."""
    log = []
    for step, n in enumerate(sizes):
        before(step)
        try:
            manager.run_batch(make_batch(n, min(n, 3), _CPU, seed=step))
            log.append(f"ok {manager.num_captured}")
        except Exception as error:  # the outcome under test, compared across ranks
            log.append(type(error).__name__)
    return log


def scenarios(args: Sequence[str]) -> Result:
    """Every case in one pair of processes; each case's log per step."""
    rank, _ = _setup("cpu")
    out: Result = {}
    # Strict, this rank idle while the other runs: both run their steps (the dummy step joins).
    manager = _manager(strict=True)
    manager.start_capture()  # the handle dropped: the steps capture all the same
    gc.collect()
    out["strict_idle"] = _steps(manager, [5 if rank == 0 else 0] * 9, lambda step: None)
    manager.clear()
    # Strict, a batch above the largest size on one rank only, while capturing: both run it eagerly.
    manager = _manager(strict=True)
    handle = manager.start_capture()
    out["strict_large"] = _steps(manager, [40 if rank == 0 else 5, 5], lambda step: None)
    handle.stop()
    handle.wait()
    # Strict, rank 1 starts two steps later: until then both refuse (every rank alike), then both run.
    manager = _manager(strict=True)
    started: list[object] = []

    def start(step: int) -> None:
        if step == 2 * rank:
            started.append(manager.start_capture())

    out["strict_stagger"] = _steps(manager, [5] * 4, start)
    # One rank stops: every rank's capture ends at the next step, and wait() exchanges nothing.
    manager = _manager(strict=False)
    session = manager.start_capture()

    def stop(step: int) -> None:
        if step == 1 and rank == 0:
            session.stop()

    out["stop_one"] = _steps(manager, [5] * 4, stop)
    out["stop_one_done"] = session.done
    out["stop_one_graphs"] = len(session.wait().graphs)
    return out


if __name__ == "__main__":
    rank_main({"scenarios": scenarios})
