"""Start-up, wake and the estimate as a user meets them (GPU), each figure beside its target (issue 49).

Every figure comes from fresh processes of ``tests.benchmarks.defaults``
(cold captures, the wake, the estimate) or ``tests.benchmarks.serve_from_step0``
(``start_capture()`` against ``capture()``), with the defaults a user gets;
where a comparison has two variants (the new default and the rule before
it, or a non-default option shown beside it) their processes alternate,
ABBA over ``CUDAGRAPH_BENCH_DEFAULTS_ROUNDS`` rounds (default 2). Each
benchmark's ``extra_info`` holds ``figure`` (the default's, the median over
rounds), ``figure_spread``, ``target`` and ``target_met``; the report lists
them in its "Targets" table (``tests/benchmarks/report.py``). A cold figure
is a restart's: the machine's first process (the on-disk caches filled) is
shown beside it, and byte code is cached as after a pip install.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Final

import pytest

from cudagraph_manager._graphs import _estimate
from tests.benchmarks.support import BenchmarkFixture, append_json_line
from tests.capture.test_lean_import_capture import fresh_json

pytestmark = pytest.mark.gpu

ROUNDS: Final = int(os.environ.get("CUDAGRAPH_BENCH_DEFAULTS_ROUNDS", "2"))
#: The rounds of ``start_capture()`` against ``capture()`` (``CUDAGRAPH_BENCH_DEFAULTS_SERVE_ROUNDS``).
SERVE_ROUNDS: Final = int(os.environ.get("CUDAGRAPH_BENCH_DEFAULTS_SERVE_ROUNDS", str(ROUNDS)))
GROUP: Final = "issue 49: start-up, wake and estimate with the defaults, against their targets"
#: Seconds a fresh process may take (``CUDAGRAPH_BENCH_DEFAULTS_TIMEOUT``; a GPU job gives less).
TIMEOUT_S: Final = float(os.environ.get("CUDAGRAPH_BENCH_DEFAULTS_TIMEOUT", "300"))
DEFAULTS: Final = ("-m", "tests.benchmarks.defaults")


@pytest.fixture(autouse=True)
def _figures_logged(request: pytest.FixtureRequest, benchmark: BenchmarkFixture) -> Iterator[None]:
    """Each benchmark's figures, appended as a JSON line to ``CUDAGRAPH_BENCH_DEFAULTS_LOG`` when set."""
    yield
    if benchmark.extra_info:
        append_json_line("CUDAGRAPH_BENCH_DEFAULTS_LOG", {"name": request.node.name, **benchmark.extra_info})


