"""A rank of the tests of ranks whose graphs differ (``test_ranks_that_differ.py``).

Every combination the API allows runs in one pair of processes, one after
the other on the same managers: one rank's graphs cleared, released, a
rank's capture stopped (before a step, and with ``wait()`` right after),
a recording faulted on one rank (an invalidated capture, tried again; the
model's own error, given up), a rank that starts late, ``wait()`` on one
rank while the other steps, and ``capture()`` after one rank's ``clear()``.
Each real step is compared with the single-process oracle (``check_steps``);
after each combination every rank serves from graphs again within one
lockstep capture (a probe step replays on every rank). Every exchange's
width is logged, so the parent compares the two ranks' sequences: every
collective entered by every rank, in the same order, with rows of one shape.

``ep cpu``: gloo, the fake engines (their recordings run the model,
all-to-alls included, so every rank must record together). ``ep cuda``:
rank ``r`` on GPU ``r``, NCCL's all-to-alls inside the graphs. ``toy
shared_cuda``: both ranks on one GPU with the real engines, the toy model
with one gloo all-reduce per forward (``CollectiveToy``: a recording runs it
on the host, so every rank records together), compared with the toy model
run eagerly.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Final

import torch

import cudagraph_manager.ranks as ranks_tier
from cudagraph_capture import CaptureInvalidatedError
from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import BackgroundCapture, CUDAGraphManager, ManagerOptions
from cudagraph_manager.ranks import RankAgreement, RanksDisagreeError
from cudagraph_manager.ranks._agreement import Backend
from cudagraph_manager.ranks._shared_table import shared_memory_supported
from examples.config import DecoderConfig
from examples.ep.decoder import ExpertParallelDecoder
from examples.ep.moe import MoeConfig, MoeWeights
from examples.ep.oracle import oracle_step
from examples.ep.steps import TOLERANCE, RankModel, Tally, check_steps, dispatch_config
from examples.inputs import make_step_inputs
from examples.reference import ReferenceDecoder, static_inputs
from tests.manager.helpers import INPUTS, TOL, FakeEngines, ToyModel, config_for, make_batch, rel_err
from tests.manager.rank_worker import CollectiveToy, _setup
from tests.ranks_support import Result, rank_main

CPU_SIZES: Final = (1, 8, 32)  # 5 keys: PIECEWISE 32, 8, 1; FULL uniform 8, 1
GPU_SIZES: Final = (1, 2, 4, 8, 16, 32)
_WIDTHS: list[int] = []  # every exchange's row width on this rank, in order


def _logged_exchange(exchange: Callable[[RankAgreement, Sequence[int]], list[tuple[int, ...]]]) -> None:
    """``RankAgreement.exchange``, logging each row's width (every collective of the agreement goes here)."""

    def logged(self: RankAgreement, row: Sequence[int]) -> list[tuple[int, ...]]:
        _WIDTHS.append(len(row))
        return exchange(self, row)

    RankAgreement.exchange = logged  # type: ignore[method-assign]  # this process's instrument


class Faulty:
    """The model, raising once after a recording's forward where armed (its collectives met first).

    ``armed``: the error type a recording raises next (``CaptureInvalidatedError``: as CUDA
    invalidating it, tried again; ``RuntimeError``: the model's own, given up). ``recording()``
    is the fake engines' hook (their recordings run the forward); on a GPU, a stream capture.
    """

    def __init__(self, model: Callable[..., torch.Tensor]) -> None:
        self.model = model
        self.armed: type[Exception] | None = None
        self._recording = False

    def recording(self) -> None:
        self._recording = True

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        recording, self._recording = self._recording, False
        out: torch.Tensor = self.model(**inputs)
        capturing = recording or (out.is_cuda and torch.cuda.is_current_stream_capturing())
        if self.armed is not None and capturing:
            error, self.armed = self.armed, None
            raise error("planted recording failure on this rank")
        return out


class Rank:
    """This rank's model and manager, and the steps it ran, each checked (``steps``, ``probe``)."""

    manager: CUDAGraphManager[torch.Tensor]
    faulty: Faulty
    rank: int
    tally: Tally
    seed: int
    combinations: int

    def steps(self, count: int) -> None:
        """``count`` random steps (every rank draws every rank's counts alike), each checked."""
        raise NotImplementedError

    def probe(self) -> bool:
        """A step of 5 tokens on every rank: whether it replayed a graph; checked."""
        raise NotImplementedError

    @property
    def planned(self) -> int:
        return sum(len(keys) for _, keys in self.manager.dispatcher.capture_plan())

    def until_done(self, session: BackgroundCapture) -> int:
        """Steps until ``session`` ended (every rank's ends in the same step); how many."""
        count = 0
        while not session.done:
            self.steps(1)
            count += 1
        return count

    def facts(self, session: BackgroundCapture | None = None) -> dict[str, object]:
        """What both ranks must agree on after a combination (the probe step runs here)."""
        facts: dict[str, object] = {"captured": self.manager.num_captured}
        if session is not None:
            facts.update(
                done=session.done,
                progress=list(session.progress),
                errors=len(session.errors),
                retries=session.retries,
            )
        facts["probe_replayed"] = self.probe()
        self.combinations += 1
        self.seed = 1000 * self.combinations  # the ranks' draws in step again (a wait() took none)
        return facts

    def checked(self, err: float) -> None:
        """One output compared: its relative error against the oracle (or eager)."""
        self.tally.compared += 1
        self.tally.mismatches += int(err > min(TOL, TOLERANCE))
        self.tally.worst = max(self.tally.worst, err)


