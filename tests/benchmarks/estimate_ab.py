"""The estimate's time over the capture's, and its error, under several rules interleaved (issue 40).

``python -m tests.benchmarks.estimate_ab [--cases A,B] [--rules old,new] [--rounds N] [--deadline S]``:
one process, the cases in turn (``CASES``: the reference decoder in three
modes and plans, a wide 4-layer model with a 32k vocabulary, the paged
gather decoder, the 8B-like preset, the compiled reference), each warmed up
by one estimate, capture and release (as ``tests.benchmarks.memory_estimate``),
then ``--rounds`` rounds of every rule, each round in the reverse order of
the one before: ``estimate_memory()`` (timed), the ``capture()`` it
predicts (timed; the drop of the device's free memory is the truth),
``release()``.

The rules (``RULES``): ``old`` is the estimate before issue 40 (a probe
count of ``1 + max(2, ceil(0.08 * others))``, each mode's smallest key
warmed up), swapped into ``_estimate`` here, not in the package; ``new`` is
the package's (``probe_count``, and FULL_AND_PIECEWISE's twin smallest keys
warmed up once: ``eager_twin``); ``min4`` the package's with at least 4
probes a mode; ``new_count_only`` the package's count, every smallest key
warmed up. Per estimate, the
host time of its phases (no added synchronization: ``_empty_cache``
synchronizes anyway): the warm-ups it measures, the probes (recording,
instantiation and the smallest key's warm-up, from each probe's
``CapturedGraph``), the two ``empty_cache`` calls, the rest. Prints one JSON
line per case, then a summary line per case and rule.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, ManagerOptions, compile_for_capture
from cudagraph_manager._capture import _estimate
from examples.config import DecoderConfig

MIB = 2**20


def old_probe_count(num_keys: int) -> int:
    """The count before issue 40: the largest, then 8% of the others (rounded up), at least 2 of them."""
    others = num_keys - 1
    return 1 + min(others, max(2, math.ceil(0.08 * others)))


def min4_probe_count(num_keys: int) -> int:
    """The package's share with one more probe at the least: one spread between the second and the last."""
    return min(num_keys, max(4, math.floor(_estimate.PROBE_SHARE * num_keys)))


def _no_twins(graph: object) -> None:
    """Before issue 40: no key is another's eager twin, every mode's smallest warms up."""


#: The rules compared (``--rules``): a probe count (None: the package's ``probe_count``), and whether the
#: modes' twin smallest keys warm up once (``_estimate.eager_twin``, the package's) or each (``_no_twins``).
RULES: dict[str, tuple[Callable[[int], int] | None, bool]] = {
    "old": (old_probe_count, False),
    "new": (None, True),
    "min4": (min4_probe_count, True),
    "new_count_only": (None, False),
}


def _wide() -> DecoderConfig:
    return DecoderConfig(
        num_layers=4, hidden_size=2048, num_heads=16, intermediate_size=5632, vocab_size=32000
    )


def _decoder(
    config: Callable[[], DecoderConfig], compiled: bool = False
) -> Callable[[], tuple[Any, Any, Any]]:
    def build() -> tuple[Any, Any, Any]:
        from examples.reference import ReferenceDecoder, static_inputs

        decoder = config()
        model = ReferenceDecoder(decoder, device="cuda", breakable=not compiled)
        inputs = static_inputs(decoder)
        # As tests.benchmarks.memory_estimate: the compiled model's first compile is the warm-up cycle's.
        return (compile_for_capture(model, inputs) if compiled else model.forward), inputs, None

    return build


def _paged(backend: str) -> Callable[[], tuple[Any, Any, Any]]:
    def build() -> tuple[Any, Any, Any]:
        from cudagraph_manager.attention import AttentionOptions
        from examples.paged import PagedDecoder, PagedLayout, paged_static_inputs

        config = DecoderConfig()
        layout = PagedLayout.for_config(config, page_size=64)
        model = PagedDecoder(config, layout=layout, backend=backend, device="cuda")
        model.warm_up(512)
        options: ManagerOptions[Any] = ManagerOptions(
            attention=AttentionOptions(metadata_builder=model.backend)
        )
        return model, paged_static_inputs(model.layout), options

    return build


