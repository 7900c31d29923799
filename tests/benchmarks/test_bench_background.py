"""Serving from step 0: foreground ``capture()`` then serve, against ``start_capture()`` while serving.

The reference decoder (8 layers, d=1024, bf16) in FULL_AND_PIECEWISE over
``CaptureSizes.default(256)``: 70 graphs. Each run is a cold process of
``tests/benchmarks/serve_from_step0.py`` (a start-up pays for the first use of
every shape), serving decode steps on a stream of its own, each synchronized
on that stream. Recorded in ``extra_info``:

- time to the first served step: foreground = capture + one step; background
  = one (eager) step beside the capture; over the first step of a cold
  process that serves eagerly with no manager at all (what a start-up costs
  anyway), and over a warm eager step;
- steps served during the background capture, and their eager step time over
  the same steps in the eager process (the capture thread takes the GIL);
- wall time until every graph is ready, background over foreground capture;
- the background capture's own time over the foreground capture's.

A plot of step time over wall time (both runs, from their start) is written
next to the benchmark JSON as ``serve_from_step0.png``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Final, cast

import pytest

from tests.benchmarks.support import BenchmarkFixture, pyplot_or_none
from tests.capture.test_lean_import_capture import fresh_json

pytestmark = pytest.mark.gpu

PLOT_NAME: Final = "serve_from_step0.png"
_RUNS: Final = ("eager", "foreground", "background")
_GROUPS: Final = {
    "reference": "70 graphs of the reference decoder, FULL_AND_PIECEWISE",
    "small": "51 graphs of a small decoder (4 layers, d=512), FULL, tight loop",
}


def _cold_run(run: str, model: str) -> dict[str, object]:
    """One run in a fresh process; its JSON line."""
    return fresh_json("-m", "tests.benchmarks.serve_from_step0", run, model)


def _served(result: dict[str, object]) -> list[tuple[float, float, bool]]:
    rows = cast(list[tuple[float, float, bool]], result["served"])
    return [(float(t), float(ms), bool(r)) for t, ms, r in rows]


@pytest.mark.parametrize("model", ["reference", "small"])
def test_bench_serve_from_step0(
    benchmark: BenchmarkFixture, request: pytest.FixtureRequest, model: str
) -> None:
    results: dict[str, dict[str, object]] = {}
    benchmark.group = f"serve from step 0: {_GROUPS[model]}"
    benchmark.pedantic(
        lambda: results.update({run: _cold_run(run, model) for run in _RUNS}), rounds=1, iterations=1
    )
    eager, foreground, background = (_served(results[run]) for run in _RUNS)
    ready_bg = float(cast(float, results["background"]["ready_s"]))
    capture_fg = float(cast(float, results["foreground"]["capture_s"]))
    capture_bg = float(cast(float, results["background"]["capture_s"]))
    steady = float(cast(float, results["eager"]["steady_eager_step_ms"]))
    during = [s for s in background if s[0] <= ready_bg]
    eager_during = [ms for _, ms, replayed in during if not replayed]
    # The same steps (the same batch sizes, in the same order) in the eager process.
    eager_same = [eager[i][1] for i, (_, _, replayed) in enumerate(during) if not replayed and i < len(eager)]
    benchmark.extra_info.update(
        graphs=results["foreground"]["graphs"],
        cold_first_eager_step_ms=eager[0][1],
        steady_eager_step_ms=steady,
        foreground_first_step_s=foreground[0][0],
        background_first_step_s=background[0][0],
        background_first_step_vs_cold_first_eager_step=background[0][0] * 1e3 / eager[0][1],
        background_first_step_vs_steady_eager_step=background[0][0] * 1e3 / steady,
        foreground_first_step_vs_cold_first_eager_step=foreground[0][0] * 1e3 / eager[0][1],
        steps_during_capture=len(during),
        eager_steps_during_capture=len(eager_during),
        replayed_share_during_capture=(len(during) - len(eager_during)) / len(during) if during else None,
        # Every eager step during the capture should be "not_captured" (its key was not ready):
        # a step whose graph is ready always replays.
        eager_reasons_during_capture=results["background"]["eager_reasons_during"],
        eager_step_during_vs_same_steps_eager=(
            statistics.median(eager_during) / statistics.median(eager_same) if eager_same else None
        ),
        foreground_capture_s=capture_fg,
        background_ready_s=ready_bg,
        ready_vs_foreground_capture=ready_bg / capture_fg,
        background_capture_s=capture_bg,
        background_vs_foreground_capture=capture_bg / capture_fg,
        background_retries=results["background"]["retries"],
        longest_step_during_capture_ms=max(ms for _, ms, _ in during),
    )
    _plot(request, foreground, background, capture_fg, ready_bg, model)


def _plot(
    request: pytest.FixtureRequest,
    foreground: list[tuple[float, float, bool]],
    background: list[tuple[float, float, bool]],
    capture_s: float,
    ready_s: float,
    model: str,
) -> None:
    """Step time over wall time for both runs, next to the benchmark JSON (skipped without matplotlib)."""
    json_path = request.config.getoption("benchmark_json", None)
    plt = pyplot_or_none()
    if json_path is None or plt is None:
        return
    figure, axes = plt.subplots(figsize=(9, 4.5))
    for series, label in (
        (foreground, "capture() then serve"),
        (background, "serve from step 0 (start_capture)"),
    ):
        axes.plot([t for t, _, _ in series], [ms for _, ms, _ in series], ".", markersize=3, label=label)
    axes.axvline(capture_s, color="C0", linestyle=":", linewidth=1, label="foreground capture done")
    axes.axvline(ready_s, color="C1", linestyle=":", linewidth=1, label="background capture done")
    axes.set_xlabel("wall time since the run's start, cold process (s)")
    axes.set_ylabel("step time (ms, synchronized)")
    axes.set_yscale("log")
    axes.set_title(f"{_GROUPS[model]}: when the first steps are served")
    axes.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    name = PLOT_NAME if model == "reference" else PLOT_NAME.replace(".png", f"_{model}.png")
    figure.savefig(Path(str(getattr(json_path, "name", json_path))).parent / name, dpi=120)
    plt.close(figure)
