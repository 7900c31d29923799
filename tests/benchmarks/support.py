"""What the benchmark modules share: the typed benchmark fixture, interleaved timing.

Interleaved timing gives ratios that the GPU's drift during a run cannot
bias: measured one after the other, two equal graphs differed by 15% on an
H200 (the first measured ran faster; re-measured later, it matched the
second). Alternating the candidates round by round gives each the same
conditions, and a ratio taken round by round (each round's pair, then the
median) cancels what a slow stretch of the host does to both sides.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Protocol

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

    def ratio(self, name: str, baseline: str) -> float:
        """Median over rounds of ``name``'s time over ``baseline``'s in the same round.

        Paired by round, so a slow stretch of the host or the GPU that spans a
        round moves both sides of its ratio and cancels, where a ratio of the
        two medians would keep it.
        """
        pairs = zip(self.samples[name], self.samples[baseline], strict=True)
        return statistics.median(mine / theirs for mine, theirs in pairs)


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
    the device's work, not just the host's enqueueing).
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for index in range(warmup_rounds + rounds):
        for name, call in candidates.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls_per_round):
                call()
            torch.cuda.synchronize()
            if index >= warmup_rounds:
                samples[name].append((time.perf_counter() - start) / calls_per_round)
    return Interleaved(samples)


def pyplot_or_none() -> ModuleType | None:
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
