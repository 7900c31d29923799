r"""``run()``'s host overhead of two builds in one process: this tree's and an older one's.

Usage: ``python -m tests.benchmarks.ab_step OLD_DIR``, where ``OLD_DIR`` holds
an older commit's three packages renamed ``old_cudagraph_*``, made with::

    git archive REV packages/dispatch/src packages/capture/src packages/manager/src | tar -x -C /tmp/rev
    for p in dispatch capture manager; do
        cp -r /tmp/rev/packages/$p/src/cudagraph_$p OLD_DIR/old_cudagraph_$p; done
    find OLD_DIR -name '*.py' |
        xargs sed -i -E 's/\bcudagraph_(dispatch|capture|manager)\b/old_&/g'

Both managers serve the same one-kernel model (FULL, 64 tokens) and a
two-input model with a request count; rounds of calls alternate between the
two builds, so the host's drift cancels. Prints the median per-call
microseconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Final

import torch

ROUNDS: Final = 60
CALLS: Final = 500
TOKENS: Final = 64


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
    return {"one input": lambda: one.run(x=x), "tokens and requests": lambda: two.run(x=x, lens=lens)}


def _round(step: Callable[[], object]) -> float:
    """Seconds per call over ``CALLS`` calls, one synchronization."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_dir", help="a folder holding old_cudagraph_dispatch, _capture and _manager")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.old_dir)
    builds = {"before": _managers("old_"), "after": _managers("")}
    for name in builds["after"]:
        samples: dict[str, list[float]] = {"before": [], "after": []}
        for build in builds.values():  # warm up
            _round(build[name])
        for _ in range(ROUNDS):
            for label, build in builds.items():
                samples[label].append(_round(build[name]))
        before, after = (statistics.median(samples[k]) * 1e6 for k in ("before", "after"))
        ratio = after / before
        print(f"run() {name}: before {before:.2f} us, after {after:.2f} us, after/before {ratio:.3f}")


if __name__ == "__main__":
    main()