#: name -> (builder of (runnable, inputs, options), mode, max size); every model takes 256 requests
CASES: dict[str, tuple[Callable[[], tuple[Any, Any, Any]], str, int]] = {  # most telling first
    "reference-FP-512": (_decoder(DecoderConfig), "FULL_AND_PIECEWISE", 512),
    "reference-FULL-512": (_decoder(DecoderConfig), "FULL", 512),
    "wide-FP-512": (_decoder(_wide), "FULL_AND_PIECEWISE", 512),
    "paged_gather-FP-512": (_paged("gather"), "FULL_AND_PIECEWISE", 512),
    "8b_like-FP-512": (_decoder(DecoderConfig.llama_8b_like), "FULL_AND_PIECEWISE", 512),
    "reference-PW-2048": (_decoder(DecoderConfig), "PIECEWISE", 2048),
    "reference-FP-512-compiled": (_decoder(DecoderConfig, compiled=True), "FULL_AND_PIECEWISE", 512),
}


@contextlib.contextmanager
def _rule(name: str) -> Iterator[None]:
    """``_estimate``'s ``probe_count`` and ``eager_twin`` swapped for the rule's (looked up per call)."""
    saved = _estimate.probe_count, _estimate.eager_twin
    count, twins = RULES[name]
    if count is not None:
        setattr(_estimate, "probe_count", count)  # noqa: B010  # a module function, replaced for the run
    if not twins:
        setattr(_estimate, "eager_twin", _no_twins)  # noqa: B010
    try:
        yield
    finally:
        setattr(_estimate, "probe_count", saved[0])  # noqa: B010
        setattr(_estimate, "eager_twin", saved[1])  # noqa: B010


