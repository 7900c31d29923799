"""Shrinking loops (``DeviceLoop.shrinking``) and replays chosen on the device (``SwitchReplay``).

A toy of independent rows (``RowDecoder``): each live row steps its state,
writes a token at its history row and counts down to its end; a finished row
writes -1 (the history's ``fill``). The host loop runs the largest body over
every row, finished ones masked; the shrinking loop must give the same
history and steps while it moves its live rows in front and runs smaller
bodies. CPU: the loop's bookkeeping with the device layer faked (the
kernels' rules in Python, ``loop_fakes``), the argument checks, the refusals.
GPU: the kernels, SWITCH and IF nodes alike, against the host loop bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Final

import pytest
import torch

from cudagraph_capture import CaptureError, DeviceLoop, LoopKind, LoopPolicy, graph_engine
from cudagraph_capture._choice import SwitchReplay, build_switch_replay
from cudagraph_capture._conditional import (
    CudaConditional,
    CudaWhileGraph,
    LoopFallback,
    LoopPlan,
    RecordedGraph,
    load_conditional,
)
from cudagraph_capture._loop import LoopSpec, build_loop, shrink_loops
from cudagraph_capture.lowlevel import LoopRows
from cudagraph_dispatch import BatchDescriptor, CUDAGraphMode, set_forward_context
from tests.capture.helpers import cuda
from tests.capture.loop_fakes import FakeConditional, FakeGraph, FakeGraphs, FakeLoop

CPU: Final = torch.device("cpu")
ROWS: Final = 8
SIZES: Final = (1, 2, 4, 8)
MAX_STEPS: Final = 12
FILL: Final = -1
gpu: Final = pytest.mark.gpu


class RowDecoder:
    """Rows stepping on their own: ``x = (x * mult + 7) % 997`` while ``left > 0`` (elementwise only).

    Buffers of several shapes and dtypes ride along (``y`` float32 ``[R, 33]``,
    ``z`` uint8 ``[R, 3]``, ``k`` int32 ``[R]``), each feeding the token, so
    every copy unit of the partition is exercised.
    """

    def __init__(self, device: torch.device, rows: int = ROWS, max_steps: int = MAX_STEPS) -> None:
        self.device = device
        self.x = torch.zeros(rows, dtype=torch.int64, device=device)
        self.mult = torch.ones(rows, dtype=torch.int64, device=device)
        self.left = torch.zeros(rows, dtype=torch.int64, device=device)
        self.y = torch.zeros(rows, 33, device=device)
        self.z = torch.zeros(rows, 3, dtype=torch.uint8, device=device)
        self.k = torch.zeros(rows, dtype=torch.int32, device=device)
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        self.stop = torch.zeros((), dtype=torch.bool, device=device)
        self.history = torch.zeros(max_steps, rows, dtype=torch.int64, device=device)

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        return (self.x, self.mult, self.left, self.y, self.z, self.k)

    def body(self, size: int) -> Callable[[torch.Tensor], None]:
        def step(steps: torch.Tensor) -> None:
            live = self.active[:size]  # [S] bool
            x, y, z, k = self.x[:size], self.y[:size], self.z[:size], self.k[:size]
            new = (x * self.mult[:size] + 7) % 997
            x.copy_(torch.where(live, new, x))
            y.copy_(torch.where(live[:, None], y * 0.5 + 1.0, y))
            z.add_(live[:, None].to(torch.uint8))
            k.add_(live.int() * 3)
            token = new + (y[:, 0] > 1.5).long() + z[:, 1].long() * 1000 + k.long() * 100_000
            self.history[:, :size].index_copy_(0, steps.view(1), torch.where(live, token, FILL)[None])
            left = self.left[:size]
            left.sub_(live.long())
            going = live & (left > 0)
            live.copy_(going)
            torch.logical_not(going.any(), out=self.stop)

        return step

    def refill(self, lefts: Sequence[int], seed: int) -> None:
        """Rows ``[0, len(lefts))`` live, ending after ``lefts[r]`` steps (0: never); the rest inactive."""
        g = torch.Generator().manual_seed(seed)
        n, rows = len(lefts), self.x.shape[0]
        self.x.copy_(torch.randint(0, 997, (rows,), generator=g))
        self.mult.copy_(torch.randint(2, 50, (rows,), generator=g))
        self.left.copy_(torch.tensor([*(v if v else 10**6 for v in lefts), *[1] * (rows - n)]))
        self.y.copy_(torch.rand(rows, 33, generator=g))
        self.z.zero_()
        self.k.zero_()
        self.active.copy_(torch.arange(rows) < n)
        self.stop.zero_()
        self.history.fill_(123)  # stale: every row up to the steps taken must be written or filled

    def host_loop(self, limit: int) -> tuple[int, torch.Tensor]:
        """The largest body over every row, eagerly, the stop read back per step: steps, history."""
        body = self.body(self.x.shape[0])
        steps = torch.zeros((), dtype=torch.int64, device=self.device)
        for taken in range(1, limit + 1):
            body(steps)
            steps += 1
            if bool(self.stop):
                return taken, self.history[:taken].clone()
        return limit, self.history[:limit].clone()


def key(size: int) -> BatchDescriptor:
    return BatchDescriptor(size, size, True)


def fake_shrinking(
    decoder: RowDecoder,
    conditional: FakeConditional,
    *,
    sizes: Sequence[int] = SIZES,
    check_every: int = 4,
) -> DeviceLoop:
    loops = fake_loops(decoder, conditional, sizes=sizes, check_every=check_every)
    return shrink_loops(loops, rows_of(decoder), conditional)


def fake_loops(
    decoder: RowDecoder,
    conditional: FakeConditional,
    *,
    sizes: Sequence[int] = SIZES,
    check_every: int = 4,
    first: DeviceLoop | None = None,
) -> list[DeviceLoop]:
    loops: list[DeviceLoop] = []
    for size in sorted(sizes, reverse=True):
        policy = LoopPolicy(check_every=check_every)
        spec = LoopSpec.checked(decoder.body(size), decoder.stop, MAX_STEPS, policy, key(size))
        shared = first if first is not None else loops[0] if loops else None
        cells = None if shared is None else shared._cells
        loops.append(build_loop(spec, FakeGraphs(), conditional, cells))
    return loops


def rows_of(decoder: RowDecoder, **changes: object) -> LoopRows:
    rows = LoopRows(decoder.active, decoder.buffers, decoder.history, FILL)
    return dataclasses.replace(rows, **changes)  # type: ignore[arg-type]  # the checks under test


#: (steps each live row takes before it ends; 0: never), the launch's limit.
CASES: Final = (
    ([3, 1, 4, 1, 5, 9, 2, 6], MAX_STEPS),  # all finish, in a shuffled order
    ([0, 2, 0, 2, 2, 2, 2, 2], MAX_STEPS),  # two never finish: down to 2 rows, then the limit
    ([5, 5, 5], 7),  # three rows on the body of four, ending together
    ([0], 5),  # one row, the limit
    ([1, 1, 1, 1, 1, 1, 1, 1], MAX_STEPS),  # all at the first step
    ([2, 7, 7, 1, 12, 3], 10),  # the limit before the last
    ([4, 4, 4, 4, 4, 4, 4, 3], 1),  # one step only
)


# ---------------------------------------------------------------------------
# CPU: the bookkeeping, with the device layer faked
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("check_every", [1, 3, 4])
@pytest.mark.parametrize("switch", [True, False], ids=["switch", "if_chain"])
@pytest.mark.parametrize(("lefts", "limit"), CASES)
def test_a_shrinking_loop_gives_the_host_loops_history(
    lefts: list[int], limit: int, switch: bool, check_every: int, nested: bool
) -> None:
    decoder = RowDecoder(CPU)
    decoder.refill(lefts, seed=1)
    steps, history = decoder.host_loop(limit)
    conditional = FakeConditional(switch=switch, nested=nested)
    loop = fake_shrinking(decoder, conditional, check_every=check_every)
    assert (loop.kind, loop.sizes, loop.choice) == (LoopKind.WHILE, SIZES, "switch" if switch else "if_chain")
    decoder.refill(lefts, seed=1)
    loop.launch(limit)
    taken, by_size = loop.read_steps()
    assert taken == steps
    n = len(lefts)  # the rows past the first body's never ran: only the real rows are compared
    assert torch.equal(decoder.history[:taken, :n], history[:, :n])
    assert sum(by_size.values()) == taken
    assert max(by_size) == min(s for s in SIZES if s >= len(lefts))  # it starts on the batch's body


def test_a_shrinking_loop_runs_the_smallest_body_holding_its_live_rows() -> None:
    """Eight rows ending after 1, 2, ..., 8 steps, checked every step: the bodies of 8, 8, 8, 4, 4, 2, 1."""
    decoder = RowDecoder(CPU)
    conditional = FakeConditional()
    loop = fake_shrinking(decoder, conditional, check_every=1)
    lefts = [5, 1, 8, 3, 6, 2, 7, 4]
    decoder.refill(lefts, seed=2)
    loop.launch()
    taken, by_size = loop.read_steps()
    assert taken == 8
    # Live rows before each step: 8, 7, 6, 5, 4, 3, 2, 1 -> bodies 8, 8, 8, 8, 4, 4, 2, 1.
    assert by_size == {8: 4, 4: 2, 2: 1, 1: 1}


@pytest.mark.parametrize(("nested", "choices"), [(True, 4), (False, 8)], ids=["nested", "flat"])
def test_a_nested_loop_chooses_only_where_its_body_changes(nested: bool, choices: int) -> None:
    decoder = RowDecoder(CPU)
    conditional = FakeConditional(nested=nested)
    loop = fake_shrinking(decoder, conditional, check_every=1)
    decoder.refill([5, 1, 8, 3, 6, 2, 7, 4], seed=2)
    loop.launch()
    assert loop.read_steps() == (8, {8: 4, 4: 2, 2: 1, 1: 1})
    (built,) = [b for b in conditional.built if isinstance(b, FakeLoop) and b.plan.rows is not None]
    assert built.choices == choices


def test_a_shrinking_loop_over_a_shrinking_loop_and_more_bodies() -> None:
    """A loop rebuilt from a shrinking loop and the loops of the sizes it lacked (a later capture)."""
    decoder = RowDecoder(CPU)
    conditional = FakeConditional()
    small = fake_loops(decoder, conditional, sizes=(1, 2))
    first = shrink_loops(small, rows_of(decoder), conditional)
    more = fake_loops(decoder, conditional, sizes=(4, 8), first=small[0])
    loop = shrink_loops([first, *more], rows_of(decoder), conditional)
    assert loop.sizes == SIZES
    lefts = [3, 1, 4, 1, 5, 9, 2, 6]
    decoder.refill(lefts, seed=3)
    steps, history = decoder.host_loop(MAX_STEPS)
    decoder.refill(lefts, seed=3)
    loop.launch()
    assert loop.read_steps()[0] == steps
    assert torch.equal(decoder.history[:steps], history)  # eight rows: the first body is the largest


@pytest.mark.parametrize(
    ("conditional", "choice"),
    [
        (FakeConditional(switch=False), "if_chain"),
        (FakeConditional(refuse_switch=True), "if_chain"),
        (FakeConditional(), "switch"),
    ],
    ids=["no_switch", "switch_refused", "switch"],
)
def test_a_choice_is_a_switch_node_or_if_nodes(conditional: FakeConditional, choice: str) -> None:
    decoder = RowDecoder(CPU)
    loop = fake_shrinking(decoder, conditional)
    assert loop.choice == choice
    (built,) = [b for b in conditional.built if isinstance(b, FakeLoop) and b.plan.rows is not None]
    assert built.choice == choice


def test_a_shrinking_loop_that_cannot_be_built_is_refused_by_name() -> None:
    decoder = RowDecoder(CPU)
    loops = fake_loops(decoder, FakeConditional())
    with pytest.raises(
        CaptureError, match=r"DeviceLoop\.shrinking: neither a SWITCH node nor IF nodes"
    ) as caught:
        shrink_loops(loops, rows_of(decoder), FakeConditional(refuse_build=True))
    assert caught.value.descriptor == key(8)
    # The loops it was given still run, each on its own body.
    decoder.refill([2, 3], seed=4)
    steps, history = decoder.host_loop(MAX_STEPS)
    decoder.refill([2, 3], seed=4)
    loops[0].launch()
    assert loops[0].read_steps() == (steps, {})
    assert torch.equal(decoder.history[:steps], history)


def _bad_loops(decoder: RowDecoder) -> dict[str, tuple[object, str]]:
    """Each bad ``loops`` argument and what its error names."""
    conditional = FakeConditional()
    good = fake_loops(decoder, conditional, sizes=(1, 2))
    other_cells = fake_loops(decoder, conditional, sizes=(4,))
    unrolled_spec = LoopSpec.checked(
        decoder.body(4), decoder.stop, MAX_STEPS, LoopPolicy(LoopKind.UNROLLED), key(4)
    )
    unrolled = build_loop(unrolled_spec, FakeGraphs(), conditional, good[0]._cells)
    mixed_spec = LoopSpec.checked(
        decoder.body(4), decoder.stop, MAX_STEPS, LoopPolicy(), BatchDescriptor(4, 4)
    )
    mixed = build_loop(mixed_spec, FakeGraphs(), conditional, good[0]._cells)
    twice = fake_loops(decoder, conditional, sizes=(2,), first=good[0])
    return {
        "one": (good[:1], r"loops: expected two or more DeviceLoops"),
        "not_loops": ([good[0], "loop"], r"loops: expected two or more DeviceLoops"),
        "unrolled": ([*good, unrolled], r"loops\[2\]: a UNROLLED loop"),
        "other_cells": ([*good, *other_cells], r"loops\[2\]: not captured on the cells"),
        "other_class": ([*good, mixed], r"loops\[2\]: BatchDescriptor\(num_tokens=4.*is not of the class"),
        "twice": ([*good, *twice], r"loops\[2\]: a second body of 2 rows"),
    }


@pytest.mark.parametrize("case", ["one", "not_loops", "unrolled", "other_cells", "other_class", "twice"])
def test_bad_loops_are_named(case: str) -> None:
    decoder = RowDecoder(CPU)
    loops, match = _bad_loops(decoder)[case]
    with pytest.raises(ValueError, match=match):
        shrink_loops(loops, rows_of(decoder), FakeConditional())  # type: ignore[arg-type]  # the checks


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"active": torch.zeros(ROWS, dtype=torch.int32)}, r"rows\.active: expected a torch\.bool"),
        ({"active": torch.zeros(4, dtype=torch.bool)}, r"rows\.active: expected at least 8 rows"),
        ({"buffers": (torch.zeros(4),)}, r"rows\.buffers\[0\]: expected at least 8 rows"),
        (
            {"buffers": (torch.zeros(3, ROWS).T,)},
            r"rows\.buffers\[0\]: expected at least 8 rows, each contiguous",
        ),
        ({"buffers": (torch.zeros(()),)}, r"rows\.buffers\[0\]: expected a tensor with a row dimension"),
        ({"buffers": torch.zeros(ROWS)}, r"rows\.buffers: expected a sequence of tensors"),
        ({"history": torch.zeros(MAX_STEPS, ROWS)}, r"rows\.history: expected a torch\.int64"),
        (
            {"history": torch.zeros(MAX_STEPS, 4, dtype=torch.int64)},
            r"rows\.history: expected \[max_steps, >= 8\]",
        ),
        ({"history": torch.zeros(ROWS, MAX_STEPS, dtype=torch.int64).T}, r"rows\.history: expected"),
        ({"fill": 1.5}, r"rows\.fill: expected an integer"),
        ({"fill": True}, r"rows\.fill: expected an integer"),
    ],
)
def test_bad_rows_are_named(changes: dict[str, object], match: str) -> None:
    decoder = RowDecoder(CPU)
    conditional = FakeConditional()
    loops = fake_loops(decoder, conditional)
    with pytest.raises(ValueError, match=match):
        shrink_loops(loops, rows_of(decoder, **changes), conditional)
    with pytest.raises(ValueError, match=r"rows: expected a LoopRows"):
        shrink_loops(loops, "rows", conditional)  # type: ignore[arg-type]  # the check under test


def test_shared_cells_must_be_a_loop_of_the_same_flag_and_steps() -> None:
    decoder = RowDecoder(CPU)
    with pytest.raises(ValueError, match=r"shared_with: expected a DeviceLoop or None"):
        DeviceLoop.capture(decoder.body(1), stop=decoder.stop, max_steps=4, shared_with="loop")  # type: ignore[arg-type]
    conditional = FakeConditional()
    (loop,) = fake_loops(decoder, conditional, sizes=(1,))
    with pytest.raises(ValueError, match=r"shared_with: a loop shares its cells with loops of the same stop"):
        DeviceLoop.capture(decoder.body(1), stop=decoder.stop, max_steps=5, shared_with=loop)


# ---------------------------------------------------------------------------
# CPU: SwitchReplay's choice and checks
# ---------------------------------------------------------------------------


def test_a_replay_chosen_on_the_device_replays_the_smallest_holding_the_count() -> None:
    ran: list[int] = []
    graphs: dict[int, RecordedGraph] = {
        size: FakeGraph(functools.partial(ran.append, size)) for size in (8, 1, 4, 2)
    }
    live = torch.zeros((), dtype=torch.int32)
    replay = build_switch_replay(graphs, live, FakeConditional())
    assert (replay.sizes, replay.choice) == ((1, 2, 4, 8), "switch")
    for count, size in [(0, 1), (1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, None)]:
        ran.clear()
        live.fill_(count)
        replay.launch()
        assert ran == ([] if size is None else [size])
        assert int(replay.chosen) == (-1 if size is None else (1, 2, 4, 8).index(size))
    assert build_switch_replay(graphs, live, FakeConditional(switch=False)).choice == "if_chain"


def test_a_replay_that_cannot_be_chosen_on_the_device_is_refused_by_name() -> None:
    graphs = {1: FakeGraph(lambda: None), 2: FakeGraph(lambda: None)}
    live = torch.zeros((), dtype=torch.int64)
    for conditional in (FakeConditional(LoopFallback.NO_BINDINGS), FakeConditional(refuse_build=True)):
        with pytest.raises(
            CaptureError, match=r"SwitchReplay: neither a SWITCH node nor IF nodes can be built"
        ):
            build_switch_replay(graphs, live, conditional)


@pytest.mark.parametrize(
    ("entries", "live", "match"),
    [
        ({}, torch.zeros((), dtype=torch.int32), r"entries: expected a mapping"),
        ([1, 2], torch.zeros((), dtype=torch.int32), r"entries: expected a mapping"),
        ({4: object()}, torch.zeros((), dtype=torch.int32), r"entries: expected BatchDescriptor keys"),
        (
            {BatchDescriptor(4, 4, True): object(), BatchDescriptor(2): object()},
            torch.zeros((), dtype=torch.int32),
            r"entries: BatchDescriptor\(num_tokens=2.*is not of the class",
        ),
        (
            {BatchDescriptor(4): object()},
            torch.zeros((), dtype=torch.int32),
            r"entries\[.*\]: expected an entry",
        ),
        ({BatchDescriptor(4): object()}, torch.zeros(2, dtype=torch.int32), r"live: expected a one-element"),
        (
            {BatchDescriptor(4): object()},
            torch.zeros((), dtype=torch.float32),
            r"live: expected a one-element",
        ),
        ({BatchDescriptor(4): object()}, 4, r"live: expected a one-element"),
    ],
)
def test_bad_switch_replay_arguments_are_named(entries: object, live: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SwitchReplay.of(entries, live)  # type: ignore[arg-type]  # the checks under test


# ---------------------------------------------------------------------------
# GPU: the kernels, against the host loop
# ---------------------------------------------------------------------------


def if_layer(device: int) -> CudaConditional:
    """The device's layer, as if its driver had no SWITCH node: IF nodes."""
    layer = load_conditional(device)
    return CudaConditional(layer._driver, layer._add_node, layer._kernels, device, switch=False)


