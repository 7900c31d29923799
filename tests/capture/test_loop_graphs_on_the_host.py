"""The loop engine's driver layer on the CPU: the real graph builder over a fake driver, run on the host.

``driver_host`` records what ``CudaConditional`` builds (every node, every
argument of every kernel) and runs it with the kernels compiled for the
host: a plain loop checking stop every k steps, a shrinking loop nested and
flat, with a SWITCH node and with IF nodes (the driver refusing a nested
WHILE node, or SWITCH nodes: the builder's fallbacks in order), and a replay
chosen on the device, each against the eager or host loop. Skipped (with
the reason) where no C++20 compiler is found.
"""

from __future__ import annotations

import ctypes
import functools
import random
import types
from pathlib import Path
from typing import Final

import pytest
import torch

from cudagraph_capture import DeviceLoop, LoopPolicy
from cudagraph_capture._choice import build_switch_replay
from cudagraph_capture._conditional import CudaConditional, RecordedGraph
from cudagraph_capture._loop import LoopSpec, build_loop, shrink_loops
from tests.capture.driver_host import FakeDriver, RegisteringGraphs, host_layer
from tests.capture.kernel_host import build_host_kernels
from tests.capture.loop_fakes import FakeGraph
from tests.capture.test_loop import KEY, Decoder, assert_like, expected
from tests.capture.test_shrinking_loop import RowDecoder, key, rows_of

CPU: Final = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    built = build_host_kernels(Path(tmp_path_factory.mktemp("loop_graphs")))
    if isinstance(built, str):
        pytest.skip(built)
    return built


@pytest.fixture(autouse=True)
def _no_cuda_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch asks torch for the current CUDA stream's handle: the driver here takes any."""
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0)
    )


@pytest.mark.parametrize("check_every", [1, 3, 4])
@pytest.mark.parametrize(("stop_at", "limit"), [(1, 12), (5, 12), (None, 12), (None, 7), (9, 10)])
def test_a_built_loop_checks_every_k_steps_as_the_eager_loop_runs(
    kernels: ctypes.CDLL, check_every: int, stop_at: int | None, limit: int
) -> None:
    driver = FakeDriver(kernels)
    decoder = Decoder(CPU)
    spec = LoopSpec.checked(decoder.body, decoder.stop, 12, LoopPolicy(check_every=check_every), KEY)
    loop = build_loop(spec, RegisteringGraphs(driver), lambda device: host_layer(driver))
    steps, state = expected(decoder, decoder.threshold_for(stop_at), limit)
    loop.launch(limit)
    assert_like(loop, decoder, steps, state)


def _layer_of(driver: FakeDriver, device: int) -> CudaConditional:
    return host_layer(driver)


def _loops(decoder: RowDecoder, sizes: list[int], every: int, driver: FakeDriver) -> list[DeviceLoop]:
    loops: list[DeviceLoop] = []
    for size in sorted(sizes, reverse=True):
        policy = LoopPolicy(check_every=every)
        spec = LoopSpec.checked(decoder.body(size), decoder.stop, decoder.history.shape[0], policy, key(size))
        graphs = RegisteringGraphs(driver)
        cells = loops[0]._cells if loops else None
        loops.append(build_loop(spec, graphs, lambda device: host_layer(driver), cells))
    return loops


#: What the fake driver refuses, and what the builder then builds: (choice, nested).
REFUSALS: Final = {
    "nothing": ((), ("switch", True)),
    "nested": (("nested",), ("switch", False)),
    "switch": (("SWITCH",), ("if_chain", True)),
    "both": (("SWITCH", "nested"), ("if_chain", False)),
}


@pytest.mark.parametrize("refused", list(REFUSALS))
def test_a_built_shrinking_loop_gives_the_host_loops_history(kernels: ctypes.CDLL, refused: str) -> None:
    refuse, (choice, nested) = REFUSALS[refused]
    rng = random.Random(len(refused))
    for trial in range(8):
        driver = FakeDriver(kernels, refuse)
        rows = rng.choice([8, 40])
        sizes = sorted({1, 2, 8, rows, rng.randint(1, rows)})
        decoder = RowDecoder(CPU, rows=rows, max_steps=20)
        loops = _loops(decoder, sizes, rng.choice([1, 3]), driver)
        loop = shrink_loops(loops, rows_of(decoder), functools.partial(_layer_of, driver))
        assert loop.choice == choice
        assert getattr(getattr(loop._run, "graph", None), "nested", None) is nested
        n = rng.randint(1, rows)
        lefts = [rng.randint(0, 24) for _ in range(n)]
        limit = rng.randint(1, 20)
        decoder.refill(lefts, seed=trial)
        steps, history = decoder.host_loop(limit)
        decoder.refill(lefts, seed=trial)
        loop.launch(limit)
        taken, by_size = loop.read_steps()
        assert taken == steps, (trial, rows, sizes, lefts, limit)
        assert torch.equal(decoder.history[:taken, :n], history[:, :n]), (trial, rows, sizes, lefts, limit)
        assert sum(by_size.values()) == taken


@pytest.mark.parametrize("switch", [True, False], ids=["switch", "if_chain"])
def test_a_built_replay_chooses_the_smallest_size_holding_the_count(
    kernels: ctypes.CDLL, switch: bool
) -> None:
    driver = FakeDriver(kernels)
    ran: list[int] = []
    graphs: dict[int, RecordedGraph] = {}
    for size in (1, 2, 4, 8):
        graph = FakeGraph(functools.partial(ran.append, size))
        graphs[size] = graph
        driver.bodies[graph.raw_cuda_graph()] = graph
    live = torch.zeros((), dtype=torch.int32)
    replay = build_switch_replay(graphs, live, lambda device: host_layer(driver, switch=switch))
    assert replay.choice == ("switch" if switch else "if_chain")
    cases: list[tuple[int, int | None]] = [(0, 1), (2, 2), (3, 4), (8, 8), (9, None)]
    for count, chosen in cases:
        ran.clear()
        live.fill_(count)
        replay.launch()
        assert ran == ([] if chosen is None else [chosen])
        assert int(replay.chosen) == (-1 if chosen is None else (1, 2, 4, 8).index(chosen))
