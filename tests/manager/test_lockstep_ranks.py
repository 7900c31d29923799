"""The lockstep capture (``start_capture()`` with ranks) on 2 ranks over gloo: every rank alike.

Strict refusals follow what the step's exchange saw (never one rank's own
state), a stop on one rank ends every rank's capture in the same step, and a
dropped handle still captures. A rank taking another way than its peer
would leave the peer in a collective: the run's hard timeout fails the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from tests.ranks_support import Result, spawn_ranks

_TIMEOUT_S: Final = 120.0


def test_every_rank_takes_the_same_way_through_a_lockstep_capture(tmp_path: Path) -> None:
    run = spawn_ranks(
        "tests.manager.lockstep_worker", ("scenarios",), world_size=2, timeout_s=_TIMEOUT_S, workdir=tmp_path
    )
    r0, r1 = run.results
    assert "error" not in r0, r0
    assert "error" not in r1, r1
    l0, l1 = _logs(r0), _logs(r1)
    # Idle rank in strict mode: it joins every eager step; the handle was dropped, all 7 keys captured.
    assert l1["strict_idle"] == l0["strict_idle"], (r0, r1)
    assert l0["strict_idle"][-1] == "ok 7", r0
    # A batch above the largest on one rank, while capturing: both ran it eagerly.
    outcomes = [[s.split()[0] for s in logs["strict_large"]] for logs in (l0, l1)]
    assert outcomes == [["ok", "ok"], ["ok", "ok"]], (r0, r1)
    # Until rank 1 starts (its step 2), no rank is allowed an eager step in strict mode: both refuse.
    assert l0["strict_stagger"] == l1["strict_stagger"] == ["NoGraphError"] * 2 + ["ok 1", "ok 2"], (r0, r1)
    # Rank 0 stopped before step 1: that step's exchange ends both captures; nothing captured after.
    assert l0["stop_one"] == l1["stop_one"], (r0, r1)
    assert r0["stop_one_done"] is True, r0
    assert r1["stop_one_done"] is True, r1
    captured = int(l0["stop_one"][-1].split()[1])
    assert r0["stop_one_graphs"] == r1["stop_one_graphs"] == captured, (r0, r1)


def _logs(result: Result) -> dict[str, list[str]]:
    """A rank's per-step logs, by case."""
    return {case: [str(step) for step in log] for case, log in result.items() if isinstance(log, list)}
