r"""``run()``'s host overhead of two builds in one process: this tree's and an older one's.

Usage: ``python -m tests.benchmarks.ab_step OLD_DIR``, where ``OLD_DIR`` holds
an older commit's three packages renamed ``old_cudagraph_*``, made with::

    git archive REV packages/dispatch/src packages/capture/src packages/manager/src | tar -x -C /tmp/rev
    for p in dispatch capture manager; do
        cp -r /tmp/rev/packages/$p/src/cudagraph_$p OLD_DIR/old_cudagraph_$p; done
    find OLD_DIR -name '*.py' |
        xargs sed -i -E 's/\bcudagraph_(dispatch|capture|manager)\b/old_&/g'

Both managers serve the same one-kernel model (FULL, 64 tokens) and a
two-input model with a request count, and run the same decode loop
(``run_loop``: 8 requests, 64 steps on the device); rounds of calls
alternate between the two builds (``interleave``), so the host's drift
cancels. Prints the median per-call microseconds of each and their ratio
(the median of the per-round ratios) with its spread across rounds.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Final

import torch

from tests.benchmarks.support import interleave

ROUNDS: Final = 60
CALLS: Final = 500
TOKENS: Final = 64
LOOP_REQS: Final = 8
LOOP_STEPS: Final = 64


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2  # [tokens]


def _two(x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    return x * 2 + lens.sum()  # [tokens]


def _managers(prefix: str) -> dict[str, Callable[[], object]]:
    """The steps to time with the build whose modules start with ``prefix``."""
    dispatch: ModuleType = importlib.import_module(f"{prefix}cudagraph_dispatch")
    manager: ModuleType = importlib.import_module(f"{prefix}cudagraph_manager")
    full = dispatch.CUDAGraphMode.FULL
    x = torch.randn(TOKENS, device="cuda")  # [64]
    lens = torch.ones(TOKENS // 4, dtype=torch.int32, device="cuda")  # [16]
    one = manager.CUDAGraphManager(
        _double,
        {"x": manager.StaticInput(shape=(), dtype=torch.float32, rows="tokens")},
        dispatch.DispatchConfig(full, dispatch.CaptureSizes([TOKENS]), max_num_seqs=TOKENS),
    )
    two = manager.CUDAGraphManager(
        _two,
        {
            "x": manager.StaticInput(shape=(), dtype=torch.float32, rows="tokens"),
            "lens": manager.StaticInput(shape=(), dtype=torch.int32, rows="reqs"),
        },
        dispatch.DispatchConfig(full, dispatch.CaptureSizes([TOKENS]), max_num_seqs=TOKENS),
    )
    one.capture()
    two.capture()
    torch.testing.assert_close(one.run(x=x), x * 2)
    torch.testing.assert_close(two.run(x=x, lens=lens), x * 2 + lens.sum())
    loop = _loop_manager(dispatch, manager)
    ids = torch.zeros(LOOP_REQS, dtype=torch.int64, device="cuda")  # [reqs]
    seen = torch.zeros(LOOP_REQS, dtype=torch.int64, device="cuda")  # [reqs]
    assert loop.run_loop(ids=ids, seen=seen).steps == LOOP_STEPS
    return {
        "run() one input": lambda: one.run(x=x),
        "run() tokens and requests": lambda: two.run(x=x, lens=lens),
        f"run_loop() {LOOP_REQS} requests, {LOOP_STEPS} steps": lambda: loop.run_loop(ids=ids, seen=seen),
    }


def _next_ids(ids: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    return ids + 1  # [reqs]


def _advance(out: torch.Tensor, inputs: Mapping[str, torch.Tensor], state: Any) -> None:
    """The next ids in place, this step's tokens at row ``step``, stop after ``LOOP_STEPS`` steps."""
    inputs["ids"].copy_(out)
    state.tokens.index_copy_(0, state.step.view(1), out.view(1, -1))
    state.stop.copy_(state.step >= LOOP_STEPS - 1)


def _loop_manager(dispatch: ModuleType, manager: ModuleType) -> Any:
    """A FULL decode-only manager of ``LOOP_REQS`` requests with a captured decode loop."""
    config = dispatch.DispatchConfig(
        dispatch.CUDAGraphMode.FULL_DECODE_ONLY, dispatch.CaptureSizes([LOOP_REQS]), max_num_seqs=LOOP_REQS
    )
    inputs = {
        "ids": manager.StaticInput(shape=(), dtype=torch.int64, rows="tokens"),
        "seen": manager.StaticInput(shape=(), dtype=torch.int64, rows="reqs"),  # a loop needs request rows
    }
    decode_loop = manager.DecodeLoop(_advance, max_steps=LOOP_STEPS)
    if hasattr(manager, "ManagerOptions"):  # the options' value; an older build took the keyword
        built = manager.CUDAGraphManager(
            _next_ids, inputs, config, options=manager.ManagerOptions(decode_loop=decode_loop)
        )
    else:
        built = manager.CUDAGraphManager(_next_ids, inputs, config, decode_loop=decode_loop)
    built.capture()
    return built


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_dir", help="a folder holding old_cudagraph_dispatch, _capture and _manager")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.old_dir)
    builds = {"before": _managers("old_"), "after": _managers("")}
    for name in builds["after"]:
        calls = {label: build[name] for label, build in builds.items()}
        timed = interleave(calls, rounds=ROUNDS, calls_per_round=CALLS, warmup_rounds=1)
        before, after = (timed.median(k) * 1e6 for k in ("before", "after"))
        ratio, spread = timed.ratio("after", "before"), timed.spread("after", "before")
        print(f"{name}: before {before:.2f} us, after {after:.2f} us, after/before {ratio:.3f} [{spread}]")


if __name__ == "__main__":
    main()
