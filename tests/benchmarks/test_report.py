"""The benchmark report on a synthetic pytest-benchmark JSON file (CPU only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.benchmarks.report import MARKDOWN_NAME, PLOT_NAME, load_entries, main, step_series

_STEPS = 20


def _bench(
    name: str, group: str | None, median_s: float, extra: dict[str, object] | None = None
) -> dict[str, object]:
    return {
        "name": name,
        "fullname": f"tests/benchmarks/test_x.py::{name}",
        "group": group,
        "params": None,
        "stats": {
            "min": median_s * 0.9,
            "max": median_s * 1.2,
            "median": median_s,
            "mean": median_s,
            "rounds": 15,
        },
        "extra_info": extra or {},
    }


def _step(label: str, batch: int, step_ms: float) -> dict[str, object]:
    extra: dict[str, object] = {
        "label": label,
        "baseline": "eager",
        "batch": batch,
        "steps_per_call": _STEPS,
        "median_step_ms": step_ms,
    }
    return _bench(
        f"test_step_{label}[{batch}]", f"decoder step, batch {batch}", step_ms * _STEPS / 1e3, extra
    )


def _document() -> dict[str, object]:
    benchmarks = []
    for batch, eager_ms in ((1, 3.0), (128, 5.0)):
        benchmarks += [
            _step("eager", batch, eager_ms),
            _step("cuda_graph", batch, 0.5),
            _step("manager_full", batch, 0.6),
            _step("manager_piecewise", batch, 1.5),
            _step("torch_compile", batch, 0.55),
            _step("manager_piecewise_compiled", batch, 1.2),
            _step("manager_full_compiled", batch, 0.5),
            _step("breakable_engine", batch, 1.4),  # in the table, not in the plot
        ]
    benchmarks += [
        # No baseline named, no steps: the first entry of the group is the baseline.
        _bench("test_capture_a", "capture", 2.0, {"pool_mib": 512.0, "note": "a|b"}),
        _bench("test_capture_b", "capture", 3.0, {"num_graphs": 51}),
        _bench("test_loose", None, 1e-6),
        # Another module's decoder steps: in the tables, not in the plot.
        _bench(
            "test_capture_step[eager-1]",
            "capture: decoder step, batch 1",
            1.0,
            {"label": "eager", "batch": 1, "median_step_ms": 50.0},
        ),
    ]
    return {"machine_info": {"node": "box", "python_version": "3.12"}, "benchmarks": benchmarks}


def _write(tmp_path: Path, document: object) -> Path:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(document))
    return path


def _table_row(md: str, group: str, label: str) -> list[str]:
    section = md.split(f"## {group}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith(f"| {label} ")]
    assert len(rows) == 1, rows
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def test_markdown_has_one_table_per_group_with_ratios_against_the_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the plot is not what this test checks
    out = tmp_path / "out"
    assert main([str(_write(tmp_path, _document())), str(out)]) == 0
    md = (out / MARKDOWN_NAME).read_text()
    assert [line for line in md.splitlines() if line.startswith("## ")] == [
        "## decoder step, batch 1",
        "## decoder step, batch 128",
        "## capture",
        "## (no group)",
        "## capture: decoder step, batch 1",
    ]
    eager = _table_row(md, "decoder step, batch 1", "eager")
    assert eager[1:5] == ["60 ms", "3 ms", "baseline", ""]
    graph = _table_row(md, "decoder step, batch 128", "cuda_graph")
    assert graph[1:5] == ["10 ms", "500 us", "0.1x eager", "10x"]
    piecewise = _table_row(md, "decoder step, batch 1", "manager_piecewise")
    assert piecewise[3:5] == ["0.5x eager", "2x"]
    assert _table_row(md, "capture", "test_capture_a")[2:4] == ["baseline", ""]
    capture_b = _table_row(md, "capture", "test_capture_b")
    assert capture_b[1:4] == ["3 s", "1.5x test_capture_a", "0.667x"]
    assert capture_b[-1] == "51"  # its own extra column, empty for the other entry
    assert "a\\|b" in md  # a pipe in a value does not split the row
    assert _table_row(md, "(no group)", "test_loose")[1] == "1 us"


def test_step_series_holds_the_plotted_labels_sorted_by_batch() -> None:
    series = step_series(load_entries(_document()))
    assert list(series) == [  # legend order, whatever the order in the file
        "eager",
        "cuda_graph",
        "manager_full",
        "manager_piecewise",
        "manager_full_compiled",
        "manager_piecewise_compiled",
        "torch_compile",
    ]
    assert series["eager"] == [(1, 3.0), (128, 5.0)]


def test_plot_is_skipped_with_a_message_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "out"
    assert main([str(_write(tmp_path, _document())), str(out)]) == 0
    assert "matplotlib is not installed: skipped step_time.png" in capsys.readouterr().out
    assert not (out / PLOT_NAME).exists()
    assert (out / MARKDOWN_NAME).exists()


def test_plot_is_written_with_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert main([str(_write(tmp_path, _document())), str(out)]) == 0
    assert (out / PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "document",
    [
        {"benchmarks": "none"},
        {"benchmarks": [{"name": "x", "stats": {"median": "fast"}}]},
        ["not", "a", "dict"],
    ],
)
def test_unreadable_input_exits_2(
    tmp_path: Path, document: object, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(_write(tmp_path, document)), str(tmp_path / "out")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_empty_json_of_a_skipped_module_is_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A module whose benchmarks all skipped (two GPUs on a one-GPU machine) leaves an empty file."""
    empty = tmp_path / "test_bench_multi_gpu.json"
    empty.write_text("")
    out = tmp_path / "out"
    assert main([str(_write(tmp_path, _document())), str(empty), str(out)]) == 0
    assert "is empty (its benchmarks skipped)" in capsys.readouterr().err
    assert (out / MARKDOWN_NAME).exists()
    assert main([str(empty), str(tmp_path / "only_empty")]) == 0  # nothing ran at all: still a report


