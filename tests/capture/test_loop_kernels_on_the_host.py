"""The loop engine's kernels themselves, run on the CPU: compiled for the host over an emulated CUDA block.

``kernel_host`` compiles ``_kernels.SOURCE`` with g++ (a thread per CUDA
thread) and builds loops whose launches run those kernels in the driver
graph's order: the step counting and checks of a loop that checks stop every
k steps, a shrinking loop's partition, choice (SWITCH and IF) and restore,
and the replay's choice. Each against the host loop, or the rule. Skipped
(with the reason) where no C++20 compiler is found.
"""

from __future__ import annotations

import ctypes
import functools
import random
from pathlib import Path
from typing import Final

import pytest
import torch

from cudagraph_capture import DeviceLoop, LoopPolicy
from cudagraph_capture._choice import build_switch_replay
from cudagraph_capture._conditional import RecordedGraph
from cudagraph_capture._loop import LoopSpec, build_loop, shrink_loops
from tests.capture.kernel_host import HostConditional, HostLoop, build_host_kernels
from tests.capture.loop_fakes import FakeGraph, FakeGraphs
from tests.capture.test_loop import KEY, Decoder, assert_like, expected
from tests.capture.test_shrinking_loop import RowDecoder, key, rows_of

CPU: Final = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    built = build_host_kernels(Path(tmp_path_factory.mktemp("loop_kernels")))
    if isinstance(built, str):
        pytest.skip(built)
    return built


@pytest.mark.parametrize("check_every", [1, 3, 4])
@pytest.mark.parametrize(("stop_at", "limit"), [(1, 12), (5, 12), (None, 12), (None, 7), (6, 6), (9, 10)])
def test_the_kernels_check_every_k_steps_as_the_eager_loop_runs(
    kernels: ctypes.CDLL, check_every: int, stop_at: int | None, limit: int
) -> None:
    decoder = Decoder(CPU)
    spec = LoopSpec.checked(decoder.body, decoder.stop, 12, LoopPolicy(check_every=check_every), KEY)
    loop = build_loop(spec, FakeGraphs(), HostConditional(kernels))
    steps, state = expected(decoder, decoder.threshold_for(stop_at), limit)
    loop.launch(limit)
    assert_like(loop, decoder, steps, state)


def _loops(
    decoder: RowDecoder, sizes: list[int], every: int, conditional: HostConditional
) -> list[DeviceLoop]:
    loops: list[DeviceLoop] = []
    for size in sorted(sizes, reverse=True):
        spec = LoopSpec.checked(
            decoder.body(size),
            decoder.stop,
            decoder.history.shape[0],
            LoopPolicy(check_every=every),
            key(size),
        )
        loops.append(build_loop(spec, FakeGraphs(), conditional, loops[0]._cells if loops else None))
    return loops


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("switch", [True, False], ids=["switch", "if_chain"])
def test_the_kernels_shrink_as_the_host_loop_runs(kernels: ctypes.CDLL, switch: bool, nested: bool) -> None:
    """Random batches, stops, limits and k over rows of several dtypes and widths: the host loop's history."""
    rng = random.Random(53 + switch + 2 * nested)
    conditional = HostConditional(kernels, switch=switch, nested=nested)
    for trial in range(12):
        rows = rng.choice([8, 40, 64])
        sizes = sorted({1, 2, 8, rows, rng.randint(1, rows)})
        decoder = RowDecoder(CPU, rows=rows, max_steps=24)
        loop = shrink_loops(
            _loops(decoder, sizes, rng.choice([1, 2, 4]), conditional), rows_of(decoder), conditional
        )
        n = rng.randint(1, rows)
        lefts = [rng.randint(0, 28) for _ in range(n)]
        limit = rng.randint(1, 24)
        decoder.refill(lefts, seed=trial)
        steps, history = decoder.host_loop(limit)
        decoder.refill(lefts, seed=trial)
        loop.launch(limit)
        taken, by_size = loop.read_steps()
        assert taken == steps, (trial, rows, sizes, lefts, limit)
        assert torch.equal(decoder.history[:taken, :n], history[:, :n]), (trial, rows, sizes, lefts, limit)
        assert sum(by_size.values()) == taken


def test_the_kernels_keep_more_rows_than_a_block_has_threads(kernels: ctypes.CDLL) -> None:
    """1,500 rows on 1,024 threads: each thread partitions two rows."""
    conditional = HostConditional(kernels)
    decoder = RowDecoder(CPU, rows=1500, max_steps=6)
    loop = shrink_loops(_loops(decoder, [1, 64, 1024, 1500], 2, conditional), rows_of(decoder), conditional)
    lefts = [(r * 7) % 8 for r in range(1400)]
    decoder.refill(lefts, seed=1)
    steps, history = decoder.host_loop(6)
    decoder.refill(lefts, seed=1)
    loop.launch(6)
    assert loop.read_steps()[0] == steps
    assert torch.equal(decoder.history[:steps, :1400], history[:, :1400])


@pytest.mark.parametrize("switch", [True, False], ids=["switch", "if_chain"])
def test_the_replay_kernel_chooses_the_smallest_size_holding_the_count(
    kernels: ctypes.CDLL, switch: bool
) -> None:
    ran: list[int] = []
    graphs: dict[int, RecordedGraph] = {s: FakeGraph(functools.partial(ran.append, s)) for s in (1, 2, 4, 8)}
    for dtype in (torch.int32, torch.int64):
        live = torch.zeros((), dtype=dtype)
        replay = build_switch_replay(graphs, live, HostConditional(kernels, switch=switch))
        for count, size in [(0, 1), (1, 1), (3, 4), (8, 8), (9, None)]:
            ran.clear()
            live.fill_(count)
            replay.launch()
            assert ran == ([] if size is None else [size])
            assert int(replay.chosen) == (-1 if size is None else (1, 2, 4, 8).index(size))


@pytest.mark.parametrize(("nested", "choices"), [(True, 4), (False, 8)], ids=["nested", "flat"])
def test_a_nested_loop_chooses_only_where_its_body_changes(
    kernels: ctypes.CDLL, nested: bool, choices: int
) -> None:
    """Eight rows ending after 1..8 steps, checked every step: bodies 8 (4 steps), 4, 4, 2, 1."""
    conditional = HostConditional(kernels, nested=nested)
    decoder = RowDecoder(CPU, rows=8, max_steps=12)
    loop = shrink_loops(_loops(decoder, [1, 2, 4, 8], 1, conditional), rows_of(decoder), conditional)
    decoder.refill([5, 1, 8, 3, 6, 2, 7, 4], seed=2)
    steps, history = decoder.host_loop(12)
    decoder.refill([5, 1, 8, 3, 6, 2, 7, 4], seed=2)
    loop.launch()
    assert loop.read_steps() == (steps, {8: 4, 4: 2, 2: 1, 1: 1})
    assert torch.equal(decoder.history[:steps], history)
    graph = getattr(loop._run, "graph", None)
    assert isinstance(graph, HostLoop)
    assert graph.choices == choices