@contextlib.contextmanager
def _phases(spent: dict[str, float]) -> Iterator[None]:
    """The estimate's phases' host seconds added into ``spent`` (no synchronization added)."""
    names = ("measure_warm_ups", "_probe_groups", "_empty_cache", "warm_up")
    saved = {name: getattr(_estimate, name) for name in names}

    def timed(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
                spent[f"{name} calls"] = spent.get(f"{name} calls", 0) + 1

        return run

    for name in names:
        setattr(_estimate, name, timed(name, saved[name]))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(_estimate, name, original)


def _one(manager: CUDAGraphManager[Any], rule: str) -> dict[str, Any]:
    spent: dict[str, float] = {}
    torch.cuda.synchronize()
    with _rule(rule), _phases(spent):
        start = time.perf_counter()
        estimate = manager.estimate_memory()
        estimate_s = time.perf_counter() - start
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    report = manager.capture(progress=False)
    capture_s = time.perf_counter() - start
    measured = free - torch.cuda.mem_get_info()[0]
    manager.release()
    probes = estimate.probes
    return {
        "ratio": estimate_s / capture_s,
        "estimate_ms": 1e3 * estimate_s,
        "capture_ms": 1e3 * capture_s,
        "error_mib": (estimate.total_bytes - measured) / MIB,
        "error_pct": 100 * (estimate.total_bytes - measured) / measured,
        "measured_mib": measured / MIB,
        # Of the error, the driver's part: the estimate's executables against the capture's loss outside
        # torch's allocator (with 3 probes a mode, its mean moves in steps of 2/3 MiB a key).
        "driver_error_mib": (estimate.driver_bytes - report.outside_allocator_bytes) / MIB,
        "report_error_pct": 100 * (report.device_bytes - measured) / measured,
        "graphs": report.num_graphs,
        "probes": len(probes),
        "warmup_mib": estimate.warmup_bytes / MIB,
        "warm_ups": int(spent.get("warm_up calls", 0)),
        "pool_mib": estimate.pool_bytes / MIB,
        "driver_mib": estimate.driver_bytes / MIB,
        # What extrapolate charged the keys not probed (the rest of pool and driver is the probes' own):
        "unprobed_pool_mib": (estimate.pool_bytes - sum(p.pool_bytes for p in probes)) / MIB,
        "unprobed_driver_mib": (estimate.driver_bytes - sum(p.driver_bytes for p in probes)) / MIB,
        "ms": {
            "measure_warm_ups": 1e3 * spent.get("measure_warm_ups", 0.0),  # its empty_cache included
            "probes": 1e3 * spent.get("_probe_groups", 0.0),
            "probe_record": 1e3 * sum(p.recording_seconds for p in probes),
            "probe_instantiate": 1e3 * sum(p.instantiation_seconds for p in probes),
            "probe_warm_up": 1e3 * sum(p.warmup_seconds for p in probes),
            "empty_cache_x2": 1e3 * spent.get("_empty_cache", 0.0),
        },
        "capture_ms_split": {
            "warm_up": 1e3 * report.phases.warmup,
            "record": 1e3 * report.phases.recording,
            "instantiate": 1e3 * report.phases.instantiation,
        },
        "probe_keys": [
            (
                p.mode.name,
                p.descriptor.num_tokens,
                round(p.pool_bytes / MIB, 2),
                round(p.driver_bytes / MIB, 2),
            )
            for p in probes
        ],
    }


def run_case(name: str, rounds: int, rules: list[str]) -> dict[str, Any]:
    build, mode_name, max_size = CASES[name]
    torch.manual_seed(0)
    started = time.perf_counter()
    runnable, inputs, options = build()
    mode = CUDAGraphMode[mode_name]
    config = DispatchConfig(mode, CaptureSizes.default(max_size), max_num_seqs=256)
    manager = CUDAGraphManager(runnable, inputs, config, options=options)
    runs: dict[str, list[dict[str, Any]]] = {rule: [] for rule in rules}
    with torch.no_grad():
        manager.estimate_memory()  # the warm-up cycle: nothing below pays for a first use
        manager.capture(progress=False)
        manager.release()
        for i in range(rounds):  # ABBA...: each round reversed after the one before
            for rule in rules if i % 2 == 0 else rules[::-1]:
                runs[rule].append(_one(manager, rule))
    del manager, runnable, inputs, options
    gc.collect()
    torch.cuda.empty_cache()
    out: dict[str, Any] = {"case": name, "seconds": round(time.perf_counter() - started, 2)}
    for rule, results in runs.items():
        out[rule] = {
            "ratio_median": statistics.median(r["ratio"] for r in results),
            "ratios": [round(r["ratio"], 4) for r in results],
            "errors_mib": [round(r["error_mib"], 2) for r in results],
            "errors_pct": [round(r["error_pct"], 3) for r in results],
            "driver_errors_mib": [round(r["driver_error_mib"], 2) for r in results],
            "unprobed_pool_mib": [round(r["unprobed_pool_mib"], 2) for r in results],
            "unprobed_driver_mib": [round(r["unprobed_driver_mib"], 2) for r in results],
            "probes": results[0]["probes"],
            "warm_ups": results[0]["warm_ups"],
            "warmup_mib": [round(r["warmup_mib"], 2) for r in results],
            "graphs": results[0]["graphs"],
            "estimate_ms_median": statistics.median(r["estimate_ms"] for r in results),
            "capture_ms_median": statistics.median(r["capture_ms"] for r in results),
            "phase_ms_median": {
                k: round(statistics.median(r["ms"][k] for r in results), 3) for k in results[0]["ms"]
            },
            "capture_split_ms": {k: round(v, 2) for k, v in results[0]["capture_ms_split"].items()},
            "runs": results,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rules", default="old,new", help=f"of {', '.join(RULES)}")
    parser.add_argument("--deadline", type=float, default=75.0, help="start no case after this many seconds")
    parser.add_argument("--json", default=None, help="also write every case's JSON here")
    args = parser.parse_args()
    begin = time.perf_counter()
    results: list[dict[str, Any]] = []
    for name in args.cases.split(","):
        if time.perf_counter() - begin > args.deadline:
            print(f"skipped {name}: past the deadline", flush=True)
            continue
        try:
            result = run_case(name, args.rounds, args.rules.split(","))
        except Exception as error:  # one case's failure (memory, a compile) must not hide the others
            print(f"failed {name}: {type(error).__name__}: {error}"[:300], flush=True)
            result = None
        if result is None:  # the failed case's frames are gone with its error: free what they held
            gc.collect()
            torch.cuda.empty_cache()
            continue
        results.append(result)
        for rule in args.rules.split(","):
            r = result[rule]
            print(
                f"{name:26s} {rule}: ratio {r['ratio_median']:.3f} {r['ratios']}"
                f" probes {r['probes']}/{r['graphs']} warm-ups {r['warm_ups']} ({r['warmup_mib'][0]} MiB)"
                f" err MiB {r['errors_mib']} % {r['errors_pct']} (driver {r['driver_errors_mib']})"
                f" est {r['estimate_ms_median']:.1f} ms"
                f" cap {r['capture_ms_median']:.0f} ms phases {r['phase_ms_median']}"
                f" unprobed charge pool {r['unprobed_pool_mib'][0]} driver {r['unprobed_driver_mib'][0]} MiB",
                flush=True,
            )
        if args.json:
            with open(args.json, "a") as sink:
                sink.write(json.dumps(result) + "\n")
    total = time.perf_counter() - begin
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} total {total:.1f} s")


if __name__ == "__main__":
    main()