@pytest.fixture(autouse=True)
def _byte_code_cached(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Fresh processes import from cached byte code, as a pip-installed torch does.

    A machine that says ``PYTHONDONTWRITEBYTECODE`` over a site-packages
    without ``__pycache__`` compiles every module torch imports from source
    in each process (seconds of a cold figure no user pays): the processes
    then cache byte code under a folder of this session instead.
    """
    if sys.flags.dont_write_bytecode:
        monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
        monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path_factory.getbasetemp() / "pycache"))


def alternated(variants: Sequence[Sequence[str]], rounds: int) -> list[list[dict[str, Any]]]:
    """Each variant's JSON per round, fresh processes, in ABBA order (round ``i`` reversed when odd)."""
    results: list[list[dict[str, Any]]] = [[] for _ in variants]
    for index in range(rounds):
        order = list(range(len(variants)))
        if index % 2:
            order.reverse()
        for which in order:
            results[which].append(fresh_json(*variants[which], timeout=TIMEOUT_S))
    return results


def spread(values: Sequence[float]) -> str:
    return f"{min(values):.3f}..{max(values):.3f} ({len(values)} runs)"


def record_target(
    benchmark: BenchmarkFixture, label: str, figure: float, values: Sequence[float], target: str, met: bool
) -> None:
    """The row of the report's Targets table: the default's figure, its spread, the target and whether met."""
    benchmark.extra_info.update(
        label=label, figure=figure, figure_spread=spread(values), target=target, target_met=met
    )


@pytest.mark.parametrize(
    ("backend", "page_size", "target", "beside"),
    [
        ("flex", 128, 4.0, ("--old",)),  # before issue 49: no compile classes, every key warmed
        ("varlen", 16, 2.0, ("--warm-ups", "every_key")),  # a non-default option, shown beside
    ],
)
def test_bench_cold_capture(
    benchmark: BenchmarkFixture, backend: str, page_size: int, target: float, beside: tuple[str, ...]
) -> None:
    """The paged decoder's first ``capture()`` (FULL, 51 keys, ``warm_ups="auto"``) over its floor."""
    base = (*DEFAULTS, "cold", "--backend", backend, "--page-size", str(page_size))
    runs: list[list[dict[str, Any]]] = []
    benchmark.group = GROUP
    # A machine's first process fills the on-disk caches (byte code, Triton's kernels, inductor's
    # graphs) that every later start-up reads: shown beside, not in the figure (a restart's).
    first = [fresh_json(*variant, timeout=TIMEOUT_S) for variant in (base, (*base, *beside))]
    benchmark.pedantic(lambda: runs.extend(alternated([base, (*base, *beside)], ROUNDS)), rounds=1)
    new, other = runs
    ratios = [r["cold_over_floor"] for r in new]
    figure = statistics.median(ratios)
    record_target(
        benchmark,
        f"cold capture() / floor, {backend}, pages of {page_size}",
        figure,
        ratios,
        f"<= {target}",
        figure <= target,
    )
    benchmark.extra_info.update(
        first_process_figure=first[0]["cold_over_floor"],
        first_process_cold_s=first[0]["cold_s"],
        beside=" ".join(beside),
        beside_figure=statistics.median(r["cold_over_floor"] for r in other),
        cold_s=statistics.median(r["cold_s"] for r in new),
        floor_s=statistics.median(r["floor_s"] for r in new),
        warm_up_s=statistics.median(r["cold_warm_up_s"] for r in new),
        recording_s=statistics.median(r["cold_recording_s"] for r in new),
        keys_warmed_up=new[0]["keys_warmed_up"],
        compiles=new[0]["compiles_in_capture"],
        compiles_in_recordings=max(r["compiles_in_recordings"] for r in new),
        beside_keys_warmed_up=other[0]["keys_warmed_up"],
        beside_compiles=other[0]["compiles_in_capture"],
    )
    # A correctness rule, not a speed figure: with the defaults nothing compiles inside a recording.
    kept = [first[0], *new]
    assert [r["compiles_in_recordings"] for r in kept] == [0] * len(kept), [
        r["recordings_that_compiled"] for r in kept
    ]


@pytest.mark.parametrize("model", ["small", "reference"])
def test_bench_start_capture_against_capture(benchmark: BenchmarkFixture, model: str) -> None:
    """``start_capture()`` until every graph is ready, serving from step 0, over ``capture()`` (cold)."""
    runs: list[list[dict[str, Any]]] = []
    variants = [
        ("-m", "tests.benchmarks.serve_from_step0", run, model) for run in ("foreground", "background")
    ]
    benchmark.group = GROUP
    benchmark.pedantic(lambda: runs.extend(alternated(variants, SERVE_ROUNDS)), rounds=1)
    foreground, background = runs
    ratios = [b["ready_s"] / f["capture_s"] for f, b in zip(foreground, background, strict=True)]
    figure = statistics.median(ratios)
    record_target(
        benchmark, f"start_capture() ready / capture(), {model}", figure, ratios, "<= 1.1", figure <= 1.1
    )
    benchmark.extra_info.update(
        foreground_capture_s=statistics.median(f["capture_s"] for f in foreground),
        background_ready_s=statistics.median(b["ready_s"] for b in background),
        background_capture_s=statistics.median(b["capture_s"] for b in background),
        start_capture_s=statistics.median(b["start_capture_s"] for b in background),
        background_first_step_s=statistics.median(b["served"][0][0] for b in background),
        foreground_phases=str(foreground[-1]["phases"]),
        background_phases=str(background[-1]["phases"]),
        steps_during=statistics.median(
            sum(1 for t, _, _ in b["served"] if t <= b["ready_s"]) for b in background
        ),
    )


def test_bench_wake_first_step(benchmark: BenchmarkFixture) -> None:
    """``release()``, then ``start_capture()`` and ``run()`` of 200 tokens at once, over an eager step."""
    runs: list[list[dict[str, Any]]] = []
    benchmark.group = GROUP
    benchmark.pedantic(lambda: runs.extend(alternated([(*DEFAULTS, "wake")], 1)), rounds=1)
    ((new,),) = runs
    extra = [w["first_step_ms"] - new["eager_step_ms"] for w in new["wakes"][1:] if w["kind"] == "wake"]
    figure = new["wake_first_step_minus_eager_ms"]
    record_target(benchmark, "wake's first step - eager step (ms)", figure, extra, "<= 2 ms", figure <= 2.0)
    benchmark.extra_info.update(
        eager_step_ms=new["eager_step_ms"],
        wake_first_step_ms=new["wake_first_step_ms"],
        eager_after_release_ms=new["eager_after_release_ms"],
        start_capture_ms=new["wake_start_capture_ms"],
        step_enqueue_ms=new["wake_step_enqueue_ms"],
        step_wait_ms=new["wake_step_wait_ms"],
        first_wake_first_step_ms=new["first_wake_first_step_ms"],
        first_wake_warm_ups=len(new["first_wake_warm_ups"]),
    )


def test_bench_estimate_time(benchmark: BenchmarkFixture) -> None:
    """``estimate_memory()`` over the warm recapture it predicts, six models; errors beside the old rule's."""
    from tests.benchmarks.defaults import CASES, SIX

    runs: list[dict[str, Any]] = []
    chosen = os.environ.get("CUDAGRAPH_BENCH_DEFAULTS_ESTIMATE_CASES", ",".join(CASES))
    args = (*DEFAULTS, "estimate", "--rounds", str(ROUNDS), "--cases", chosen)
    benchmark.group = GROUP
    benchmark.pedantic(lambda: runs.append(fresh_json(*args, timeout=2 * TIMEOUT_S)), rounds=1)
    every: dict[str, Any] = runs[0]["cases"]
    cases = {name: case for name, case in every.items() if name in SIX}
    rule, other = _estimate.RULE, next(r for r in ("predicted", "probes") if r != _estimate.RULE)
    ratios = [case[rule]["ratio"] for case in cases.values()]
    figure = max(ratios)
    worst = max(abs(e) for case in cases.values() for e in case[rule]["error_mib"])
    record_target(
        benchmark,
        f"estimate_memory() / warm recapture (worst of six models; the {rule!r} rule, the default)",
        figure,
        ratios,
        "<= 0.10, errors no larger",
        figure <= 0.10,
    )
    benchmark.extra_info.update(
        rule=rule,
        worst_error_mib=worst,
        beside=other,
        beside_worst_ratio=max(case[other]["ratio"] for case in cases.values()),
        beside_worst_error_mib=max(abs(e) for case in cases.values() for e in case[other]["error_mib"]),
        per_case=str(
            {
                name: (
                    case[rule]["ratio"],
                    case[rule]["error_mib"],
                    case[other]["ratio"],
                    case[other]["error_mib"],
                )
                for name, case in every.items()
            }
        ),
    )
