"""The shrinking decode loop and the loop's floor on the GPU (issue 53; issue 49, item 6).

Every figure interleaved in one process (``interleave``: candidates alternate
round by round, ratios taken round by round), each beside its target in
``extra_info`` (``{name}_target``). Nothing about speed is asserted (the
device is shared); correctness is: the tokens of the deterministic cases.

- ``uniform_stops``: 256 requests of the paged decoder (4 layers, d1024,
  bf16, flex), keys 1, 8, 16, 32, 64, 128, 192, 256, each stopping at its
  length limit, four a step over 64 steps. ``shrinking`` (``run_loop`` of
  ``DecodeLoop(shrink=True)``), ``today`` (``run_loop`` of a loop that
  neither shrinks nor checks every k steps: ``check_every=1``), ``fixed``
  (the default loop: no shrinking, the default ``check_every``), ``ideal_host`` (the forward
  and the advance as one graph per key, replayed from the host on the key of
  each step's live count, known in advance: the requests ordered by their
  stop step, the live ones always in front; no read-back). Targets:
  shrinking / today <= 0.8, shrinking / ideal_host <= 1.05.
- ``nothing_stops``: the same managers, nobody stopping within the 64
  steps. Target: shrinking / today <= 1.02.
- ``switch_launch``: a launch through ``SwitchReplay`` over the manager's
  FULL graphs of the uniform keys against the host-chosen graph's replay, at
  13 live counts. Target: at most 10 us more per launch.
- ``loop_floor``: ``run_loop`` against its floor (the forward and the
  advance as one graph, replayed back to back) at 1, 8 and 64 requests on
  the decode-loop benchmark's model (``test_bench_decode_loop``'s
  default), 64 steps, nobody stopping: the default loop, and
  ``check_every`` 1 and 8, and the default without shrinking. Target: the
  default <= 1.02.

``SHRINKLOOP_RUNS=path`` appends each test's figures as a JSON line (a
job can print them whatever a time limit cut).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import pytest
import torch

from cudagraph_capture import LoopKind, LoopPolicy
from cudagraph_capture._choice import SwitchReplay
from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    set_forward_context,
)
from cudagraph_manager import CUDAGraphManager, DecodeLoop, LoopState, ManagerOptions
from cudagraph_manager.attention import AttentionOptions, BatchShape, StepBatch, metadata_extra
from examples import DecoderConfig
from examples.paged import PAGED_INPUT_NAMES, PagedDecoder, PagedLayout, paged_static_inputs
from examples.paged.loop import NO_TOKEN, PagedAdvance, decode_batch, greedy_advance
from tests.benchmarks.support import (
    BenchmarkFixture,
    Interleaved,
    append_json_line,
    interleave,
    plain_graph,
    record_interleaved,
)

pytestmark = pytest.mark.gpu

ROUNDS: Final = 7
#: The uniform-stop schedule: 256 requests, four stopping a step over 64 steps.
BATCH: Final = 256
STEPS: Final = 64
MAX_LEN: Final = 200
SIZES: Final = (1, 8, 16, 32, 64, 128, 192, 256)
#: The live counts of the SWITCH launch (the feasibility script's).
LIVE_COUNTS: Final = (1, 3, 8, 13, 16, 31, 48, 64, 100, 128, 160, 200, 256)
LAUNCHES: Final = 20
#: The loop floor: the decode-loop benchmark's default model, batches and steps.
FLOOR_BATCHES: Final = (1, 8, 64)
FLOOR_STEPS: Final = 64
FLOOR_CHECK_EVERY: Final = (1, 8)
TARGETS: Final = {
    "shrinking_over_today": 0.8,
    "shrinking_over_ideal_host": 1.05,
    "nothing_stops_shrinking_over_today": 1.02,
    "switch_added_us": 10.0,
    "default_over_floor": 1.02,
}


def emit(test: str, info: Mapping[str, object]) -> None:
    """One JSON line of ``info`` for the job's summary (``SHRINKLOOP_RUNS``), where asked for."""
    append_json_line("SHRINKLOOP_RUNS", {"test": test, **info})