class _FlatConditional(CudaConditional):
    """The device's layer building flat shrinking loops only (a choice every iteration)."""

    def build(self, plan: LoopPlan) -> CudaWhileGraph:
        if plan.rows is None:
            return super().build(plan)
        return self._first_built(lambda nodes: nodes.loop(plan), nested=False)


def layer_of(choice: str, structure: str) -> Callable[[int], CudaConditional]:
    """The device's layer choosing by ``choice`` (SWITCH or IF nodes), nested or flat."""

    def load(device: int) -> CudaConditional:
        layer = load_conditional(device)
        kind = _FlatConditional if structure == "flat" else CudaConditional
        return kind(layer._driver, layer._add_node, layer._kernels, device, switch=choice == "switch")

    return load


def gpu_loops(decoder: RowDecoder, sizes: Sequence[int], check_every: int) -> list[DeviceLoop]:
    loops: list[DeviceLoop] = []
    for size in sorted(sizes, reverse=True):
        loops.append(
            DeviceLoop.capture(
                decoder.body(size),
                stop=decoder.stop,
                max_steps=decoder.history.shape[0],
                policy=LoopPolicy(check_every=check_every),
                descriptor=key(size),
                shared_with=loops[0] if loops else None,
            )
        )
        assert loops[-1].kind is LoopKind.WHILE, loops[-1].fallback_reason
    return loops


@gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("check_every", [1, 4])
@pytest.mark.parametrize("structure", ["nested", "flat"])
@pytest.mark.parametrize("choice", ["switch", "if_chain"])
def test_gpu_shrinking_loop_equals_the_host_loop(choice: str, structure: str, check_every: int) -> None:
    rows = 64
    decoder = RowDecoder(cuda(), rows=rows, max_steps=40)
    sizes = (1, 2, 4, 8, 16, 32, 64)
    if choice == "switch" and not load_conditional(decoder.device.index or 0).switch:
        pytest.skip("the driver or the bindings have no SWITCH node here")
    loops = gpu_loops(decoder, sizes, check_every)
    loop = shrink_loops(loops, rows_of(decoder), layer_of(choice, structure))
    assert loop.choice == choice
    # Where the driver refuses a WHILE node inside a SWITCH inside a WHILE, the loop is flat (and says so).
    nested = getattr(loop._run, "graph", None)
    print(f"{choice} {structure}: built nested={getattr(nested, 'nested', None)}")
    generator = torch.Generator().manual_seed(5)
    for round_ in range(12):
        n = int(torch.randint(1, rows + 1, (), generator=generator))
        lefts = torch.randint(0, 45, (n,), generator=generator).tolist()  # 0: never; some past the limit
        limit = int(torch.randint(1, 41, (), generator=generator))
        decoder.refill(lefts, seed=round_)
        steps, history = decoder.host_loop(limit)
        decoder.refill(lefts, seed=round_)
        loop.launch(limit)
        taken, by_size = loop.read_steps()
        assert taken == steps, (round_, n, limit)
        assert torch.equal(decoder.history[:taken, :n], history[:, :n]), (round_, n, limit)
        assert sum(by_size.values()) == taken
        assert max(by_size) == min(s for s in sizes if s >= n)


