"""Capture first, then size the KV cache, against estimate first: five configurations, fresh processes (GPU).

Each run is ``python -m examples.kv_sizing MODEL --attention A --order O
--json`` in a fresh process (cold: the first graphs of the process, default
options: FULL_AND_PIECEWISE up to 512 tokens, a 512 MiB margin), for the
reference decoder's row cache, the 8B-like shape's, and the paged decoder
with FlexAttention, varlen and gather. Recorded per run: what the device
has free after the start-up over the margin (capture first: under one
chunk, asserted, the mechanism's promise; estimate first: the estimate's
error), the KV cache each order gave, the start-up's time against the
capture's alone. ``test_bench_kv_resize`` times a grow by 10 GiB and a wake
re-backing 10 GiB, each followed by a step that replays a graph
(``tests/benchmarks/kv_resize.py``). Speed is recorded, never asserted.

``KVFIRST_RUNS=path``: each run's figures are appended there as one JSON
line too, as soon as it ends (a job cut short keeps what ran).
"""

from __future__ import annotations

from typing import Final

import pytest

from tests.benchmarks.support import BenchmarkFixture, append_json_line
from tests.capture.test_lean_import_capture import fresh_json

pytestmark = pytest.mark.gpu

MIB: Final = 2**20
CHUNK: Final = 2 * MIB
#: The five configurations (model, attention), each in both orders, the dearest last (a job cut short
#: keeps the others).
CONFIGS: Final = (
    ("reference", "rows"),
    ("reference", "gather"),
    ("reference", "varlen"),
    ("reference", "flex"),
    ("8b_like", "rows"),
)
RUNS: Final = [(model, attention, order) for model, attention in CONFIGS for order in ("capture", "estimate")]


#: A run's figures, as its JSON line has them.
Figures = dict[str, float | int | str]


def _keep(figures: Figures) -> None:
    append_json_line("KVFIRST_RUNS", figures)


def test_bench_kv_resize(benchmark: BenchmarkFixture) -> None:
    figures: Figures = {}
    benchmark.group = "KV cache backed after the capture: grow 10 GiB, wake re-backing 10 GiB"
    argv = ("-m", "tests.benchmarks.kv_resize", "reference", "--gib", "10", "--rounds", "5", "--json")
    benchmark.pedantic(lambda: figures.update(fresh_json(*argv, timeout=600)), rounds=1, iterations=1)
    figures.update(model="reference", attention="rows", order="resize")
    _keep(figures)
    benchmark.extra_info.update(figures)


@pytest.mark.parametrize(("model", "attention", "order"), RUNS, ids=["-".join(run) for run in RUNS])
def test_bench_kv_sizing_order(benchmark: BenchmarkFixture, model: str, attention: str, order: str) -> None:
    figures: Figures = {}
    benchmark.group = f"KV sizing, {model} {attention}: {order} first, a fresh process"
    argv = ("-m", "examples.kv_sizing", model, "--attention", attention, "--order", order, "--json")
    benchmark.pedantic(lambda: figures.update(fresh_json(*argv, timeout=600)), rounds=1, iterations=1)
    figures.update(model=model, attention=attention)
    _keep(figures)
    left_over = (float(figures["left_bytes"]) - float(figures["margin_bytes"])) / MIB
    benchmark.extra_info.update(figures, left_over_margin_mib=left_over)
    assert figures["eager_steps"] == 0  # strict: the decode step after the start-up replayed
    if order == "capture":
        assert abs(left_over) < CHUNK / MIB, f"free after the start-up is the margin {left_over:+.1f} MiB"
