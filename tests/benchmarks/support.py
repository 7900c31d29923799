"""What the benchmark modules share: the typed benchmark fixture, interleaved timing.

Interleaved timing gives ratios that the GPU's drift during a run cannot
bias: measured one after the other, two equal graphs differed by 15% on an
H200 (the first measured ran faster; re-measured later, it matched the
second). Alternating the candidates round by round gives each the same
conditions, and a ratio taken round by round (each round's pair, then the
median) cancels what a slow stretch of the host does to both sides. Each
figure goes with its spread across rounds (``Spread``: the per-round ratios'
extremes and quartiles, ``record_interleaved``), so a reader sees whether a
difference of a few percent is the code's or the run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

import torch


class _Stats(Protocol):
    @property
    def median(self) -> float: ...


class _Metadata(Protocol):
    @property
    def stats(self) -> _Stats: ...


class BenchmarkFixture(Protocol):
    """The part of pytest-benchmark's ``benchmark`` fixture used here (it ships no types)."""

    group: str | None

    @property
    def extra_info(self) -> dict[str, object]: ...

    @property
    def stats(self) -> _Metadata | None: ...

    def pedantic(
        self, target: Callable[[], object], *, rounds: int, warmup_rounds: int = 0, iterations: int = 1
    ) -> object: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Interleaved:
    """Seconds per call of each candidate, one sample per round (see ``interleave``)."""

    samples: Mapping[str, Sequence[float]]

    def median(self, name: str) -> float:
        """Median seconds per call of ``name``."""
        return statistics.median(self.samples[name])

    def ratios(self, name: str, baseline: str) -> list[float]:
        """``name``'s time over ``baseline``'s, round by round (in round order)."""
        pairs = zip(self.samples[name], self.samples[baseline], strict=True)
        return [mine / theirs for mine, theirs in pairs]

    def ratio(self, name: str, baseline: str) -> float:
        """Median over rounds of ``name``'s time over ``baseline``'s in the same round.

        Paired by round, so a slow stretch of the host or the GPU that spans a
        round moves both sides of its ratio and cancels, where a ratio of the
        two medians would keep it.
        """
        return statistics.median(self.ratios(name, baseline))

    def spread(self, name: str, baseline: str) -> Spread:
        """How the per-round ratios of ``name`` over ``baseline`` spread: extremes and quartiles."""
        return Spread.of(self.ratios(name, baseline))

    def minus(self, baseline: str) -> Interleaved:
        """Every other candidate's time less ``baseline``'s in the same round (what each adds to it).

        A per-break cost is the breakable replay less the one-graph replay of
        the same kernels, round by round; its ratios then compare the costs
        added, not the totals.
        """
        base = self.samples[baseline]
        return Interleaved(
            {
                name: [mine - theirs for mine, theirs in zip(times, base, strict=True)]
                for name, times in self.samples.items()
                if name != baseline
            }
        )

    @property
    def rounds(self) -> int:
        """The rounds timed (each candidate has one sample per round)."""
        return min((len(times) for times in self.samples.values()), default=0)


@dataclasses.dataclass(frozen=True, slots=True)
class Spread:
    """The per-round ratios' lowest, quartiles and highest: how far one round's figure may stray."""

    low: float
    q1: float
    q3: float
    high: float

    @staticmethod
    def of(values: Sequence[float]) -> Spread:
        """The spread of ``values`` (at least one); with a single value every field is that value."""
        if not values:
            raise ValueError("values: expected at least one per-round ratio, got none")
        if len(values) == 1:
            (only,) = values
            return Spread(only, only, only, only)
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return Spread(min(values), q1, q3, max(values))

    def __str__(self) -> str:
        return f"{self.low:.3f}..{self.high:.3f} (IQR {self.q1:.3f}..{self.q3:.3f})"


def record_interleaved(
    info: dict[str, object],
    timed: Interleaved,
    ratios: Mapping[str, tuple[str, str]],
    *,
    per_call: int = 1,
    medians: bool = True,
) -> None:
    """Write ``timed`` into a benchmark's ``extra_info``: the figures and their spread across rounds.

    Each candidate's median in microseconds per call (divided by
    ``per_call``: the steps or replays a call ran) as ``{name}_us``, unless
    ``medians`` is false (the caller writes its own); each
    ``key: (name, baseline)`` of ``ratios`` as ``key`` (the median of the
    per-round ratios) and ``{key}_spread`` (``Spread``, as text: the report
    shows it as a column); the rounds as ``interleaved_rounds``.
    """
    if medians:
        for name in timed.samples:
            info[f"{name}_us"] = timed.median(name) / per_call * 1e6
    for key, (name, baseline) in ratios.items():
        info[key] = timed.ratio(name, baseline)
        info[f"{key}_spread"] = str(timed.spread(name, baseline))
    info["interleaved_rounds"] = timed.rounds


def interleave(
    candidates: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    calls_per_round: int,
    warmup_rounds: int = 2,
) -> Interleaved:
    """Time the candidates alternating round by round.

    A round is ``calls_per_round`` calls of each candidate in turn, each
    candidate's calls followed by one device synchronize (so the time includes
    the device's work, not just the host's enqueueing). Round ``i`` starts at
    the ``i``-th candidate (``rotated``): none always runs first, right after
    the host has waited, or always follows the same neighbour.
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for index in range(warmup_rounds + rounds):
        for name in rotated(names, index):
            call = candidates[name]
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls_per_round):
                call()
            torch.cuda.synchronize()
            if index >= warmup_rounds:
                samples[name].append((time.perf_counter() - start) / calls_per_round)
    return Interleaved(samples)


def rotated(names: Sequence[str], index: int) -> list[str]:
    """``names`` in the order of round ``index``: starting at ``names[index % len(names)]``."""
    start = index % len(names) if names else 0
    return [*names[start:], *names[:start]]


def plain_graph(work: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``work`` warmed up on a side stream, then captured as a plain torch graph (a baseline's)."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    return graph


def pyplot_or_none() -> ModuleType | None:
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def append_json_line(variable: str, record: Mapping[str, object]) -> None:
    """``record`` as one JSON line appended to the file the environment's ``variable`` names, if set.

    pytest-benchmark writes its JSON when the session ends; a GPU job that
    may be cut short keeps each figure as it is measured.
    """
    path = os.environ.get(variable)
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(record, default=str) + "\n")


@contextlib.contextmanager
def patched(owner: object, name: str, wrapper: Callable[[Any], Any]) -> Iterator[None]:
    """``owner.name`` replaced by ``wrapper(owner.name)`` for the block (a profile's instruments)."""
    original = getattr(owner, name)
    setattr(owner, name, wrapper(original))
    try:
        yield
    finally:
        setattr(owner, name, original)
