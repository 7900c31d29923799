"""The loop-floor profile's arithmetic and summary (CPU: made-up timings, no GPU)."""

from __future__ import annotations

import pytest

from tests.benchmarks.loop_floor import slopes, summary, synthetic_result
from tests.benchmarks.support import Interleaved

STEPS = 32


def _line(intercept_us: float, per_step_us: float, steps: int, rounds: int = 3) -> list[float]:
    return [(intercept_us + per_step_us * steps) * 1e-6] * rounds


def test_slopes_split_what_a_loop_adds_per_iteration_from_what_it_adds_per_call() -> None:
    # The floor: 50 us a call and 300 us a step; the loop: 80 us a call and 306 us a step.
    timed = Interleaved(
        {
            "while_1": _line(80.0, 306.0, 1),
            f"while_{STEPS}": _line(80.0, 306.0, STEPS),
            "floor_1": _line(50.0, 300.0, 1),
            f"floor_{STEPS}": _line(50.0, 300.0, STEPS),
        }
    )
    starts = [0.0, 1.0, 2.0]
    marks = [40e-6, 1.0 + 40e-6, 2.0 + 40e-6]
    got = slopes(timed, STEPS, marks, starts)
    assert got["floor_us_per_step"] == pytest.approx(300.0)
    assert got["loop_us_per_step"] == pytest.approx(306.0)
    assert got["added_us_per_iteration"] == pytest.approx(6.0)
    assert got["added_us_per_call"] == pytest.approx(30.0)
    assert got["run_loop_host_us_before_launch"] == pytest.approx(40.0)
    assert got[f"while_over_floor_{STEPS}"] == pytest.approx((80 + 306 * STEPS) / (50 + 300 * STEPS))


def test_synthetic_result_gives_the_added_time_per_iteration_and_the_summary_shows_it() -> None:
    n = 4
    timed = Interleaved(
        {
            "replays": [n * 12e-6] * 3,
            "unrolled": [n * 10e-6] * 3,
            "while_inline_u1": [n * 13e-6] * 3,
        }
    )
    result = synthetic_result(timed, n, {"while_child_u1": "RuntimeError: refused"})
    over_unrolled = result["added_us_per_iteration_over_unrolled"]
    assert isinstance(over_unrolled, dict)
    assert over_unrolled == pytest.approx({"replays": 2.0, "while_inline_u1": 3.0})
    over_replays = result["added_us_per_iteration_over_replays"]
    assert isinstance(over_replays, dict)
    assert over_replays["while_inline_u1"] == pytest.approx(1.0)
    manager = {
        "steps": STEPS,
        "model": "m",
        "loop_body_node_types": [{"KERNEL": 40, "MEMSET": 2}],
        "batch8": {"added_us_per_iteration": 6.0, "us_per_call": {}},
    }
    text = summary({"machine": {}, "synthetic_tiny": result, "manager": manager})
    assert "while_inline_u1" in text
    assert "refused" in text
    assert "batch8" in text
    assert "MEMSET" in text
