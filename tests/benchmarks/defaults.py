"""Start-up, wake and the estimate as a user meets them (issue 49): one command per figure, one JSON line.

Each command builds what a user builds with the defaults (``DecoderConfig()``,
``CaptureSizes.default(512)``, ``ManagerOptions()`` but for the attention's
builder) and times the call the user makes; the phase breakdowns say what is
still slow. ``tests/benchmarks/test_bench_defaults.py`` runs them in fresh
processes, the variants of a comparison alternating, and reports each ratio
beside its target.

- ``cold --backend flex|varlen [--page-size N] [--old] [--warm-ups P] [--profile]``:
  the paged decoder's first ``capture()`` in this process (FULL, 51 keys)
  against its floor, a warm recapture's recording + instantiation. Per key
  the cold and the warm recording, dynamo's compiles in the warm-ups and in
  the recordings (none may compile in a recording). ``--old``: flex as
  before issue 49 (no compile classes, dynamo's duck sizing: ``"auto"`` then
  warms every key). ``--profile``: where the cold capture's host time goes
  that the warm recapture's does not (cProfile, per function).
- ``wake [--cycles N]``: a wake as an engine does it, on a side stream:
  ``release()``, then ``start_capture()`` and at once ``run()`` of 200
  tokens; the wall time from before ``start_capture()`` until the output is
  synchronized, against a warm eager step and, in the cycles between, against
  the same step run eagerly right after ``release()`` (the allocator's cache
  emptied: what the step pays for its memory). The small decoder (4 layers,
  d=512), FULL, 51 keys: the first wake (the capture worker's first session
  for the manager) apart.
- ``estimate [--cases A,B] [--rounds N]``: ``estimate_memory()`` in a warm
  process against the warm recapture it predicts, for the probes' rule (the
  default) and the predicted rule issue 49 tried, alternating (AB, then BA):
  time over the capture's and the error against the drop of free memory.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Final

import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CaptureReport, CUDAGraphManager, ManagerOptions
from cudagraph_manager._compiled import dynamo_compiles
from cudagraph_manager._graphs import _capturer, _estimate, _recording
from examples.config import DecoderConfig
from tests.benchmarks.support import patched

MIB: Final = 2**20
MAX_SIZE: Final = 512
WAKE_TOKENS: Final = 200
#: The small decoder of ``serve_from_step0`` (4 layers, d=512): an eager step of ~1 ms.
SMALL: Final = DecoderConfig(
    num_layers=4,
    hidden_size=512,
    num_heads=8,
    intermediate_size=1408,
    max_num_seqs=512,
    max_seq_len=64,
)


def _sync() -> None:
    torch.cuda.synchronize()


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


# -- cold capture --------------------------------------------------------------------------------


def _paged_manager(
    backend: str, page_size: int, warm_ups: str, old: bool
) -> tuple[CUDAGraphManager[torch.Tensor], Any]:
    from cudagraph_manager.attention import AttentionOptions
    from examples.paged import PagedDecoder, PagedLayout, paged_static_inputs

    config = DecoderConfig()
    model = PagedDecoder(
        config, layout=PagedLayout.for_config(config, page_size=page_size), backend=backend, device="cuda"
    )
    if old and backend == "flex":  # before issue 49: no compile classes, duck sizing
        from examples.paged import flex_kernel

        flex_kernel.DUCK_SHAPE = True
        # The A/B's old side: the attention declares no compile class.
        type.__setattr__(type(model.backend), "compile_class", None)
    dispatch = DispatchConfig(
        CUDAGraphMode.FULL, CaptureSizes.default(MAX_SIZE), max_num_seqs=config.max_num_seqs
    )
    options: ManagerOptions[torch.Tensor] = ManagerOptions(
        attention=AttentionOptions(metadata_builder=model.backend),
        warm_ups=warm_ups,  # type: ignore[arg-type]  # the command line's name, checked by argparse
    )
    return CUDAGraphManager(model, paged_static_inputs(model.layout), dispatch, options=options), model


def cold(backend: str, page_size: int, old: bool, warm_ups: str, profile: bool) -> dict[str, Any]:
    """The first ``capture()`` of the process against a warm recapture's recording + instantiation."""
    started = time.perf_counter()
    torch.manual_seed(0)
    manager, _ = _paged_manager(backend, page_size, warm_ups, old)
    _sync()
    built_s = time.perf_counter() - started
    in_recordings: list[tuple[int, int, float]] = []  # (tokens, compiles, seconds) per recording

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def record(graph: Any, *args: Any, **kwargs: Any) -> Any:
            before, start = dynamo_compiles() or 0, time.perf_counter()
            try:
                return original(graph, *args, **kwargs)
            finally:
                compiled = (dynamo_compiles() or 0) - before
                in_recordings.append((graph.num_tokens, compiled, time.perf_counter() - start))

        return record

    cold_profile, warm_profile = cProfile.Profile(), cProfile.Profile()
    with torch.no_grad(), patched(_recording, "record", counted):
        compiles_before = dynamo_compiles() or 0
        _sync()
        if profile:
            cold_profile.enable()
        start = time.perf_counter()
        report = manager.capture(progress=False)
        cold_s = time.perf_counter() - start
        if profile:
            cold_profile.disable()
        cold_recordings = list(in_recordings)
        warm: list[tuple[float, CaptureReport]] = []
        for round_ in range(2):
            manager.clear()
            _sync()
            if profile and round_ == 0:
                warm_profile.enable()
            start = time.perf_counter()
            again = manager.capture(progress=False)
            warm.append((time.perf_counter() - start, again))
            if profile and round_ == 0:
                warm_profile.disable()
        manager.release()
    floors = [r.phases.recording + r.phases.instantiation for _, r in warm]
    floor = min(floors)
    warm_recording = {g.descriptor: g.recording_seconds for g in warm[-1][1].graphs}
    per_key = [
        {
            "tokens": g.descriptor.num_tokens,
            "warm_up_ms": _ms(g.warmup_seconds),
            "recording_ms": _ms(g.recording_seconds),
            "first_use_in_recording_ms": _ms(g.recording_seconds - warm_recording.get(g.descriptor, 0.0)),
        }
        for g in report.graphs
    ]
    result: dict[str, Any] = {
        "command": "cold",
        "backend": backend,
        "page_size": page_size,
        "old": old,
        "warm_ups": warm_ups,
        # Byte code cached on disk (as after a pip install): imports in a fresh process read it.
        "bytecode_cache": not sys.flags.dont_write_bytecode,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "graphs": report.num_graphs,
        "build_s": round(built_s, 4),
        "cold_s": round(cold_s, 4),
        "floor_s": round(floor, 4),
        "cold_over_floor": round(cold_s / floor, 3),
        "cold_phases": str(report.phases),
        "cold_warm_up_s": round(report.phases.warmup, 4),
        "cold_recording_s": round(report.phases.recording, 4),
        "cold_instantiation_s": round(report.phases.instantiation, 4),
        "warm_capture_s": round(min(s for s, _ in warm), 4),
        "warm_phases": str(warm[-1][1].phases),
        "keys_warmed_up": sum(1 for g in report.graphs if g.warmup_seconds > 0),
        "warmed_tokens": [g.descriptor.num_tokens for g in report.graphs if g.warmup_seconds > 0],
        "compiles_in_capture": (dynamo_compiles() or 0) - compiles_before
        if report.compiles is None
        else report.compiles,
        "compiles_in_recordings": sum(c for _, c, _ in cold_recordings),
        "recordings_that_compiled": [t for t, c, _ in cold_recordings if c],
        "first_use_in_recordings_ms": round(sum(k["first_use_in_recording_ms"] for k in per_key), 1),
        "slowest_first_uses": sorted(per_key, key=lambda k: -k["first_use_in_recording_ms"])[:8],
        "per_key": per_key,
    }
    if profile:
        result["cold_minus_warm_host_ms"] = _profile_diff(cold_profile, warm_profile)
    return result