class EpRank(Rank):
    """The expert-parallel decoder, checked with its single-process oracle."""

    def __init__(self, device: torch.device, backend: Backend, sizes: tuple[int, ...]) -> None:
        torch.manual_seed(0)
        config = DecoderConfig.small()
        moe = MoeConfig(top_k=2, expert_size=64)
        full = ReferenceDecoder(config, device=device)
        weights = MoeWeights(
            moe,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            device=device,
            dtype=config.dtype,
        )
        model = ExpertParallelDecoder(full, weights, moe)
        self.faulty = Faulty(model)
        engines = FakeEngines(self.faulty.recording) if device.type == "cpu" else None
        ranks = RankAgreement(backend=backend, timeout=datetime.timedelta(seconds=120))
        options: ManagerOptions[torch.Tensor] = ManagerOptions(ranks=ranks, engine_factory=engines)
        dispatch = dispatch_config(CUDAGraphMode.FULL_AND_PIECEWISE, config, sizes)
        manager = CUDAGraphManager(
            self.faulty, static_inputs(config), dispatch, device=device, options=options
        )
        self.built = RankModel(full, weights, moe, model, manager)
        self.manager = manager
        self.sizes = sizes
        self.rank = ranks.rank
        self.tally = Tally()
        self.seed = self.combinations = 0

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.seed += 1
            check_steps(self.built, 1, seed=self.seed, sizes=self.sizes, tally=self.tally)

    def probe(self) -> bool:
        manager, built = self.manager, self.built
        generator = torch.Generator().manual_seed(1000 + self.rank)
        inputs = make_step_inputs(
            built.full.config, 5, uniform_decode=False, generator=generator, device=manager.device
        )
        before = manager.stats.num_replays
        out = manager.run_batch(inputs)
        replayed = manager.stats.num_replays > before
        used = 8 if replayed else built.model.last_step_tokens  # the key every rank pads 5 tokens to
        expected, _ = oracle_step(
            built.full, built.weights, built.moe, inputs, step_tokens=used, world_size=2
        )
        self.checked(float((out - expected).norm() / expected.norm()))
        return replayed


class ToyRank(Rank):
    """The toy model with one gloo all-reduce per forward, checked with the toy model run eagerly."""

    def __init__(self, device: torch.device, backend: Backend) -> None:
        torch.manual_seed(0)
        self.model = ToyModel(device)
        self.faulty = Faulty(CollectiveToy(self.model))
        engines = FakeEngines(self.faulty.recording) if device.type == "cpu" else None
        ranks = RankAgreement(backend=backend, timeout=datetime.timedelta(seconds=120))
        options: ManagerOptions[torch.Tensor] = ManagerOptions(ranks=ranks, engine_factory=engines)
        config = config_for(CUDAGraphMode.FULL_AND_PIECEWISE)
        self.manager = CUDAGraphManager(self.faulty, INPUTS, config, device=device, options=options)
        self.rank = ranks.rank
        self.tally = Tally()
        self.seed = self.combinations = 0

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.seed += 1
            shared = torch.Generator().manual_seed(self.seed)  # every rank's count: the same draws
            num_tokens = [int(torch.randint(0, 41, (), generator=shared)) for _ in range(2)][self.rank]
            self._step(num_tokens, seed=self.seed * 10 + self.rank)

    def probe(self) -> bool:
        before = self.manager.stats.num_replays
        self._step(5, seed=7 + self.rank)
        return self.manager.stats.num_replays > before

    def _step(self, num_tokens: int, *, seed: int) -> None:
        batch = make_batch(num_tokens, min(num_tokens, 3), self.manager.device, seed=seed)
        out = self.manager.run_batch(batch)
        self.tally.steps += 1
        if num_tokens:
            self.checked(rel_err(out, self.model.eager(batch)))