def _manager(
    model: PagedDecoder, sizes: Sequence[int], loop: DecodeLoop[torch.Tensor]
) -> CUDAGraphManager[torch.Tensor]:
    dispatch = DispatchConfig(
        CUDAGraphMode.FULL_DECODE_ONLY, CaptureSizes(list(sizes)), max_num_seqs=max(sizes)
    )
    return CUDAGraphManager(
        model,
        paged_static_inputs(model.layout),
        dispatch,
        options=ManagerOptions(decode_loop=loop, attention=AttentionOptions(metadata_builder=model.backend)),
    )


def _loops(advance: PagedAdvance, steps: int) -> dict[str, DecodeLoop[torch.Tensor]]:
    """The loops compared: the default (shrinking), today's (one step a check, no shrinking), fixed."""
    return {
        "shrinking": DecodeLoop(advance, max_steps=steps, shrink=True),
        "today": DecodeLoop(advance, max_steps=steps, policy=LoopPolicy(check_every=1)),
        "fixed": DecodeLoop(advance, max_steps=steps),
    }


# ---------------------------------------------------------------------------
# 256 requests: the uniform stops, nothing stopping, the SWITCH launch
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """The 256-request model, its advance, and a manager per loop, captured."""

    model: PagedDecoder
    advance: PagedAdvance
    managers: Mapping[str, CUDAGraphManager[torch.Tensor]]


@functools.cache
def _schedule() -> Schedule:
    torch.manual_seed(0)
    config = dataclasses.replace(DecoderConfig(), num_layers=4)
    model = PagedDecoder(config, layout=PagedLayout.for_config(config), device="cuda")
    advance = greedy_advance(model, eos_id=None, max_len=MAX_LEN)
    managers = {name: _manager(model, SIZES, loop) for name, loop in _loops(advance, STEPS).items()}
    with torch.no_grad():
        for name, manager in managers.items():
            report = manager.capture(progress=False)
            assert report.shrink_fallback is None, (name, report.shrink_fallback)  # shrinks where asked
    return Schedule(model, advance, managers)