@gpu
@pytest.mark.usefixtures("clean_capture_state")
def test_gpu_shrinking_loop_drops_rows_and_reads_only_the_last_body() -> None:
    """All but row 5 end at the first step: the loop must run the body of one from the next check on."""
    decoder = RowDecoder(cuda(), rows=8, max_steps=16)
    loop = shrink_loops(gpu_loops(decoder, SIZES, 1), rows_of(decoder), load_conditional)
    lefts = [1, 1, 1, 1, 1, 0, 1, 1]
    decoder.refill(lefts, seed=9)
    _, history = decoder.host_loop(16)
    decoder.refill(lefts, seed=9)
    loop.launch()
    taken, by_size = loop.read_steps()
    assert (taken, by_size) == (16, {8: 1, 1: 15})
    assert torch.equal(decoder.history[:taken], history)


def _graph_entries(sizes: Sequence[int], x: torch.Tensor) -> dict[BatchDescriptor, object]:
    """FULL graphs of ``x[:size] = x[:size] * 3 + size``, one per size, by ``graph_engine(FULL)``."""

    def work(x: torch.Tensor) -> torch.Tensor:
        x.mul_(3).add_(x.shape[0])
        return x

    engine = graph_engine(work, CUDAGraphMode.FULL)
    entries: dict[BatchDescriptor, object] = {}
    for size in sorted(sizes, reverse=True):
        descriptor = BatchDescriptor(size)
        with set_forward_context(CUDAGraphMode.FULL, descriptor):
            engine.warm_up(descriptor, {"x": x[:size]})
            entries[descriptor] = engine.record(descriptor, {"x": x[:size]})
    return entries


@gpu
@pytest.mark.usefixtures("clean_capture_state")
@pytest.mark.parametrize("choice", ["switch", "if_chain"])
def test_gpu_switch_replay_equals_the_host_chosen_replay(choice: str) -> None:
    x = torch.zeros(8, dtype=torch.int64, device=cuda())
    entries = _graph_entries(SIZES, x)
    live = torch.zeros((), dtype=torch.int32, device=x.device)
    if choice == "switch":
        if not load_conditional(x.device.index or 0).switch:
            pytest.skip("the driver or the bindings have no SWITCH node here")
        replay = SwitchReplay.of(entries, live)
    else:
        from cudagraph_capture._choice import _graphs_of

        replay = build_switch_replay(_graphs_of(entries), live, if_layer)
    assert replay.choice == choice
    start = torch.arange(8, device=x.device)
    for count in range(10):
        x.copy_(start)
        live.fill_(count)
        replay.launch()
        got, chosen = x.clone(), int(replay.chosen)
        size = next((s for s in SIZES if s >= count), None)
        want = start.clone()
        if size is not None:
            want[:size] = want[:size] * 3 + size
        assert torch.equal(got, want), count
        assert chosen == (-1 if size is None else SIZES.index(size))