@pytest.mark.parametrize("status", [1, 2, 4])
def test_a_module_that_errored_is_reported_as_errored_not_skipped(
    tmp_path: Path, status: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 39: an import error leaves an empty JSON too; its status file (the Makefile's) says it errored.

    It was called "skipped" before; now it is named first in bench.md and on
    stderr, and the report exits 1. A module whose benchmarks all skipped
    (status 5) stays "skipped".
    """
    broken = tmp_path / "test_bench_manager.json"
    broken.write_text("")
    broken.with_suffix(".status").write_text(f"{status}\n")
    skipped = tmp_path / "test_bench_multi_gpu.json"
    skipped.write_text("")
    skipped.with_suffix(".status").write_text("5\n")
    good = _write(tmp_path, _document())
    good.with_suffix(".status").write_text("0\n")
    out = tmp_path / "out"
    assert main([str(good), str(broken), str(skipped), str(out)]) == 1
    err = capsys.readouterr().err
    assert f"test_bench_manager ERRORED (pytest exit status {status})" in err
    assert "test_bench_manager.json is empty (its benchmarks skipped)" not in err
    assert "test_bench_multi_gpu.json is empty (its benchmarks skipped)" in err
    report = (out / MARKDOWN_NAME).read_text()
    assert "**Errored**" in report
    assert f"- `test_bench_manager`: pytest exit status {status}" in report
    assert "test_bench_multi_gpu" not in report.split("**Errored**")[1].split("\n\n")[0]  # skipped


def test_partial_results_of_a_module_with_a_failed_test_are_kept_and_flagged(tmp_path: Path) -> None:
    """A module whose JSON holds results but whose run failed (exit 1): its rows stay, flagged errored."""
    partial = _write(tmp_path, _document())
    partial.with_suffix(".status").write_text("1")
    out = tmp_path / "out"
    assert main([str(partial), str(out)]) == 1
    report = (out / MARKDOWN_NAME).read_text()
    assert f"- `{partial.stem}`: pytest exit status 1" in report
    assert "## decoder step, batch 1" in report


def test_entries_with_a_target_are_listed_first_beside_their_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    target = {"figure": 3.5, "figure_spread": "3.2..3.9 (2 runs)", "target": "<= 4", "target_met": True}
    document = {
        "benchmarks": [
            _bench("test_plain", "start-up", 1.0),
            _bench("test_cold[flex]", "start-up", 2.0, {"label": "cold / floor, flex", **target}),
            _bench("test_wake", "start-up", 1.0, {"figure": 5.0, "target": "<= 2 ms", "target_met": False}),
        ]
    }
    out = tmp_path / "out"
    assert main([str(_write(tmp_path, document)), str(out)]) == 0
    md = (out / MARKDOWN_NAME).read_text()
    headings = [line for line in md.splitlines() if line.startswith("## ")]
    assert headings == ["## Targets", "## start-up"]
    targets = md.split("## Targets\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in targets.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [[c.strip() for c in row.strip("|").split("|")] for row in rows] == [
        ["cold / floor, flex", "3.5", "3.2..3.9 (2 runs)", "<= 4", "yes"],
        ["test_wake", "5", "", "<= 2 ms", "no"],
    ]
