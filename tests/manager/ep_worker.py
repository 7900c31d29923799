"""One rank of the expert-parallel tests (``python -m tests.manager.ep_worker ep ...``).

Spawned by ``tests/manager/test_ep_moe.py`` through ``tests.ranks_support``.
Every rank builds the DP-attention + EP-MoE decoder (``examples.ep``), the
same seed everywhere, and runs random steps whose per-rank sizes are drawn
independently; each of its outputs, and the pairs it dropped, are compared
with the single-process oracle that holds every expert. ``cpu`` runs over
gloo with the fake engines (their replays run the model, all-to-alls
included); ``cuda`` runs rank ``r`` on GPU ``r``, NCCL's all-to-alls inside
the graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import BackgroundCapture
from cudagraph_manager.ranks import RanksDisagreeError
from cudagraph_manager.ranks._agreement import Backend
from examples.config import DecoderConfig
from examples.ep.moe import MoeConfig
from examples.ep.steps import RankModel, Tally, build_rank, check_steps, dispatch_config
from tests.manager.helpers import FakeEngines
from tests.manager.rank_worker import _setup
from tests.ranks_support import Result, rank_main

SIZES: Final = (1, 2, 4, 8, 16, 32)
CPU_SIZES: Final = (1, 8, 32)  # fewer keys to capture on the CPU (fake engines run the model per key)


def _rank(
    mode: CUDAGraphMode,
    moe: MoeConfig,
    device: torch.device,
    backend: Backend,
    sizes: tuple[int, ...] = SIZES,
) -> RankModel:
    engines = FakeEngines() if device.type == "cpu" else None
    config = DecoderConfig.small()
    return build_rank(
        config, moe, dispatch_config(mode, config, sizes), device, backend=backend, engines=engines
    )


def _plan_refused(device: torch.device, rank: int) -> str:
    """Rank 1 plans other sizes: ``capture()`` raises on every rank, naming the plan, before any capture."""
    sizes = (1, 2) if rank == 0 else (1, 3)
    built = _rank(CUDAGraphMode.FULL, MoeConfig(expert_size=8), device, "gloo", sizes)
    try:
        built.manager.capture()
        return "no error"
    except RanksDisagreeError as error:
        return f"RanksDisagreeError: {error}"
    finally:
        built.manager.clear()


def expert_parallel(args: Sequence[str]) -> Result:
    """``device_kind mode top_k capacity steps backend phased``: random steps against the oracle.

    ``capacity``: ``exact`` or a factor. ``phased=bg``: ``start_capture()``
    at step 3 on rank 0 and step 8 on rank 1 (captured in lockstep from step 8,
    one key a step), nothing captured before. ``phased=1``: a quarter of the steps
    before any capture (every rank eager), then ``capture()``; at half,
    rank 1 frees its graphs (every rank eager again: rank 0 for ``other_rank``);
    at three quarters both capture again.
    """
    device_kind, mode_name, top_k, capacity, steps_arg, backend_arg, phased = args
    rank, device = _setup(device_kind)
    torch.backends.cuda.matmul.allow_tf32 = False
    mode, steps = CUDAGraphMode[mode_name], int(steps_arg)
    backend: Backend = "nccl" if backend_arg == "nccl" else "shm" if backend_arg == "shm" else "gloo"
    factor = None if capacity == "exact" else float(capacity)
    if device.type == "cuda":  # NCCL connects its peers on a first all-to-all: now, not inside a capture
        torch.distributed.all_to_all_single(torch.empty(2, device=device), torch.zeros(2, device=device))
    result: Result = {"plan": _plan_refused(device, rank)}
    sizes = CPU_SIZES if device.type == "cpu" else SIZES
    moe = MoeConfig(top_k=int(top_k), expert_size=64, capacity_factor=factor)
    built = _rank(mode, moe, device, backend, sizes)
    manager = built.manager
    quarter = steps // 4
    eager_reasons: dict[str, int] = {}

    history: list[int] = []
    sessions: list[BackgroundCapture] = []

    def phases(step: int) -> None:
        history.append(manager.num_captured)  # the keys captured before this step
        if phased == "bg":
            if step == 3 + 5 * rank:  # each rank starts at its own step; the ranks capture together
                sessions.append(manager.start_capture())
            return
        if phased != "1":
            if step == 0:
                manager.capture()
            return
        if step == quarter:
            eager_reasons.update(manager.stats.eager_reasons)  # before any capture
            manager.capture()
        elif step == 2 * quarter and rank == 1:
            manager.clear()
        elif step == 3 * quarter:
            manager.clear()
            manager.capture()

    tally: Tally = check_steps(built, steps, seed=11, sizes=sizes, before_step=phases)
    stats = manager.stats
    result.update(
        steps=tally.steps,
        compared=tally.compared,
        mismatches=tally.mismatches,
        worst=tally.worst,
        dropped=tally.dropped,
        dropped_expected=tally.dropped_expected,
        routes=dict(tally.routes),
        eager_reasons=dict(stats.eager_reasons),
        before_capture=eager_reasons,
        dummy_steps=stats.dummy_steps,
        captured=manager.num_captured,
        replays=sum(stats.replays.values()),
        history=history,
    )
    for session in sessions:
        result.update(bg_progress=list(session.progress), bg_errors=len(session.errors), bg_done=session.done)
    manager.clear()  # graphs with NCCL work freed before the process ends (rank_main never tears down)
    return result


if __name__ == "__main__":
    rank_main({"ep": expert_parallel})