def _profile_diff(cold_run: cProfile.Profile, warm_run: cProfile.Profile, top: int = 15) -> list[Any]:
    """The functions whose own host time (cProfile's tottime) the cold capture spent beyond the warm one."""
    cold_stats: dict[Any, Any] = pstats.Stats(cold_run).stats  # type: ignore[attr-defined]  # untyped in typeshed
    warm_stats: dict[Any, Any] = pstats.Stats(warm_run).stats  # type: ignore[attr-defined]  # untyped in typeshed
    rows = []
    for key, (_, calls, tottime, _, _) in cold_stats.items():
        warm_tottime = warm_stats.get(key, (0, 0, 0.0, 0, {}))[2]
        file, line, name = key
        rows.append((tottime - warm_tottime, f"{file.rsplit('/', 2)[-1]}:{line}:{name}", calls))
    rows.sort(reverse=True)
    return [(where, _ms(extra), calls) for extra, where, calls in rows[:top]]


# -- wake ----------------------------------------------------------------------------------------


def wake(cycles: int) -> dict[str, Any]:
    """Wakes as an engine does them (see the module), interleaved with eager steps right after a release."""
    from examples.inputs import make_step_inputs
    from examples.reference import ReferenceDecoder, static_inputs

    torch.manual_seed(0)
    model = ReferenceDecoder(SMALL, device="cuda")
    dispatch = DispatchConfig(
        CUDAGraphMode.FULL, CaptureSizes.default(MAX_SIZE), max_num_seqs=SMALL.max_num_seqs
    )
    manager = CUDAGraphManager(model.forward, static_inputs(SMALL), dispatch)
    generator = torch.Generator().manual_seed(1)
    step_inputs = make_step_inputs(
        SMALL, WAKE_TOKENS, uniform_decode=True, generator=generator, device="cuda"
    )
    others = [
        make_step_inputs(SMALL, n, uniform_decode=True, generator=generator, device="cuda")
        for n in (1, 8, 64)
    ]
    serving = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    warm_ups: list[str] = []

    def counted(original: Callable[..., None]) -> Callable[..., None]:
        def run(graph: Any, *args: Any) -> None:
            warm_ups.append(f"{graph.mode.name} {graph.num_tokens}")
            original(graph, *args)

        return run

    def step(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return manager.run_batch(inputs, uniform_decode=True)

    rows: list[dict[str, Any]] = []
    with (
        torch.no_grad(),
        torch.cuda.stream(serving),
        patched(_capturer, "warm_up", counted),
    ):
        for _ in range(10):
            model(step_inputs["input_ids"], step_inputs["positions"], step_inputs["cache_rows"])
        eager = []
        for _ in range(20):
            serving.synchronize()
            start = time.perf_counter()
            model(step_inputs["input_ids"], step_inputs["positions"], step_inputs["cache_rows"])
            serving.synchronize()
            eager.append(time.perf_counter() - start)
        capture_report = manager.capture(progress=False)
        for cycle in range(2 * cycles + 1):
            for inputs in (*others, step_inputs) * 5:
                step(inputs)  # replays
            serving.synchronize()
            manager.release()
            warm_ups.clear()
            after_release = cycle % 2 == 1  # cycle 0 is the first wake; then alternating
            start = time.perf_counter()
            handle = None if after_release else manager.start_capture()
            started = time.perf_counter()
            out = step(step_inputs)
            enqueued = time.perf_counter()
            out.sum()  # the output's last use, as an engine's sampler would
            serving.synchronize()
            done = time.perf_counter()
            if handle is None:
                handle = manager.start_capture()
            report = handle.wait(600)
            rows.append(
                {
                    "kind": "eager_after_release" if after_release else "wake",
                    "first_step_ms": _ms(done - start),
                    "start_capture_ms": _ms(started - start),
                    "step_enqueue_ms": _ms(enqueued - started),
                    "step_wait_ms": _ms(done - enqueued),
                    "warm_ups": list(warm_ups),
                    "ready_s": round(report.seconds, 4),
                    "errors": [repr(e) for e in handle.errors],
                }
            )
        manager.release()
    eager_ms = statistics.median(eager) * 1e3
    wakes = [r for r in rows[1:] if r["kind"] == "wake"]
    refills = [r for r in rows if r["kind"] == "eager_after_release"]
    result: dict[str, Any] = {
        "command": "wake",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "graphs": capture_report.num_graphs,
        "tokens": WAKE_TOKENS,
        "eager_step_ms": round(eager_ms, 3),
        "wake_first_step_ms": statistics.median(r["first_step_ms"] for r in wakes),
        "wake_first_step_minus_eager_ms": round(
            statistics.median(r["first_step_ms"] for r in wakes) - eager_ms, 3
        ),
        "eager_after_release_ms": statistics.median(r["first_step_ms"] for r in refills),
        "first_wake_first_step_ms": rows[0]["first_step_ms"],
        "first_wake_warm_ups": rows[0]["warm_ups"],
    }
    for field in ("start_capture_ms", "step_enqueue_ms", "step_wait_ms"):
        result[f"wake_{field}"] = statistics.median(r[field] for r in wakes)
    result["wake_first_step_spread_ms"] = [
        min(r["first_step_ms"] for r in wakes),
        max(r["first_step_ms"] for r in wakes),
    ]
    result["wakes"] = rows
    return result


# -- the estimate --------------------------------------------------------------------------------

Build = Callable[[], tuple[Any, Any, Any]]


def _reference(config: Callable[[], DecoderConfig]) -> Build:
    def build() -> tuple[Any, Any, Any]:
        from examples.reference import ReferenceDecoder, static_inputs

        decoder = config()
        return ReferenceDecoder(decoder, device="cuda").forward, static_inputs(decoder), None

    return build


def _wide() -> DecoderConfig:
    return DecoderConfig(
        num_layers=4, hidden_size=2048, num_heads=16, intermediate_size=5632, vocab_size=32000
    )


def _paged(backend: str) -> Build:
    def build() -> tuple[Any, Any, Any]:
        from cudagraph_manager.attention import AttentionOptions
        from examples.paged import PagedDecoder, PagedLayout, paged_static_inputs

        config = DecoderConfig()
        layout = PagedLayout.for_config(config, page_size=64)
        model = PagedDecoder(config, layout=layout, backend=backend, device="cuda")
        options: ManagerOptions[Any] = ManagerOptions(
            attention=AttentionOptions(metadata_builder=model.backend)
        )
        return model, paged_static_inputs(model.layout), options

    return build


#: name -> (model, inputs and options; mode; largest size); every model takes 256 requests.
CASES: Final[dict[str, tuple[Build, str, int]]] = {
    "reference-FP-512": (_reference(DecoderConfig), "FULL_AND_PIECEWISE", 512),
    "reference-FULL-512": (_reference(DecoderConfig), "FULL", 512),
    "wide-FP-512": (_reference(_wide), "FULL_AND_PIECEWISE", 512),
    "reference-PW-2048": (_reference(DecoderConfig), "PIECEWISE", 2048),
    "paged_gather-FP-512": (_paged("gather"), "FULL_AND_PIECEWISE", 512),
    "paged_flex-FP-512": (_paged("flex"), "FULL_AND_PIECEWISE", 512),
    # Beside the six: the plan where a smaller graph grew the pool in a range of sizes (README).
    "8b_like-FP-2048": (_reference(DecoderConfig.llama_8b_like), "FULL_AND_PIECEWISE", 2048),
}
#: The six models the estimate's target is quoted on (the issue's); the rest are shown beside them.
SIX: Final = tuple(CASES)[:6]
RULES: Final = ("predicted", "probes")


def _estimate_once(manager: CUDAGraphManager[Any], rule: str) -> dict[str, Any]:
    with patched(_estimate, "RULE", lambda _: rule):
        _sync()
        start = time.perf_counter()
        estimate = manager.estimate_memory()
        estimate_s = time.perf_counter() - start
    _sync()
    free = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    report = manager.capture(progress=False)
    capture_s = time.perf_counter() - start
    measured = free - torch.cuda.mem_get_info()[0]
    manager.release()
    return {
        "rule": rule,
        "ratio": estimate_s / capture_s,
        "estimate_ms": _ms(estimate_s),
        "capture_ms": _ms(capture_s),
        "error_mib": round((estimate.total_bytes - measured) / MIB, 2),
        "measured_mib": round(measured / MIB, 1),
        "probes": len(estimate.probes),
        "pool_mib": round(estimate.pool_bytes / MIB, 1),
        "driver_mib": round(estimate.driver_bytes / MIB, 1),
        "report_pool_mib": round(report.pool_bytes / MIB, 1),
        "report_driver_mib": round(report.outside_allocator_bytes / MIB, 1),
    }


def estimate(cases: list[str], rounds: int) -> dict[str, Any]:
    """Per case, in a warm process: each rule's estimate over the recapture it predicts, ABBA."""
    out: dict[str, Any] = {"command": "estimate", "device": torch.cuda.get_device_name(), "cases": {}}
    for name in cases:
        build, mode_name, max_size = CASES[name]
        torch.manual_seed(0)
        runnable, inputs, options = build()
        config = DispatchConfig(CUDAGraphMode[mode_name], CaptureSizes.default(max_size), max_num_seqs=256)
        manager = CUDAGraphManager(runnable, inputs, config, options=options)
        runs: list[dict[str, Any]] = []
        with torch.no_grad():
            manager.estimate_memory()  # the warm-up cycle: nothing below pays for a first use
            manager.capture(progress=False)
            manager.release()
            for index in range(rounds):  # AB, then BA: ABBA over two rounds
                for rule in RULES if index % 2 == 0 else RULES[::-1]:
                    runs.append(_estimate_once(manager, rule))
        case: dict[str, Any] = {"graphs": sum(len(keys) for _, keys in manager.dispatcher.capture_plan())}
        for rule in RULES:
            of = [r for r in runs if r["rule"] == rule]
            case[rule] = {
                "ratio": round(statistics.median(r["ratio"] for r in of), 4),
                "ratio_range": [round(min(r["ratio"] for r in of), 4), round(max(r["ratio"] for r in of), 4)],
                "error_mib": [r["error_mib"] for r in of],
                "estimate_ms": statistics.median(r["estimate_ms"] for r in of),
                "capture_ms": statistics.median(r["capture_ms"] for r in of),
                "probes": of[0]["probes"],
                "last": of[-1],
            }
        out["cases"][name] = case
        print(json.dumps({"case": name, **case}), flush=True)  # partial results, should a later case fail
        del manager, runnable, inputs, options
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cold")
    c.add_argument("--backend", choices=["flex", "varlen", "gather"], default="flex")
    c.add_argument("--page-size", type=int, default=128)
    c.add_argument(
        "--old", action="store_true", help="flex before issue 49 (no compile classes, duck sizing)"
    )
    c.add_argument("--warm-ups", choices=["auto", "every_key", "per_class"], default="auto")
    c.add_argument("--profile", action="store_true")
    w = sub.add_parser("wake")
    w.add_argument("--cycles", type=int, default=4)
    e = sub.add_parser("estimate")
    e.add_argument("--cases", default=",".join(CASES))
    e.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.command == "cold":
        result = cold(args.backend, args.page_size, args.old, args.warm_ups, args.profile)
    elif args.command == "wake":
        result = wake(args.cycles)
    else:
        result = estimate(args.cases.split(","), args.rounds)
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
