"""Fakes of the loop engine's device layers, for CPU tests: graphs that run their work eagerly, and the
kernels' rules in Python (a loop's steps and checks, a shrinking loop's partition, choice and history).

``FakeConditional`` builds what ``CudaConditional`` builds, as Python: its
launches run the bodies eagerly on the tensors the plan names. The rules here
are the kernels' of ``cudagraph_capture._kernels``, written apart from them;
the GPU tests hold the kernels to the same results (the host loop's).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch

from cudagraph_capture._conditional import (
    Choice,
    LoopFallback,
    LoopPlan,
    LoopUnavailableError,
    RecordedGraph,
    ReplayPlan,
    RowTables,
)
from cudagraph_capture._kernels import EPOCHS, LIMIT, RUNNING, STEPS


class FakeGraph:
    def __init__(self, work: Callable[[], object]) -> None:
        self.work = work
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.work()

    def raw_cuda_graph(self) -> int:
        return id(self)


class FakeGraphs:
    """A ``LoopGraphs`` whose graphs run eagerly on the CPU; it says what was recorded and what lives."""

    def __init__(self, *, fail: Exception | None = None) -> None:
        self.fail = fail
        self.in_session = False
        self.warm_ups = 0
        self.recorded: list[tuple[weakref.ref[FakeGraph], bool]] = []

    @property
    def device(self) -> int:
        return 0

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        assert not self.in_session
        self.in_session = True
        try:
            yield
        finally:
            self.in_session = False

    def warm_up(self, work: Callable[[], object]) -> None:
        assert self.in_session
        self.warm_ups += 1
        work()

    def record(self, work: Callable[[], object], *, instantiate: bool) -> RecordedGraph:
        assert self.in_session
        if self.fail is not None:
            raise self.fail
        graph = FakeGraph(work)
        self.recorded.append((weakref.ref(graph), instantiate))
        return graph

    def live(self) -> int:
        return sum(ref() is not None for ref, _ in self.recorded)

    def replays(self) -> int:
        return sum(graph.replays for ref, _ in self.recorded if (graph := ref()) is not None)


class FakeLoop:
    """A loop graph's rules, run in Python: ``loop_begin``, the WHILE nodes, ``loop_restore``.

    ``iterations`` counts the iterations of the loop's WHILE nodes (what a
    check costs on the device); ``choices`` the iterations that chose a body.
    ``nested``: a shrinking loop's bodies are WHILE nodes of their own,
    which stay on their body while it still holds the live rows.
    """

    def __init__(self, plan: LoopPlan, choice: Choice | None, *, nested: bool = False) -> None:
        self.plan = plan
        self.choice = choice
        self.nested = nested and plan.rows is not None
        self.iterations = 0
        self.choices = 0

    def launch(self) -> None:
        plan = self.plan
        c = plan.cells.counters
        c[STEPS], c[RUNNING], c[EPOCHS] = 0, 1, 0
        rows = plan.rows
        choice = None if rows is None else _Rows(rows)
        every = plan.every
        go = int(c[LIMIT]) >= every if every > 1 or self.nested else False
        while go:
            go = self._iteration(every, choice, nested=self.nested)
        if every > 1 or not self.nested:
            go = bool(c[RUNNING]) and int(c[STEPS]) < int(c[LIMIT])
            while go:
                go = self._iteration(1, choice, nested=False)
        if choice is not None:
            choice.restore(int(c[STEPS]))

    def _iteration(self, every: int, rows: _Rows | None, *, nested: bool) -> bool:
        """One WHILE iteration: [``loop_choose``], ``every`` steps counted (nested: while the body
        still fits), ``loop_check``."""
        plan, c = self.plan, self.plan.cells.counters
        self.iterations += 1
        branch = 0 if rows is None else rows.choose(int(c[STEPS]))
        self.choices += rows is not None
        mark = int(c[STEPS])
        stay = True
        while stay:
            for _ in range(every):
                plan.bodies[branch].replay()
                if int(c[RUNNING]):  # loop_count / loop_check: the step counts if it ran before stop
                    c[STEPS] += 1
                    c[RUNNING] = int(int(plan.cells.stop) == 0)
            fits = bool(c[RUNNING]) and int(c[STEPS]) + every <= int(c[LIMIT])
            stay = nested and fits and rows is not None and rows.still(branch)  # loop_stay
            self.iterations += stay
        if rows is not None:
            rows.tables.branch_steps[branch] += int(c[STEPS]) - mark
        return bool(c[RUNNING]) and int(c[STEPS]) + every <= int(c[LIMIT])


class _Rows:
    """A shrinking loop's row rules for one launch: the partition, the choice, the epochs, the restore."""

    def __init__(self, tables: RowTables) -> None:
        self.tables = tables
        self.rows = tables.rows  # the rows in use: all of them before the first choice
        tables.order.copy_(torch.arange(tables.rows, dtype=torch.int32))
        tables.branch_steps.zero_()
        self.epochs: list[tuple[int, int, list[int]]] = []  # (first step, rows, order)

    def choose(self, steps: int) -> int:
        tables, rows = self.tables, self.rows
        active = tables.active[:rows].tolist()
        live = sum(active)
        dest, before = [], 0
        for r, on in enumerate(active):
            dest.append(before if on else live + (r - before))
            before += on
        moved = dest != list(range(rows))
        if moved:
            source = torch.empty(rows, dtype=torch.int64)
            source[torch.tensor(dest)] = torch.arange(rows)
            for buffer in (*tables.buffers, tables.order):
                buffer[:rows] = buffer[:rows][source]
            tables.active[:rows] = torch.arange(rows) < live
        sizes = tables.sizes.tolist()
        branch = min(next((i for i, size in enumerate(sizes) if size >= live), len(sizes)), len(sizes) - 1)
        chosen = sizes[branch]
        if (not self.epochs or moved or chosen != rows) and len(self.epochs) < tables.max_epochs:
            self.epochs.append((steps, chosen, tables.order[:chosen].tolist()))
        self.rows = chosen
        return branch

    def still(self, branch: int) -> bool:
        """Whether ``branch`` is still the smallest body holding the active rows (``loop_stay``)."""
        live = int(self.tables.active[: self.rows].sum())
        sizes = self.tables.sizes.tolist()
        return next((i for i, size in enumerate(sizes) if size >= live), len(sizes)) == branch

    def restore(self, steps: int) -> None:
        tables = self.tables
        if len(self.epochs) <= 1:
            return
        for step in range(steps):
            _, rows, order = next(e for e in reversed(self.epochs) if e[0] <= step)
            row = tables.history[step]
            computed = row[: tables.rows].clone()
            restored = torch.full_like(computed, tables.fill)
            restored[torch.tensor(order, dtype=torch.int64)] = computed[:rows]
            row[: tables.rows] = restored


