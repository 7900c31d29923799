"""Grow and wake a KV cache backed after the capture: host time, and the next step replaying a graph (GPU).

``python -m tests.benchmarks.kv_resize [reference|8b_like] [--gib 10] [--rounds 5] [--json]``

The capture-first start-up of ``examples.kv_sizing`` (the reference
decoder's row cache, default options), then per round:

- **grow**: give ``--gib`` GiB back (a shrink, nothing in use), then time
  ``back_kv_cache(units=...)`` backing them again, then the next decode step
  (replayed, strict) to its end on the device (its wait for the new
  memory's zeroing included);
- **wake**: a sleep that keeps the graphs (``drop_kv_cache()``, timed), then
  time ``back_kv_cache(units=...)`` re-backing ``--gib`` GiB, then the next
  step the same way; then the rest backed again.

Prints each round and, with ``--json``, one line of medians last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Final

import torch

from examples.kv_sizing import DEFAULT_MARGIN_MIB, MODELS, build, decode_step, start_up_capture_first

GIB: Final = 2**30


def _timed(call: Callable[[], object]) -> float:
    """Host seconds of ``call()``."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main(argv: list[str]) -> dict[str, float]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.kv_resize")
    parser.add_argument("model", nargs="?", choices=sorted(MODELS), default="reference")
    parser.add_argument("--gib", type=float, default=10.0, help="GiB to grow by and to re-back at a wake")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    manager, model = build(args.model, "rows", reserved=True)
    kv = model.kv_cache
    assert kv is not None
    rounds: dict[str, list[float]] = {"grow_ms": [], "grow_step_ms": [], "drop_ms": [], "wake_ms": []}
    rounds["wake_step_ms"] = []
    with torch.no_grad():
        sizing = start_up_capture_first(manager, model, DEFAULT_MARGIN_MIB * 2**20)
        print(sizing)
        full = kv.units
        delta = int(args.gib * GIB) // kv.unit_bytes
        decode_step(manager, model)
        torch.cuda.synchronize()

        def step_ms() -> float:
            replays = manager.stats.num_replays
            start = time.perf_counter()
            decode_step(manager, model)
            torch.cuda.synchronize()
            took = time.perf_counter() - start
            assert manager.stats.num_replays == replays + 1, "the step after the change did not replay"
            return took * 1e3

        for index in range(args.rounds):
            manager.back_kv_cache(units=full - delta, in_use=())  # nothing is in use between steps here
            torch.cuda.synchronize()
            rounds["grow_ms"].append(_timed(lambda: manager.back_kv_cache(units=full)) * 1e3)
            rounds["grow_step_ms"].append(step_ms())
            rounds["drop_ms"].append(_timed(manager.drop_kv_cache) * 1e3)
            rounds["wake_ms"].append(_timed(lambda: manager.back_kv_cache(units=kv.min_units + delta)) * 1e3)
            rounds["wake_step_ms"].append(step_ms())
            manager.back_kv_cache(units=full)
            torch.cuda.synchronize()
            print(
                f"round {index}: " + ", ".join(f"{name} {values[-1]:.2f}" for name, values in rounds.items())
            )
        print(manager.stats)
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    figures = {
        **medians,
        "gib": args.gib,
        "rounds": args.rounds,
        "unit_bytes": kv.unit_bytes,
        "chunk_bytes": kv.memory.granularity,
        "kv_gib": full * kv.unit_bytes / GIB,
        "capture_s": sizing.report.seconds,
        "back_s": sizing.back_seconds,
    }
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