def _uniform_stops(model: PagedDecoder) -> tuple[dict[str, torch.Tensor], list[int]]:
    """256 requests in a shuffled order, request ``r`` stopping at step ``stops[r]`` (four a step)."""
    generator = torch.Generator().manual_seed(53)
    stops = [1 + r * STEPS // BATCH for r in range(BATCH)]
    order = torch.randperm(BATCH, generator=generator).tolist()
    stops = [stops[i] for i in order]
    lens = [MAX_LEN - stop for stop in stops]  # a request stops once its length reaches MAX_LEN
    return decode_batch(model, lens, max_len=MAX_LEN, generator=generator, device="cuda"), stops


def _nothing_stops(model: PagedDecoder) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(54)
    lens = torch.randint(1, MAX_LEN - STEPS - 1, (BATCH,), generator=generator).tolist()
    return decode_batch(model, lens, max_len=MAX_LEN, generator=generator, device="cuda")


class IdealHost:
    """The forward and the advance as one graph per key, replayed on each step's key from the host.

    The requests are ordered by their stop step (the latest first), so the
    live ones are always the first rows; the key of each step is known before
    the loop (``schedule``): no read-back, no partition. Its own static
    inputs and state; the metadata built once for the whole batch.
    """

    def __init__(self, model: PagedDecoder, advance: PagedAdvance, batch: Mapping[str, torch.Tensor]) -> None:
        self.model, self.batch = model, batch
        self.static = {name: tensor.clone() for name, tensor in batch.items()}
        self.state = LoopState(
            torch.zeros((), dtype=torch.int64, device="cuda"),
            torch.zeros((), dtype=torch.bool, device="cuda"),
            torch.ones(BATCH, dtype=torch.bool, device="cuda"),
            torch.full((STEPS, BATCH), NO_TOKEN, dtype=torch.int64, device="cuda"),
        )
        self.refill()
        self.graphs = {size: plain_graph(self._body(advance, size)) for size in reversed(SIZES)}
        self.schedule: list[int] = []

    def _body(self, advance: PagedAdvance, size: int) -> Callable[[], None]:
        backend = self.model.backend
        shape = BatchShape(size, size, 1, CUDAGraphMode.FULL)
        context = metadata_extra(backend, backend.build_for_capture(shape))
        key = BatchDescriptor(size, size, True)
        views = {name: tensor[:size] for name, tensor in self.static.items()}
        state = self.state
        rows = LoopState(state.step, state.stop, state.active[:size], state.tokens[:, :size])

        def body() -> None:
            with torch.no_grad(), set_forward_context(CUDAGraphMode.FULL, key, **context):
                advance(self.model(*(views[name] for name in PAGED_INPUT_NAMES)), views, rows)
                state.step.add_(1)  # in the graph: nothing between two replays

        return body

    def refill(self) -> None:
        for name, tensor in self.batch.items():
            self.static[name].copy_(tensor)
        shape = BatchShape(BATCH, BATCH, 1, CUDAGraphMode.FULL)
        self.model.backend.build(StepBatch(BATCH, BATCH, self.static), shape)
        self.state.active.fill_(True)
        self.state.step.zero_()
        self.state.tokens.fill_(NO_TOKEN)

    def run(self) -> torch.Tensor:
        self.refill()
        for size in self.schedule:
            self.graphs[size].replay()
        return self.state.tokens


def _keys_of(live: Sequence[int]) -> list[int]:
    return [next(size for size in SIZES if size >= n) for n in live]


def _interleaved_loops(
    benchmark: BenchmarkFixture, setup: Schedule, batch: Mapping[str, torch.Tensor], ideal: IdealHost
) -> tuple[Interleaved, dict[str, torch.Tensor]]:
    """Each loop's tokens once (in the caller's order), then every candidate timed, interleaved."""
    with torch.no_grad():
        tokens = {
            name: manager.run_loop(max_steps=STEPS, **batch).tokens.clone()
            for name, manager in setup.managers.items()
        }
        candidates: dict[str, Callable[[], object]] = {
            name: functools.partial(manager.run_loop, max_steps=STEPS, **batch)
            for name, manager in setup.managers.items()
        }
        candidates["ideal_host"] = ideal.run
        results: list[Interleaved] = []
        benchmark.pedantic(
            lambda: results.append(interleave(candidates, rounds=ROUNDS, calls_per_round=1)),
            rounds=1,
            iterations=1,
        )
    return results[0], tokens


def test_bench_shrinking_loop_uniform_stops(benchmark: BenchmarkFixture) -> None:
    setup = _schedule()
    batch, stops = _uniform_stops(setup.model)
    order = sorted(range(BATCH), key=lambda r: -stops[r])  # the latest to stop first
    ideal = IdealHost(setup.model, setup.advance, {name: t[order] for name, t in batch.items()})
    ideal.schedule = _keys_of([sum(stop > step for stop in stops) for step in range(STEPS)])
    benchmark.group = "shrinking loop: 256 requests stopping uniformly over 64 steps"
    timed, tokens = _interleaved_loops(benchmark, setup, batch, ideal)
    ideal_tokens = ideal.run()[:, torch.argsort(torch.tensor(order)).cuda()]  # back in the caller's order
    info = benchmark.extra_info
    record_interleaved(
        info,
        timed,
        {
            "shrinking_over_today": ("shrinking", "today"),
            "shrinking_over_ideal_host": ("shrinking", "ideal_host"),
            "shrinking_over_fixed": ("shrinking", "fixed"),
            "fixed_over_today": ("fixed", "today"),
        },
    )
    before = dict(setup.managers["shrinking"].stats.device_loop_steps)
    setup.managers["shrinking"].run_loop(max_steps=STEPS, **batch)
    after = setup.managers["shrinking"].stats.device_loop_steps
    info["shrinking_steps_by_key"] = {k: after[k] - before.get(k, 0) for k in sorted(after)}
    info.update(_structure(setup.managers["shrinking"]))
    info["ideal_steps_by_key"] = {k: ideal.schedule.count(k) for k in SIZES}
    _record_tokens(info, tokens, ideal_tokens, exact_rows=64)
    for key in ("shrinking_over_today", "shrinking_over_ideal_host"):
        info[f"{key}_target"] = TARGETS[key]
    emit("uniform_stops", info)
    assert tokens["today"].shape == (STEPS, BATCH)
    assert (tokens["today"] != NO_TOKEN).sum(0).tolist() == stops  # each request ran to its stop


def _structure(manager: CUDAGraphManager[torch.Tensor]) -> dict[str, object]:
    """How the manager's shrinking loop chooses (``switch``, ``if_chain``) and whether nested."""
    loop = next(iter(manager._table.loops.values()))
    graph = getattr(loop._run, "graph", None)
    return {"loop_sizes": list(loop.sizes), "choice": loop.choice, "nested": getattr(graph, "nested", None)}


def _record_tokens(
    info: dict[str, object], tokens: Mapping[str, torch.Tensor], ideal: torch.Tensor, *, exact_rows: int
) -> None:
    """How many tokens each loop gives that today's loop does not (bf16 above ``exact_rows`` rows: the model's
    own run-to-run difference, split reductions, may move a token); the ideal host loop against shrinking."""
    today = tokens["today"]
    for name, got in tokens.items():
        info[f"{name}_tokens_differing_from_today"] = int((got != today).sum())
    info["ideal_host_tokens_differing_from_shrinking"] = int((ideal != tokens["shrinking"]).sum())
    info["tokens"] = int(today.numel())
    info["exact_below_rows"] = exact_rows


def test_bench_shrinking_loop_nothing_stops(benchmark: BenchmarkFixture) -> None:
    setup = _schedule()
    batch = _nothing_stops(setup.model)
    ideal = IdealHost(setup.model, setup.advance, batch)
    ideal.schedule = [BATCH] * STEPS
    benchmark.group = "shrinking loop: 256 requests, none stopping within 64 steps"
    timed, tokens = _interleaved_loops(benchmark, setup, batch, ideal)
    info = benchmark.extra_info
    record_interleaved(
        info,
        timed,
        {
            "nothing_stops_shrinking_over_today": ("shrinking", "today"),
            "nothing_stops_shrinking_over_ideal_host": ("shrinking", "ideal_host"),
            "nothing_stops_fixed_over_today": ("fixed", "today"),
        },
    )
    _record_tokens(info, tokens, ideal.run(), exact_rows=64)
    info["nothing_stops_shrinking_over_today_target"] = TARGETS["nothing_stops_shrinking_over_today"]
    emit("nothing_stops", info)
    assert all(int((t != NO_TOKEN).sum()) == STEPS * BATCH for t in tokens.values())


def test_bench_switch_launch_against_the_host_chosen_replay(benchmark: BenchmarkFixture) -> None:
    setup = _schedule()
    manager = setup.managers["today"]
    entries = {
        key: graph.entry
        for key, graph in manager._table.graphs.items()  # the manager's FULL graphs of the uniform keys
        if graph.entry is not None and key.uniform
    }
    live = torch.zeros((), dtype=torch.int32, device="cuda")
    replay = SwitchReplay.of(entries, live)
    by_size = {key.num_tokens: entry for key, entry in entries.items()}
    added: dict[int, float] = {}
    info = benchmark.extra_info
    benchmark.group = "shrinking loop: a launch through the device's choice"

    def measure() -> None:
        for count in LIVE_COUNTS:
            size = next(s for s in SIZES if s >= count)
            live.fill_(count)
            candidates: dict[str, Callable[[], object]] = {
                "switch": functools.partial(_times, replay.launch),
                "host": functools.partial(_times, by_size[size].replay),
            }
            timed = interleave(candidates, rounds=ROUNDS, calls_per_round=1)
            added[count] = (timed.median("switch") - timed.median("host")) / LAUNCHES * 1e6
            info[f"host_us_{count}"] = timed.median("host") / LAUNCHES * 1e6

    with torch.no_grad():
        benchmark.pedantic(measure, rounds=1, iterations=1)
    info["choice"] = replay.choice
    info["switch_added_us_by_live"] = {k: round(v, 2) for k, v in added.items()}
    info["switch_added_us"] = sorted(added.values())[len(added) // 2]
    info["switch_added_us_max"] = max(added.values())
    info["switch_added_us_target"] = TARGETS["switch_added_us"]
    emit("switch_launch", info)
    live.fill_(3)
    replay.launch()
    assert int(replay.chosen) == SIZES.index(8)


def _times(launch: Callable[[], object]) -> None:
    for _ in range(LAUNCHES):
        launch()


# ---------------------------------------------------------------------------
# The loop's floor at 1, 8, 64 requests
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class FloorSetup:
    model: PagedDecoder
    advance: PagedAdvance
    managers: Mapping[str, CUDAGraphManager[torch.Tensor]]


@functools.cache
def _floor_setup() -> FloorSetup:
    torch.manual_seed(0)
    config = DecoderConfig()
    model = PagedDecoder(config, layout=PagedLayout.for_config(config, page_size=128), device="cuda")
    advance = greedy_advance(model, eos_id=None, max_len=config.max_seq_len)
    loops = {
        "default": DecodeLoop(advance, max_steps=FLOOR_STEPS),
        "shrinking": DecodeLoop(advance, max_steps=FLOOR_STEPS, shrink=True),
        **{
            f"every_{k}": DecodeLoop(advance, max_steps=FLOOR_STEPS, policy=LoopPolicy(check_every=k))
            for k in FLOOR_CHECK_EVERY
        },
    }
    managers = {name: _manager(model, FLOOR_BATCHES, loop) for name, loop in loops.items()}
    with torch.no_grad():
        for manager in managers.values():
            manager.capture(progress=False)
    return FloorSetup(model, advance, managers)


@pytest.mark.parametrize("num_reqs", FLOOR_BATCHES)
def test_bench_run_loop_over_its_floor(benchmark: BenchmarkFixture, num_reqs: int) -> None:
    from tests.benchmarks.test_bench_decode_loop import Setup, _batch, _floor

    setup = _floor_setup()
    default = setup.managers["default"]
    shim = Setup(setup.model, setup.advance, FLOOR_STEPS, default, default)  # what _batch and _floor read
    batch = _batch(shim, num_reqs)
    floor = _floor(shim, batch)
    with torch.no_grad():
        expected = floor().clone()
        candidates: dict[str, Callable[[], object]] = {"floor": floor}
        for name, manager in setup.managers.items():
            result = manager.run_loop(max_steps=FLOOR_STEPS, **batch)
            assert result.kind is LoopKind.WHILE
            assert torch.equal(result.tokens, expected[:, :num_reqs]), name  # the floor's tokens
            candidates[name] = functools.partial(manager.run_loop, max_steps=FLOOR_STEPS, **batch)
        results: list[Interleaved] = []
        benchmark.group = "shrinking loop: run_loop over its floor"
        benchmark.pedantic(
            lambda: results.append(interleave(candidates, rounds=ROUNDS, calls_per_round=1)),
            rounds=1,
            iterations=1,
        )
    (timed,) = results
    info = benchmark.extra_info
    ratios = {f"{name}_over_floor": (name, "floor") for name in setup.managers}
    record_interleaved(info, timed, ratios, per_call=FLOOR_STEPS)
    info["num_reqs"] = num_reqs
    info["default_check_every"] = LoopPolicy().check_every
    info["default_over_floor_target"] = TARGETS["default_over_floor"]
    emit(f"loop_floor_{num_reqs}", info)
