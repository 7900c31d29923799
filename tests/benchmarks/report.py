"""Turn a pytest-benchmark JSON file into Markdown tables and a step-time plot.

``python -m tests.benchmarks.report BENCH_JSON OUTDIR`` writes:

- ``OUTDIR/bench.md``: first the entries that name a target (``extra_info``
  ``target``, ``figure``, ``figure_spread``, ``target_met``: each figure beside
  its target), then one table per benchmark group with each entry's median,
  its median per step where the entry says how many steps one call ran
  (``extra_info["steps_per_call"]`` or ``extra_info["median_step_ms"]``), and
  its ratio against the group's baseline: the entry named by the entry's
  ``extra_info["baseline"]`` (matched against ``extra_info["label"]`` or the
  benchmark's name), else the group's first entry. Other scalar
  ``extra_info`` values become columns.
- ``OUTDIR/step_time.png``: step time against batch size for the decoder
  step benchmarks (groups named ``decoder step, ...``; entries with
  ``extra_info["batch"]`` and a known ``label``). matplotlib is imported only here; without it the plot is
  skipped with a message.

A module's pytest exit status, where the Makefile wrote it beside its JSON
(``NAME.status``), tells an errored module (an import error, a failed
test: listed first in ``bench.md``, and the exit status is 1) from one whose
benchmarks all skipped (status 5, or an empty JSON without a status).

Generic on purpose: any benchmark of this repository (capture engines,
manager) lands in a table without the report knowing about it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

MARKDOWN_NAME: Final = "bench.md"
#: pytest's exit status when it collected no test to run: every benchmark of the module skipped.
NO_TESTS_RAN: Final = 5
PLOT_NAME: Final = "step_time.png"
NO_GROUP: Final = "(no group)"
#: The groups plotted in step_time.png (the manager benchmarks' decoder steps).
STEP_GROUP_PREFIX: Final = "decoder step"

# Labels plotted in step_time.png, in legend order, with their legend text.
PLOTTED_LABELS: Final[Mapping[str, str]] = {
    "eager": "eager",
    "cuda_graph": "hand-written torch.cuda.CUDAGraph",
    "manager_full": "manager FULL",
    "manager_piecewise": "manager PIECEWISE",
    "manager_full_compiled": "manager FULL over torch.compile (inductor, one dynamic compile)",
    "manager_piecewise_compiled": "manager PIECEWISE over compiled segments",
    "torch_compile": 'torch.compile "reduce-overhead"',
}
# extra_info keys the report reads itself: not repeated as columns.
_OWN_KEYS: Final = frozenset({"label", "baseline", "steps_per_call", "median_step_ms"})


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One benchmark of the JSON file: what the report needs of it."""

    name: str
    group: str
    median_s: float  # seconds per benchmarked call (pytest-benchmark's median)
    rounds: int
    extra: Mapping[str, object]

    @property
    def label(self) -> str:
        """``extra_info["label"]`` when given, else the benchmark's name."""
        label = self.extra.get("label")
        return label if isinstance(label, str) else self.name

    @property
    def step_s(self) -> float | None:
        """Seconds per step, when the entry says how many steps a call ran."""
        step_ms = _number(self.extra.get("median_step_ms"))
        if step_ms is not None:
            return step_ms / 1e3
        steps = _number(self.extra.get("steps_per_call"))
        if steps is not None and steps > 0:
            return self.median_s / steps
        return None


def _number(value: object) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def load_entries(data: object) -> list[Entry]:
    """The entries of a pytest-benchmark JSON document; ``ValueError`` if it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ValueError("not a pytest-benchmark JSON file: no 'benchmarks' list")
    entries: list[Entry] = []
    for i, item in enumerate(data["benchmarks"]):
        if not isinstance(item, dict):
            raise ValueError(f"benchmarks[{i}]: expected an object, got {type(item).__name__}")
        stats = item.get("stats")
        if not isinstance(stats, dict):
            raise ValueError(f"benchmarks[{i}] ({item.get('name')!r}): no stats")
        median = _number(stats.get("median"))
        if median is None:
            raise ValueError(f"benchmarks[{i}] ({item.get('name')!r}): no numeric stats.median")
        rounds = stats.get("rounds")
        extra = item.get("extra_info")
        group = item.get("group")
        entries.append(
            Entry(
                name=str(item.get("name", f"benchmark {i}")),
                group=group if isinstance(group, str) and group else NO_GROUP,
                median_s=median,
                rounds=rounds if isinstance(rounds, int) else 0,
                extra=dict(extra) if isinstance(extra, dict) else {},
            )
        )
    return entries


def group_entries(entries: Sequence[Entry]) -> dict[str, list[Entry]]:
    """Entries by group, groups in order of first appearance."""
    groups: dict[str, list[Entry]] = {}
    for entry in entries:
        groups.setdefault(entry.group, []).append(entry)
    return groups


def baseline_of(entry: Entry, group: Sequence[Entry]) -> Entry:
    """The entry ``entry`` is compared with: the one its ``baseline`` names, else the group's first."""
    wanted = entry.extra.get("baseline")
    if isinstance(wanted, str):
        for other in group:
            if wanted in (other.label, other.name):
                return other
    return group[0]