def combinations(args: Sequence[str]) -> Result:
    """``model device_kind backend``: every combination in turn; per combination, facts both ranks compare."""
    model, device_kind, backend_arg = args
    rank, device = _setup(device_kind)
    if device_kind == "cuda":  # NCCL connects its peers on a first all-to-all: now, not inside a capture
        torch.distributed.all_to_all_single(torch.empty(2, device=device), torch.zeros(2, device=device))
    _logged_exchange(RankAgreement.exchange)
    backend: Backend = "nccl" if backend_arg == "nccl" else "shm" if backend_arg == "shm" else "gloo"
    me: Rank
    if model == "toy":
        me = ToyRank(device, backend)
    else:
        me = EpRank(device, backend, CPU_SIZES if device.type == "cpu" else GPU_SIZES)
    manager, planned = me.manager, me.planned
    out: Result = {"planned": planned}

    manager.capture()
    me.steps(2)
    out["capture"] = me.facts()

    # The case: rank 1 alone clears; both start; steps; both wait().
    if rank == 1:
        manager.clear()
    me.steps(2)  # every rank eager (rank 0: other_rank)
    session = manager.start_capture()
    me.steps(2)  # one key a step, on both ranks (rank 0 records them again)
    session.wait()  # the rest, in one turn
    out["cleared"] = me.facts(session)

    # Released on rank 1, then both wake, two keys a step, until every rank's capture ends.
    if rank == 1:
        manager.release()
    me.steps(2)
    session = manager.start_capture(keys_per_step=2)
    out["released_steps"] = me.until_done(session)
    session.wait()  # done: no exchange on either rank
    out["released"] = me.facts(session)

    # Stopped: rank 0 misses every key, rank 1 stops after one turn; every capture ends at the next step.
    if rank == 0:
        manager.clear()
    session = manager.start_capture()
    me.steps(1)
    if rank == 1:
        session.stop()
    me.steps(1)
    out["stopped"] = {"done": session.done, "captured": manager.num_captured, "errors": len(session.errors)}
    session = manager.start_capture()
    session.wait()
    out["stopped_again"] = me.facts(session)

    # Stopped and waited for on rank 1 with no step between: its wait() exchanges nothing, rank 0's
    # wait() meets rank 1's next step.
    if rank == 0:
        manager.clear()
    session = manager.start_capture()
    if rank == 1:
        session.stop()
        session.wait()
        me.steps(1)
    else:
        session.wait()
        me.seed += 1
    out["stop_wait"] = {"done": session.done, "captured": manager.num_captured}
    session = manager.start_capture()
    session.wait()
    out["stop_wait_again"] = me.facts(session)

    # Faulted mid-recording on rank 1: invalidated (tried again on both), then the model's own (given up).
    for name, error in (("invalidated", CaptureInvalidatedError), ("model_error", RuntimeError)):
        if rank == 1:
            manager.clear()
            me.faulty.armed = error
        session = manager.start_capture()
        session.wait()
        out[f"fault_{name}"] = {
            "captured": manager.num_captured,
            "errors": len(session.errors),
            "retries": session.retries,
        }
        session = manager.start_capture()  # the key given up, if any, captured now
        session.wait()
        out[f"fault_{name}_again"] = me.facts(session)

    # Started late: rank 0 at once, rank 1 two steps later; rank 0 waits (logged), then both capture.
    if rank == 1:
        manager.clear()
    sessions = [manager.start_capture()] if rank == 0 else []
    me.steps(2)
    out["late_waiting"] = {"captured": manager.num_captured, "done": sessions[0].done if sessions else None}
    if rank == 1:
        sessions.append(manager.start_capture())
    out["late_steps"] = me.until_done(sessions[0])
    out["late"] = me.facts(sessions[0])

    # wait() on rank 0 while rank 1 steps: rank 0's steps of 0 tokens join rank 1's steps.
    if rank == 0:
        manager.clear()
    session = manager.start_capture()
    if rank == 0:
        session.wait()
    else:
        me.until_done(session)
    out["one_waits"] = me.facts(session)

    # Released while capturing, on rank 1: its capture ends now, rank 0's at the next step; both wake.
    manager.clear()
    session = manager.start_capture()
    me.steps(1)
    if rank == 1:
        manager.release()
    me.steps(1)
    out["released_midway"] = {"done": session.done}
    session = manager.start_capture()
    session.wait()
    out["released_midway_again"] = me.facts(session)

    # capture() after one rank's clear(): the keys it misses, captured on both (no plan error).
    if rank == 0:
        manager.clear()
    try:
        manager.capture()
        out["capture_after_clear"] = me.facts()
    except RanksDisagreeError as disagreement:
        out["capture_after_clear"] = {"error": str(disagreement)}

    if device.type == "cpu" and shared_memory_supported() is None:
        out["shm_rows"] = _shared_table_rows(rank)
    tally = me.tally
    out.update(
        steps=tally.steps,
        compared=tally.compared,
        mismatches=tally.mismatches,
        worst=tally.worst,
        eager_reasons=dict(manager.stats.eager_reasons),
        widths=list(_WIDTHS),
    )
    manager.clear()  # graphs with NCCL work freed before the process ends (rank_main never tears down)
    return out


def _shared_table_rows(rank: int) -> dict[str, list[list[int]]]:
    """The shm backend takes rows of any width, as gloo and NCCL do: its table grows on every rank alike."""
    ranks = RankAgreement(backend="shm", timeout=datetime.timedelta(seconds=60))
    rows = {width: ranks.exchange([rank * 1000 + i for i in range(width)]) for width in (3, 40, 9, 200, 1)}
    return {str(width): [list(row) for row in got] for width, got in rows.items()}


assert ranks_tier.NUM_TOKENS_ACROSS_DP == "num_tokens_across_dp"  # the name vLLM's models read

if __name__ == "__main__":
    rank_main({"combinations": combinations})
