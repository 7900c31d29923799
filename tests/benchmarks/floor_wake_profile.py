"""Phase-by-phase profile of the wake, the memory estimate and the cold capture (issue 40, items 5 and 6).

A profiling script, never imported by the packages: it wraps the packages'
own functions (monkeypatching their module globals) with ``perf_counter``,
CUDA events or ``synchronize`` around each phase, so the hot path of the
code under test is unchanged. Three commands, each printing one JSON line:

- ``wake --model reference|8b_like``: per wake (``release()``, eager steps
  asleep, ``start_capture()``, the first step): ``start_capture()``'s host
  time, the warm-ups it ran (keys, host and device ms, the thread), the
  first step's enqueue and its wait for the device, the time to the first
  replayed step; interleaved, the warm-up rule of today (``kept``: a wake
  with the weights kept skips the smallest warm-ups where dynamo is
  loaded) against the old one (never skipped where dynamo is loaded).
  ``--dynamo`` imports ``torch._dynamo`` first, as a process that compiles
  anything has it.
- ``estimate --model reference|8b_like --max-size N``: in a warm process (as
  ``tests.benchmarks.memory_estimate``), the estimate's phases (the first
  ``empty_cache``, each warm-up, each probe's recording, the final freeing)
  synchronized one by one, its untimed-phase total, the capture it predicts,
  and, from that capture's per-key bytes, the error and time share that
  other probe shares would have had (``pick_probes`` + ``extrapolate`` on
  the capture's figures: an approximation of the probes, which record into
  a pool of their own).
- ``cold --backend varlen|flex``: the paged decoder (the default config),
  its first capture in this process: per key the warm-up's device time, the
  attention builder's share, dynamo's compiles and recompiles during it;
  then warm recaptures and one without warm-ups (``warmup_runs=0``: record +
  instantiate + bookkeeping, the floor's proxy; the report's recording +
  instantiation is the floor itself). Run twice with the same
  ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR``: the second is a cold
  process with the libraries' on-disk caches warm. ``--warm-ups``: the
  first capture's ``ManagerOptions.warm_ups`` (``every_key``: before issue
  40's per-class warm-ups; compare the two in separate processes, alternating).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cudagraph_capture import CaptureOptions
from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CaptureReport, CUDAGraphManager, ManagerOptions
from cudagraph_manager._graphs import _capturer, _estimate, _recording, _warm_up
from examples.config import DecoderConfig
from tests.benchmarks.support import patched

MODELS = {"reference": DecoderConfig, "8b_like": DecoderConfig.llama_8b_like}
FIRST_BATCH = 32  # the wake's first step (tests/benchmarks/test_bench_sleep.py's BATCHES[0])
OTHER_BATCHES = (1, 8, 64, 128, 256, 16, 100)


def _sync() -> None:
    torch.cuda.synchronize()


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


# -- wake --------------------------------------------------------------------------------------


def wake(model_name: str, cycles: int, dynamo: bool) -> dict[str, Any]:
    from examples.inputs import make_step_inputs
    from examples.reference import ReferenceDecoder, static_inputs

    if dynamo:
        import torch._dynamo  # loaded, as in any process that compiles something
    torch.manual_seed(0)
    config = MODELS[model_name]()
    model = ReferenceDecoder(config, device="cuda")
    mode = CUDAGraphMode.FULL_AND_PIECEWISE
    manager = CUDAGraphManager(
        model.forward,
        static_inputs(config),
        DispatchConfig(mode, CaptureSizes.default(256), max_num_seqs=config.max_num_seqs),
    )
    gen = torch.Generator().manual_seed(1)
    batches = (FIRST_BATCH, *OTHER_BATCHES)
    inputs = [make_step_inputs(config, n, uniform_decode=True, generator=gen, device="cuda") for n in batches]
    serving = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    warm_ups: list[dict[str, Any]] = []
    rule = {"old": False}

    def timed_warm_up(original: Callable[..., None]) -> Callable[..., None]:
        def run(graph: Any, engine: Any, buffers: Any) -> None:
            begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped stubs
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped stubs
            begin.record()
            start = time.perf_counter()
            original(graph, engine, buffers)
            host = time.perf_counter() - start
            end.record()
            warm_ups.append(
                {
                    "key": str(graph.descriptor),
                    "host_ms": _ms(host),
                    "events": (begin, end),
                    "thread": threading.current_thread().name,
                }
            )

        return run

    def rule_switch(original: Callable[..., bool]) -> Callable[..., bool]:
        def has(self: Any, *, weights_kept: bool = False) -> bool:
            return bool(original(self, weights_kept=weights_kept and not rule["old"]))

        return has

    def step(i: int) -> None:
        manager.run_batch(inputs[i % len(inputs)], uniform_decode=True)

    def host_timed(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    warm_ups.append({"phase": name, "host_ms": _ms(time.perf_counter() - start)})

            return run

        return wrap

    rows: list[dict[str, Any]] = []
    with (
        torch.no_grad(),
        torch.cuda.stream(serving),
        patched(_capturer, "warm_up", timed_warm_up),
        patched(_warm_up.WarmUpRule, "thread_has_handles", rule_switch),
        patched(_capturer.Capturer, "begin", host_timed("begin (weights.take)")),
        patched(_capturer.Capturer, "start_totals", host_timed("start_totals")),
    ):
        for i in range(3 * len(inputs)):
            step(i)
        eager = []
        for _ in range(10):
            _sync()
            start = time.perf_counter()
            step(0)
            serving.synchronize()
            eager.append(time.perf_counter() - start)
        manager.capture(progress=False)
        for cycle in range(1 + 2 * cycles):  # the first: the worker's first session (its handles)
            rule["old"] = cycle % 2 == 0  # interleaved after it: the old rule, then today's
            rows.append(_one_wake(manager, serving, step, warm_ups, rule["old"]))
        manager.release()
    eager_ms = statistics.median(eager) * 1e3
    summary: dict[str, Any] = {
        "command": "wake",
        "model": model_name,
        "dynamo_loaded": "torch._dynamo.utils" in sys.modules,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "eager_step_ms": round(eager_ms, 4),
    }
    for old in (False, True):
        of = [r for r in rows[1:] if r["old_rule"] is old]
        tag = "old_rule" if old else "new_rule"
        for field in ("release_ms", "start_host_ms", "step_enqueue_ms", "step_wait_ms", "first_step_ms"):
            summary[f"{tag}_{field}"] = round(statistics.median(r[field] for r in of), 4)
        summary[f"{tag}_first_step_minus_eager_ms"] = round(summary[f"{tag}_first_step_ms"] - eager_ms, 4)
        summary[f"{tag}_first_replay_ms"] = round(statistics.median(r["first_replay_ms"] for r in of), 4)
        summary[f"{tag}_warm_ups_per_wake"] = statistics.median(len(r["warm_ups"]) for r in of)
    summary["first_wake_first_step_minus_eager_ms"] = round(rows[0]["first_step_ms"] - eager_ms, 4)
    summary["wakes"] = rows
    return summary


def _one_wake(
    manager: CUDAGraphManager[torch.Tensor],
    serving: torch.cuda.Stream,
    step: Callable[[int], None],
    warm_ups: list[dict[str, Any]],
    old: bool,
) -> dict[str, Any]:
    for i in range(20):
        step(i)  # replays
    _sync()
    start = time.perf_counter()
    manager.release()
    release = time.perf_counter() - start
    for i in range(3):
        step(i)  # asleep, eager
    _sync()
    warm_ups.clear()
    start = time.perf_counter()
    handle = manager.start_capture()
    started = time.perf_counter()
    step(0)
    enqueued = time.perf_counter()
    serving.synchronize()
    done = time.perf_counter()
    served, replays = 1, manager.stats.num_replays
    first_replay = float("nan")
    while served < 200:
        step(served)
        serving.synchronize()
        served += 1
        if manager.stats.num_replays > replays:
            first_replay = time.perf_counter() - start
            break
    handle.wait(600)
    _sync()
    ran = [
        {
            "key": w["key"],
            "host_ms": w["host_ms"],
            "device_ms": round(w["events"][0].elapsed_time(w["events"][1]), 4),
            "thread": w["thread"],
        }
        for w in warm_ups
        if "events" in w
    ]
    # The host phases before the first step (the first start_totals: the session's own).
    host = {w["phase"]: w["host_ms"] for w in reversed(warm_ups) if "phase" in w}
    return {
        "old_rule": old,
        "weights_kept": manager._capturer.weights.kept,
        "release_ms": _ms(release),
        "start_host_ms": _ms(started - start),
        "step_enqueue_ms": _ms(enqueued - started),
        "step_wait_ms": _ms(done - enqueued),
        "first_step_ms": _ms(done - start),
        "first_replay_ms": _ms(first_replay),
        "steps_to_first_replay": served,
        "warm_ups": ran,
        "host_phases_ms": host,
        "errors": [repr(e) for e in handle.errors],
    }


# -- estimate ----------------------------------------------------------------------------------


def estimate(model_name: str, max_size: int, mode_name: str) -> dict[str, Any]:
    from examples.reference import ReferenceDecoder, static_inputs

    torch.manual_seed(0)
    config = MODELS[model_name]()
    model = ReferenceDecoder(config, device="cuda")
    dispatch = DispatchConfig(
        CUDAGraphMode[mode_name], CaptureSizes.default(max_size), max_num_seqs=config.max_num_seqs
    )
    manager = CUDAGraphManager(model.forward, static_inputs(config), dispatch)
    phases: list[tuple[str, float]] = []

    def timed(label: Callable[..., str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                _sync()
                start = time.perf_counter()
                result = original(*args, **kwargs)
                _sync()
                phases.append((label(*args, **kwargs), time.perf_counter() - start))
                return result

            return run

        return wrap

    with torch.no_grad():
        manager.estimate_memory()  # the warm-up cycle, as memory_estimate.py
        manager.capture(progress=False)
        manager.release()
        _sync()
        start = time.perf_counter()
        plain = manager.estimate_memory()
        plain_s = time.perf_counter() - start
        with (
            patched(_estimate, "_empty_cache", timed(lambda *a, **k: "empty_cache+sync")),
            patched(_estimate, "warm_up", timed(lambda g, *a, **k: f"warm_up {g.mode.name} {g.num_tokens}")),
            patched(_estimate, "record", timed(lambda g, *a, **k: f"record {g.mode.name} {g.num_tokens}")),
        ):
            _sync()
            start = time.perf_counter()
            manager.estimate_memory()
            phased_s = time.perf_counter() - start
        _sync()
        free = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        report = manager.capture(progress=False)
        capture_s = time.perf_counter() - start
        measured = free - torch.cuda.mem_get_info()[0]
    grouped: dict[str, float] = {}
    for label, seconds in phases:
        kind = label.split(" ")[0]
        grouped[kind] = grouped.get(kind, 0.0) + seconds
    return {
        "command": "estimate",
        "model": model_name,
        "mode": mode_name,
        "max_size": max_size,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "graphs": report.num_graphs,
        "estimate_s": round(plain_s, 5),
        "capture_s": round(capture_s, 5),
        "estimate_over_capture": round(plain_s / capture_s, 4),
        "estimate_error_pct": round(100 * (plain.total_bytes - measured) / measured, 3),
        "probes": len(plain.probes),
        "phased_estimate_s": round(phased_s, 5),
        "phase_totals_ms": {k: _ms(v) for k, v in grouped.items()},
        "phased_rest_ms": _ms(phased_s - sum(grouped.values())),
        "phases_ms": [(label, _ms(s)) for label, s in phases],
        "capture_phases": str(report.phases),
        "probe_share_simulation": _simulate_shares(report, measured, capture_s),
    }


def _simulate_shares(report: CaptureReport, measured: int, capture_s: float) -> dict[str, Any]:
    """Pool + driver bytes and the recordings' time share that other probe shares would give.

    From the capture's own per-key figures (largest first per mode): an
    approximation of the probes (they record into a pool of their own).
    The warm-up bytes are the capture's measured drop minus its graphs' bytes.
    """
    by_mode: dict[CUDAGraphMode, list[Any]] = {}
    for graph in report.graphs:
        if not graph.loop:
            by_mode.setdefault(graph.mode, []).append(graph)
    graphs_bytes = sum(g.pool_bytes + g.driver_bytes for g in report.graphs)
    out: dict[str, Any] = {}
    for share in (0.08, 0.06, 0.04, 0.03, 0.02, 0.0):
        for minimum in (2, 3):
            total, seconds, count = 0, 0.0, 0
            with _constants(PROBE_SHARE=share, MIN_PROBES=minimum):
                for graphs in by_mode.values():
                    picked = _estimate.pick_probes(graphs, lambda g: g.descriptor.num_tokens)
                    pool, driver = _estimate.extrapolate(
                        [(g.pool_bytes, g.driver_bytes) for g in picked], len(graphs)
                    )
                    total += pool + driver
                    seconds += sum(g.recording_seconds + g.instantiation_seconds for g in picked)
                    count += len(picked)
            error = (total - graphs_bytes) / measured  # the graphs' part of the estimate
            out[f"share={share},min={minimum}"] = {
                "probes": count,
                "graphs_error_pct": round(100 * error, 3),
                "probe_record_over_capture": round(seconds / capture_s, 4),
            }
    return out


@contextlib.contextmanager
def _constants(**values: float) -> Iterator[None]:
    """``_estimate``'s module constants set to ``values`` (``pick_probes`` reads them per call)."""
    saved = {name: getattr(_estimate, name) for name in values}
    for name, value in values.items():
        setattr(_estimate, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(_estimate, name, value)


# -- cold ----------------------------------------------------------------------------------------


def cold(
    backend: str, max_size: int, mode_name: str, recompile_log: bool, plain: bool, warm_ups: str = "auto"
) -> dict[str, Any]:
    from cudagraph_manager._compiled import dynamo_compiles
    from cudagraph_manager.attention import AttentionOptions
    from examples.paged import PagedDecoder, PagedLayout, paged_static_inputs

    if recompile_log:
        torch._logging.set_logs(recompiles=True)  # type: ignore[attr-defined]  # not re-exported in the stubs
    started = time.perf_counter()
    torch.manual_seed(0)
    config = DecoderConfig()
    layout = PagedLayout.for_config(config, page_size=64)
    model = PagedDecoder(config, layout=layout, backend=backend, device="cuda")
    _sync()
    built_s = time.perf_counter() - started
    start = time.perf_counter()
    model.warm_up(max_size)  # its attention's shape classes compiled, as the paged bench's fixture
    _sync()
    class_warm_up_s = time.perf_counter() - start
    dispatch = DispatchConfig(
        CUDAGraphMode[mode_name], CaptureSizes.default(max_size), max_num_seqs=config.max_num_seqs
    )

    def make(runs: int) -> CUDAGraphManager[torch.Tensor]:
        return CUDAGraphManager(
            model,
            paged_static_inputs(model.layout),
            dispatch,
            strict=True,
            options=ManagerOptions(
                attention=AttentionOptions(metadata_builder=model.backend),
                capture=CaptureOptions(warmup_runs=runs),
                warm_ups=warm_ups,  # type: ignore[arg-type]  # the command line's name, checked there
            ),
        )

    per_key: list[dict[str, Any]] = []
    spent = [0.0]
    manager = make(1)
    compiles_before = dynamo_compiles()
    with torch.no_grad():
        phased = contextlib.ExitStack()
        if not plain:  # synchronized per warm-up and per build: the cold figure is an upper bound
            phased.enter_context(patched(_recording, "warm_up", _timed_cold_warm_up(per_key, spent)))
            phased.enter_context(patched(type(model.backend), "build", _timed_build(spent)))
        with phased:
            _sync()
            start = time.perf_counter()
            report = manager.capture(progress=False)
            cold_s = time.perf_counter() - start
        # Every key warmed up again, now warm: its first-use cost is the cold wall minus this one.
        again: list[dict[str, Any]] = []
        timed_again = _timed_cold_warm_up(again, spent)(_recording.warm_up)
        with patched(type(model.backend), "build", _timed_build(spent)):
            for graph in () if plain else manager._table.graphs.values():
                timed_again(graph, manager._capturer._engines[graph.mode], manager._parts.buffers)
        warm = []
        for _ in range(2):
            manager.clear()
            _sync()
            start = time.perf_counter()
            manager.capture(progress=False)
            warm.append(time.perf_counter() - start)
        bare = make(0)
        _sync()
        start = time.perf_counter()
        floor_report = bare.capture(progress=False)
        bare_s = time.perf_counter() - start
        bare.release()
        manager.release()
    floor_s = floor_report.phases.recording + floor_report.phases.instantiation
    return {
        "command": "cold",
        "backend": backend,
        "mode": mode_name,
        "plain": plain,
        "warm_ups": warm_ups,
        "dynamo_compiles_before_capture": compiles_before,
        "keys_warmed_up": sum(1 for g in report.graphs if g.warmup_seconds > 0),
        "cold_warm_up_s": round(report.phases.warmup, 4),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "graphs": report.num_graphs,
        "build_s": round(built_s, 4),
        "class_warm_up_s": round(class_warm_up_s, 4),
        "cold_capture_s": round(cold_s, 4),
        "cold_phases": str(report.phases),
        "warm_capture_s": round(min(warm), 4),
        "no_warm_up_capture_s": round(bare_s, 4),
        "floor_record_instantiate_s": round(floor_s, 4),
        "cold_over_floor": round(cold_s / floor_s, 3),
        "cold_over_no_warm_up": round(cold_s / bare_s, 3),
        "warm_over_floor": round(min(warm) / floor_s, 3),
        "warm_up_wall_ms_sum": round(sum(k["wall_ms"] for k in per_key), 3),
        "builder_ms_sum": round(sum(k["builder_ms"] for k in per_key), 3),
        "compiles_during_warm_ups": sum(k["compiles"] for k in per_key),
        "warm_warm_up_wall_ms_sum": round(sum(k["wall_ms"] for k in again), 3),
        "first_use_ms_sum": round(sum(_first_use(per_key, again).values()), 3),
        "slowest_warm_ups": sorted(per_key, key=lambda k: -k["wall_ms"])[:12],
        "first_use_ms": sorted(_first_use(per_key, again).items(), key=lambda kv: -kv[1])[:12],
        "warm_per_key": again,
        "per_key": per_key,
    }


def _first_use(cold: list[dict[str, Any]], warm: list[dict[str, Any]]) -> dict[str, float]:
    """Per key, the cold warm-up's wall minus the same key's warm one (ms): its first-use cost."""
    again = {(k["mode"], k["tokens"], k["reqs"]): k["wall_ms"] for k in warm}
    return {
        f"{k['mode']} {k['tokens']}": round(k["wall_ms"] - again[(k["mode"], k["tokens"], k["reqs"])], 3)
        for k in cold
        if (k["mode"], k["tokens"], k["reqs"]) in again
    }


def _timed_cold_warm_up(per_key: list[dict[str, Any]], spent: list[float]) -> Callable[..., Any]:
    """``_recording.warm_up`` synchronized around, with dynamo's compiles and the builder's share."""
    from cudagraph_manager._compiled import dynamo_compiles

    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        def run(graph: Any, engine: Any, buffers: Any) -> None:
            compiles = dynamo_compiles() or 0
            spent[0] = 0.0
            _sync()
            start = time.perf_counter()
            original(graph, engine, buffers)
            _sync()
            per_key.append(
                {
                    "mode": graph.mode.name,
                    "tokens": graph.num_tokens,
                    "reqs": graph.num_reqs,
                    "wall_ms": _ms(time.perf_counter() - start),
                    "builder_ms": _ms(spent[0]),
                    "compiles": (dynamo_compiles() or 0) - compiles,
                }
            )

        return run

    return wrap


def _timed_build(spent: list[float]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The builder's ``build`` synchronized around (never inside a recording), its seconds in ``spent``."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def build(*args: Any, **kwargs: Any) -> Any:
            if torch.cuda.is_current_stream_capturing():
                return original(*args, **kwargs)
            _sync()
            start = time.perf_counter()
            result = original(*args, **kwargs)
            _sync()
            spent[0] += time.perf_counter() - start
            return result

        return build

    return wrap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wake")
    w.add_argument("--model", choices=sorted(MODELS), default="reference")
    w.add_argument("--cycles", type=int, default=3)
    w.add_argument("--dynamo", action="store_true")
    e = sub.add_parser("estimate")
    e.add_argument("--model", choices=sorted(MODELS), default="reference")
    e.add_argument("--max-size", type=int, default=512)
    e.add_argument("--mode", default="FULL_AND_PIECEWISE")
    c = sub.add_parser("cold")
    c.add_argument("--backend", choices=["varlen", "flex", "gather", "split_decode"], default="varlen")
    c.add_argument("--max-size", type=int, default=512)
    c.add_argument("--mode", default="FULL")
    c.add_argument("--recompile-log", action="store_true")
    c.add_argument("--plain", action="store_true", help="no synchronization per warm-up: the cold figure")
    c.add_argument("--warm-ups", choices=["auto", "every_key", "per_class"], default="auto")
    args = parser.parse_args()
    if args.command == "wake":
        result = wake(args.model, args.cycles, args.dynamo)
    elif args.command == "estimate":
        result = estimate(args.model, args.max_size, args.mode)
    else:
        result = cold(args.backend, args.max_size, args.mode, args.recompile_log, args.plain, args.warm_ups)
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