class FakeReplay:
    """``choose_replay`` and the branches, in Python."""

    def __init__(self, plan: ReplayPlan, choice: Choice) -> None:
        self.plan = plan
        self.choice = choice

    def launch(self) -> None:
        plan = self.plan
        live = int(plan.live)
        sizes = plan.sizes.tolist()
        index = next((i for i, size in enumerate(sizes) if size >= live), -1)
        plan.chosen.fill_(index)
        if index >= 0:
            plan.graphs[index].replay()


class FakeConditional:
    """The loader and the layer at once.

    ``unavailable``: the loader refuses; ``refuse_build``: every build is
    refused; ``switch``: SWITCH nodes exist (else IF nodes); ``refuse_switch``:
    a SWITCH is refused, IF nodes are not; ``nested``: a shrinking loop's
    bodies are WHILE nodes of their own (else flat: a choice every
    iteration). ``built`` lists the graphs built.
    """

    def __init__(
        self,
        unavailable: LoopFallback | None = None,
        *,
        refuse_build: bool = False,
        switch: bool = True,
        refuse_switch: bool = False,
        nested: bool = True,
    ) -> None:
        self.unavailable = unavailable
        self.refuse_build = refuse_build
        self.switch = switch
        self.refuse_switch = refuse_switch
        self.nested = nested
        self.loads = 0
        self.built: list[FakeLoop | FakeReplay] = []

    def __call__(self, device: int) -> FakeConditional:
        self.loads += 1
        if self.unavailable is not None:
            raise LoopUnavailableError(self.unavailable, "the fake says no")
        return self

    def _choice(self) -> Choice:
        if self.refuse_build:
            raise LoopUnavailableError(LoopFallback.DRIVER_REFUSED, "the fake driver refused the body")
        return "switch" if self.switch and not self.refuse_switch else "if_chain"

    def build(self, plan: LoopPlan) -> FakeLoop:
        choice = self._choice()
        loop = FakeLoop(plan, None if plan.rows is None else choice, nested=self.nested)
        self.built.append(loop)
        return loop

    def build_replay(self, plan: ReplayPlan) -> FakeReplay:
        replay = FakeReplay(plan, self._choice())
        self.built.append(replay)
        return replay