def ratio(entry: Entry, baseline: Entry) -> float:
    """``entry``'s time over ``baseline``'s (per step when both know their steps)."""
    mine, theirs = entry.step_s, baseline.step_s
    if mine is None or theirs is None:
        mine, theirs = entry.median_s, baseline.median_s
    return mine / theirs if theirs > 0 else math.nan


def format_seconds(seconds: float) -> str:
    """A duration with a unit that keeps 3-4 significant digits: ``"2.76 ms"``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _format_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value).replace("|", "\\|")


def _extra_columns(group: Sequence[Entry]) -> list[str]:
    keys: list[str] = []
    for entry in group:
        for key, value in entry.extra.items():
            if key not in _OWN_KEYS and key not in keys and isinstance(value, (str, int, float, bool)):
                keys.append(key)
    return keys


def markdown(
    entries: Sequence[Entry], *, source: str = "", machine: str = "", errored: Sequence[str] = ()
) -> str:
    """The report: one Markdown table per group; first, the modules that errored, if any."""
    lines = ["# Benchmarks", ""]
    if source:
        lines.append(f"Source: `{source}`" + (f"; {machine}" if machine else ""))
        lines.append("")
    if errored:
        lines.append("**Errored** (their benchmarks are missing or partial; their output says why):")
        lines += [f"- {module}" for module in errored]
        lines.append("")
    lines.append(
        "Ratios are time over the baseline's time (below 1: faster); speedup is the inverse. "
        "Per-step times divide a call's median by the steps it ran between two device syncs."
    )
    lines += targets_table(entries)
    for name, group in group_entries(entries).items():
        per_step = any(e.step_s is not None for e in group)
        extra = _extra_columns(group)
        headers = ["benchmark", "median / call"]
        headers += ["median / step or call"] if per_step else []
        headers += ["vs baseline", "speedup", "rounds", *extra]
        lines += ["", f"## {name}", ""]
        lines.append("| " + " | ".join(headers) + " |")
        lines.append("|" + "|".join(["---", *["---:"] * (len(headers) - 1)]) + "|")
        for entry in group:
            baseline = baseline_of(entry, group)
            row = [entry.label if entry.label == entry.name else f"{entry.label} (`{entry.name}`)"]
            row.append(format_seconds(entry.median_s))
            if per_step:
                step = entry.step_s
                row.append("" if step is None else format_seconds(step))
            if baseline is entry:
                row += ["baseline", ""]
            else:
                r = ratio(entry, baseline)
                row += [f"{r:.3g}x {baseline.label}", f"{1 / r:.3g}x" if r > 0 else ""]
            row.append(str(entry.rounds))
            row += [_format_value(entry.extra[key]) if key in entry.extra else "" for key in extra]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def targets_table(entries: Sequence[Entry]) -> list[str]:
    """The entries that name a target (``extra_info``: ``target``, ``figure``, ``figure_spread``,
    ``target_met``) as one table, each figure beside its target; no lines where none does."""
    rows = [e for e in entries if isinstance(e.extra.get("target"), str) and _number(e.extra.get("figure"))]
    if not rows:
        return []
    lines = ["", "## Targets", "", "| what | figure | spread | target | met |", "|---|---:|---|---|---|"]
    for entry in rows:
        figure = _number(entry.extra.get("figure"))
        met = entry.extra.get("target_met")
        cells = [
            entry.label,
            "" if figure is None else f"{figure:.3g}",
            _format_value(entry.extra.get("figure_spread", "")),
            _format_value(entry.extra["target"]),
            "yes" if met is True else "no" if met is False else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def step_series(entries: Sequence[Entry]) -> dict[str, list[tuple[int, float]]]:
    """``label -> [(batch, ms per step), ...]`` sorted by batch: plotted labels of the step groups."""
    series: dict[str, list[tuple[int, float]]] = {}
    for entry in entries:
        batch = entry.extra.get("batch")
        step = entry.step_s
        if (
            entry.group.startswith(STEP_GROUP_PREFIX)
            and entry.label in PLOTTED_LABELS
            and isinstance(batch, int)
            and step is not None
        ):
            series.setdefault(entry.label, []).append((batch, step * 1e3))
    return {label: sorted(series[label]) for label in PLOTTED_LABELS if label in series}


def plot_step_times(entries: Sequence[Entry], path: Path) -> bool:
    """Write the step-time plot to ``path``; False (with a message) when it cannot be drawn."""
    series = step_series(entries)
    if not series:
        print(f"no decoder step benchmarks with a batch and a known label: skipped {path.name}")
        return False
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipped {path.name}")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in series.items():
        ax.plot([b for b, _ in points], [ms for _, ms in points], marker="o", label=PLOTTED_LABELS[label])
    batches = sorted({b for points in series.values() for b, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_ylim(bottom=0)
    ax.set_xlabel("batch (requests, one token each)")
    ax.set_ylabel("step time (ms)")
    ax.set_title("Reference decoder step time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _machine(data: Mapping[str, object]) -> str:
    info = data.get("machine_info")
    if not isinstance(info, dict):
        return ""
    cpu = info.get("cpu")
    brand = cpu.get("brand_raw") if isinstance(cpu, dict) else None
    parts = [str(info[key]) for key in ("node", "python_version") if key in info]
    if isinstance(brand, str):
        parts.append(brand)
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Write ``bench.md`` and ``step_time.png``; exit 2 on an unreadable input, 1 if a module errored."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.benchmarks.report", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "bench_json", type=Path, nargs="+", help="pytest-benchmark JSON files (--benchmark-json)"
    )
    parser.add_argument("outdir", type=Path, help="where bench.md and step_time.png go")
    args = parser.parse_args(argv)
    entries: list[Entry] = []
    machines: list[str] = []
    errored: list[str] = []
    for path in args.bench_json:
        status = exit_status(path)
        if status not in (None, 0, NO_TESTS_RAN):
            errored.append(f"`{path.stem}`: pytest exit status {status}")
            print(
                f"report: {path.stem} ERRORED (pytest exit status {status}): its benchmarks are missing "
                "or partial; its output says why",
                file=sys.stderr,
            )
        if path.is_file() and path.stat().st_size == 0:
            # pytest-benchmark opens --benchmark-json up front and writes nothing when no
            # benchmark of the module ran: all skipped (the two-GPU one on a one-GPU
            # machine), or the module errored (an import error: its status file says so).
            if status in (None, 0, NO_TESTS_RAN):
                print(f"report: {path} is empty (its benchmarks skipped); left out", file=sys.stderr)
            continue
        try:
            data: object = json.loads(path.read_text())
            entries.extend(load_entries(data))
        except (OSError, ValueError) as error:
            print(f"report: cannot read {path}: {error}", file=sys.stderr)
            return 2
        assert isinstance(data, dict)
        machines.append(_machine(data))
    args.outdir.mkdir(parents=True, exist_ok=True)
    md_path = args.outdir / MARKDOWN_NAME
    sources = ", ".join(str(path) for path in args.bench_json)
    machine = machines[0] if machines else "unknown"
    md_path.write_text(markdown(entries, source=sources, machine=machine, errored=errored))
    print(
        f"wrote {md_path} ({len(entries)} benchmarks{f', {len(errored)} modules errored' if errored else ''})"
    )
    png_path = args.outdir / PLOT_NAME
    if plot_step_times(entries, png_path):
        print(f"wrote {png_path}")
    return 1 if errored else 0


def exit_status(bench_json: Path) -> int | None:
    """The pytest exit status the Makefile wrote beside ``bench_json`` (``NAME.status``), if any.

    ``None`` when there is none (a JSON written by hand) or it is not a number.
    """
    try:
        return int(bench_json.with_suffix(".status").read_text().strip())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
