"""One rank of the expert-parallel decoder under the manager: build it, draw steps, check them.

``build_rank`` makes a rank's model (``ExpertParallelDecoder``), the full
weights its oracle needs, and a ``CUDAGraphManager`` whose ranks agree every
step. ``draw_counts`` draws every rank's step from one generator that all
ranks seed alike (so each rank knows what the others run); ``check_steps``
runs them and compares this rank's outputs, and the pairs it dropped, with
``oracle_step``.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections import Counter
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.lowlevel import GraphEngineFactory
from cudagraph_manager.ranks import RankAgreement

from ..config import DecoderConfig
from ..inputs import make_step_inputs
from ..reference import ReferenceDecoder, static_inputs
from .decoder import ExpertParallelDecoder
from .moe import MoeConfig, MoeWeights
from .oracle import oracle_step

#: The largest relative difference (``||out - oracle|| / ||oracle||``) a float32 step may show.
TOLERANCE = 1e-4


@dataclasses.dataclass
class RankModel:
    """A rank's model, its manager, and what its oracle needs (the full model, every expert)."""

    full: ReferenceDecoder
    weights: MoeWeights
    moe: MoeConfig
    model: ExpertParallelDecoder
    manager: CUDAGraphManager[torch.Tensor]


def build_rank(
    config: DecoderConfig,
    moe: MoeConfig,
    dispatch: DispatchConfig,
    device: torch.device,
    *,
    backend: Literal["gloo", "nccl", "shm"] = "gloo",
    engines: GraphEngineFactory | None = None,
) -> RankModel:
    """Every rank: the same seed, the same full model; this rank's experts; a manager agreeing each step."""
    torch.manual_seed(0)
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
    ranks = RankAgreement(backend=backend, timeout=datetime.timedelta(seconds=120))
    options: ManagerOptions[torch.Tensor] = ManagerOptions(ranks=ranks, engine_factory=engines)
    manager = CUDAGraphManager(model, static_inputs(config), dispatch, device=device, options=options)
    return RankModel(full, weights, moe, model, manager)


def dispatch_config(mode: CUDAGraphMode, config: DecoderConfig, sizes: tuple[int, ...]) -> DispatchConfig:
    return DispatchConfig(mode, CaptureSizes(sizes), config.max_num_seqs, 1)


def draw_counts(
    g: torch.Generator, world_size: int, largest: int, max_num_seqs: int
) -> list[tuple[int, bool]]:
    """Every rank's ``(num_tokens, uniform_decode)``, drawn independently: 0 and above ``largest`` too."""
    counts = []
    for _ in range(world_size):
        kind = int(torch.randint(0, 20, (), generator=g))
        if kind < 3:  # idle
            counts.append((0, False))
        elif kind < 5:  # above the largest capture size: eager on every rank
            counts.append((largest + int(torch.randint(1, 9, (), generator=g)), False))
        else:
            n = int(torch.randint(1, largest + 1, (), generator=g))
            counts.append((n, n <= max_num_seqs and bool(torch.randint(0, 2, (), generator=g))))
    return counts


@dataclasses.dataclass
class Tally:
    """What this rank's steps did: compared with the oracle, and by route."""

    steps: int = 0
    compared: int = 0
    mismatches: int = 0
    worst: float = 0.0
    dropped: int = 0
    dropped_expected: int = 0
    routes: Counter[str] = dataclasses.field(default_factory=Counter)


def check_steps(
    rank: RankModel,
    steps: int,
    *,
    seed: int,
    sizes: tuple[int, ...],
    tally: Tally | None = None,
    before_step: Callable[[int], None] | None = None,
) -> Tally:
    """``steps`` random steps on every rank (the same ``seed`` everywhere), each checked with the oracle."""
    config, manager, model = rank.full.config, rank.manager, rank.model
    me, world = dist.get_rank(), dist.get_world_size()
    device = manager.device
    shared = torch.Generator().manual_seed(seed)  # every rank's counts: the same draws everywhere
    own = torch.Generator().manual_seed(seed * 100 + me + 1)  # this rank's requests
    tally = tally or Tally()
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        counts = draw_counts(shared, world, sizes[-1], config.max_num_seqs)
        num_tokens, uniform = counts[me]
        if num_tokens:
            inputs = make_step_inputs(
                config, num_tokens, uniform_decode=uniform, generator=own, device=device
            )
        else:
            inputs = {
                name: torch.zeros(0, dtype=torch.int64, device=device) for name in static_inputs(config)
            }
        replays, dropped = dict(manager.stats.replays), model.dropped()
        model.last_step_tokens = 0
        out = manager.run_batch(inputs, uniform_decode=uniform)
        replayed = [key for key, n in manager.stats.replays.items() if n > replays.get(key, 0)]
        tally.routes[_route(replayed, num_tokens, counts)] += 1
        tally.steps += 1
        lost = model.dropped() - dropped
        tally.dropped += lost
        if not num_tokens:
            continue
        used = replayed[0][1] if replayed else model.last_step_tokens
        expected, expected_lost = oracle_step(
            rank.full, rank.weights, rank.moe, inputs, step_tokens=used, world_size=world
        )
        err = float((out - expected).norm() / expected.norm())
        tally.compared += 1
        tally.worst = max(tally.worst, err)
        tally.dropped_expected += expected_lost
        tally.mismatches += int(err > TOLERANCE or lost != expected_lost or out.shape != expected.shape)
    return tally


def _route(replayed: list[tuple[CUDAGraphMode, int]], num_tokens: int, counts: list[tuple[int, bool]]) -> str:
    """A step's route in a word: the mode replayed (``dummy_`` on an idle rank), or eager, or idle."""
    busy = any(n for n, _ in counts)
    if replayed:
        return ("dummy_" if not num_tokens else "") + replayed[0][0].name
    if not busy:
        return "idle"
    return "dummy_eager" if not num_tokens else "eager"
