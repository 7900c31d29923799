"""Model-level CUDA graphs: dispatch, capture and replay over static buffers.

``CUDAGraphManager`` owns one static buffer per model input and one engine per
runtime mode; each key of the dispatcher's capture plan is captured by the
engine of its mode, which from then on owns that graph. A step is four hops:

    check the inputs -> dispatch -> copy into the static buffers -> engine.replay(key)

then the outputs are cut back to the real rows. Everything a step needs (the
views each graph reads, the cut of its outputs for a row count) is built once
and reused.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final, Generic, cast

import torch

from cudagraph_capture import (
    CaptureError,
    CaptureOptions,
    GraphEngine,
    OutputGuard,
    capture_enabled,
    collector_paused,
    resolve_device,
)
from cudagraph_dispatch import (
    FORWARD_CONTEXT_VAR,
    BatchDescriptor,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    Dispatch,
    DispatchConfig,
    ForwardContext,
    RankRequest,
    check_bool,
    set_forward_context,
)

from ._background import BackgroundCapture, Misses, capture_loop
from ._buffers import StaticBuffers, check_inputs_spec
from ._compiled import compiles_since, dynamo_compiles
from ._distributed import RankAgreement
from ._engines import default_engine_factory
from ._errors import NoGraphError
from ._outputs import OutputLayout, OutputRows, check_output_rows, uses_reqs
from ._progress import progress as progress_bar
from ._protocols import GraphEngineFactory, OutputT
from ._report import CapturedGraph, CaptureReport, EagerReason, ManagerStats
from ._static import StaticInput

_logger: Final = logging.getLogger("cudagraph_manager")
_NONE: Final = CUDAGraphMode.NONE
_PIECEWISE: Final = CUDAGraphMode.PIECEWISE
_NO_MODES: Final[frozenset[CUDAGraphMode]] = frozenset()


class _PlannedGraph(Generic[OutputT]):
    """One key of the capture plan: its engine, the views its graph reads, its counters."""

    __slots__ = ("descriptor", "engine", "inputs", "last_cut", "mode", "num_reqs", "num_tokens", "replays")

    def __init__(
        self,
        mode: CUDAGraphMode,
        descriptor: BatchDescriptor,
        engine: GraphEngine[..., OutputT] | None,
        buffers: StaticBuffers,
        max_num_seqs: int,
    ) -> None:
        self.mode: Final = mode
        self.descriptor: Final = descriptor
        self.engine: Final = engine  # None on a device without CUDA graphs
        self.num_tokens: Final = descriptor.num_tokens
        # PIECEWISE keys are relaxed (no request count): size their request rows as vLLM does.
        self.num_reqs: Final = (
            descriptor.num_reqs if descriptor.num_reqs is not None else min(self.num_tokens, max_num_seqs)
        )
        self.inputs: Final = buffers.views(self.num_tokens, self.num_reqs)  # the graph's keyword arguments
        self.replays = 0
        # The last (engine output, num_tokens, num_reqs, its cut): steps of one row count reuse the cut.
        self.last_cut: tuple[object, int, int, object] | None = None


class CUDAGraphManager(Generic[OutputT]):
    """Captures a model's forward as CUDA graphs and replays them, one call per step.

    ``model`` is any callable (an ``nn.Module``, a bound method, a compiled
    function) taking the ``inputs`` as keyword arguments and returning a tensor
    or a flat tuple, list or dict of tensors. Each input gets a static buffer
    on ``device`` (default: the current CUDA device, or the CPU without CUDA),
    allocated once and filled with its ``pad_value``. ``config`` decides which
    graphs exist (through a ``CUDAGraphDispatcher``); ``options`` go to the
    capture engines. ``output_rows`` says which count each output's leading
    dimension follows ("tokens" by default), so ``run`` can cut it back to the
    real batch. ``strict=True`` raises ``NoGraphError`` where a step would run
    eagerly. ``engine_factory`` replaces the capture engines (a seam for tests
    and other engines).

    Without CUDA (a CPU device, and no ``engine_factory``) nothing is
    captured: every step still goes through the checks, dispatch, static
    buffers and padding, then runs the model eagerly on the padded buffers;
    ``strict=True`` then raises ``ValueError`` at construction.

    ``check_overwritten_outputs=True`` (a debug check, off by default) makes
    the outputs of a replay unreadable once a later replay may have
    overwritten them: reading one raises instead of returning newer numbers.

    One step at a time: the static buffers serve one step, so a ``run`` while
    another thread is inside ``run`` of the same manager raises ``RuntimeError``.

    ``ranks`` (a ``RankAgreement``) makes the ranks of a data-parallel group,
    or of a tensor-parallel group whose graphs hold collectives, step
    together: ``capture()`` checks that every rank captures the same plan and
    fails on every rank when one fails; each ``run()`` is one exchange, after
    which every rank replays the same graph (a rank with 0 tokens replays it
    on pad values: the padded dummy step) or every rank runs eagerly (a rank
    with 0 tokens then runs the model on one padding row).
    """

    def __init__(
        self,
        model: Callable[..., OutputT],
        inputs: Mapping[str, StaticInput],
        config: DispatchConfig,
        *,
        device: torch.device | str | int | None = None,
        strict: bool = False,
        options: CaptureOptions | None = None,
        output_rows: OutputRows = "tokens",
        engine_factory: GraphEngineFactory | None = None,
        check_overwritten_outputs: bool = False,
        ranks: RankAgreement | None = None,
    ) -> None:
        if not callable(model):
            raise ValueError(f"model: expected a callable, got {model!r:.80}")
        if engine_factory is not None and not callable(engine_factory):
            raise ValueError(
                f"engine_factory: expected None or a GraphEngineFactory, got {engine_factory!r:.80}"
            )
        check_bool("check_overwritten_outputs", check_overwritten_outputs)
        given_ranks: object = ranks
        if given_ranks is not None and not isinstance(given_ranks, RankAgreement):
            raise ValueError(f"ranks: expected a RankAgreement or None, got {ranks!r:.80}")
        self._dispatcher: Final = CUDAGraphDispatcher(config)  # validates config
        checked = check_inputs_spec(inputs)
        self._strict: Final = check_bool("strict", strict)
        given_options: object = options
        if given_options is not None and not isinstance(given_options, CaptureOptions):
            raise ValueError(f"options: expected CaptureOptions or None, got {options!r}")
        self._options: Final = options if options is not None else CaptureOptions()
        self._output_rows: Final = check_output_rows(output_rows)
        if uses_reqs(self._output_rows) and not any(s.rows == "reqs" for s in checked.values()):
            raise ValueError(
                "output_rows: an output follows 'reqs', but no input has rows='reqs' to count them"
            )
        self._device: Final = resolve_device(device)
        #: Why this manager captures nothing (``None``: it captures).
        self._no_graphs: Final = (
            f"CUDA graphs need a CUDA device, and the manager's device is {self._device}"
            if engine_factory is None and self._device.type != "cuda"
            else None
        )
        if strict and self._no_graphs is not None:
            raise ValueError(f"strict: {self._no_graphs}; pass strict=False to run every step eagerly")
        self._guard: Final = OutputGuard() if check_overwritten_outputs else None
        self._ranks: Final = ranks
        self._all_captured = False  # every key of the plan captured: what a rank tells the others

        self._model: Final = model
        self._buffers: Final = StaticBuffers(
            checked,
            max_tokens=config.capture_sizes.max,
            max_num_seqs=config.max_num_seqs,
            query_len=config.uniform_decode_query_len,
            device=self._device,
        )
        plan = self._dispatcher.capture_plan()
        factory = default_engine_factory if engine_factory is None else engine_factory
        self._engines: Final[dict[CUDAGraphMode, GraphEngine[..., OutputT]]] = (
            {}
            if self._no_graphs is not None
            else {mode: factory(model, mode, self._options) for mode, _ in plan}
        )
        self._planned: Final[dict[BatchDescriptor, _PlannedGraph[OutputT]]] = {
            descriptor: _PlannedGraph(
                mode, descriptor, self._engines.get(mode), self._buffers, config.max_num_seqs
            )
            for mode, descriptors in plan
            for descriptor in descriptors
        }
        self._step_lock: Final = threading.Lock()
        # While a background capture runs (start_capture): the lock replays and
        # the capture thread take turns under, the stream the capture runs on,
        # the stream of the last replay, and the keys steps missed.
        self._replay_lock: threading.Lock | None = None
        self._turn_stream: torch.cuda.Stream | None = None
        self._serving_stream: torch.cuda.Stream | None = None
        self._background: BackgroundCapture | None = None
        self._misses: Final = Misses()
        self._layout: OutputLayout | None = None  # from the first outputs seen
        self._logged_reasons: set[EagerReason] = set()
        self._eager_reasons: dict[EagerReason, int] = {}
        self._padded_tokens = 0
        self._idle_steps = 0
        self._dummy_steps = 0

    # -- accessors --

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dispatcher(self) -> CUDAGraphDispatcher:
        """The dispatcher built from ``config``: the graphs that exist are its keys."""
        return self._dispatcher

    @property
    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        """The static input buffers by name (read-only mapping; the tensors are the live buffers)."""
        return MappingProxyType({b.name: b.tensor for b in self._buffers.buffers})

    @property
    def num_captured(self) -> int:
        """How many keys of the capture plan have a captured graph (their engines know)."""
        return sum(
            p.engine is not None and p.engine.is_captured(p.descriptor) for p in self._planned.values()
        )

    @property
    def stats(self) -> ManagerStats:
        """A snapshot of what ``run`` did since construction or ``reset_stats``."""
        replays: dict[tuple[CUDAGraphMode, int], int] = {}
        for planned in self._planned.values():
            if planned.replays:
                key = (planned.mode, planned.num_tokens)
                replays[key] = replays.get(key, 0) + planned.replays
        return ManagerStats(
            replays=MappingProxyType(replays),
            eager_runs=sum(self._eager_reasons.values()),
            uncaptured_runs=self._eager_reasons.get(EagerReason.NOT_CAPTURED, 0),
            padded_tokens=self._padded_tokens,
            eager_reasons=MappingProxyType({r.value: n for r, n in self._eager_reasons.items()}),
            idle_steps=self._idle_steps,
            dummy_steps=self._dummy_steps,
        )

    def clear(self) -> None:
        """Free every captured graph (the pool stays usable); ``capture()`` captures them anew."""
        if self._background is not None and not self._background.done:
            raise RuntimeError("clear: a background capture of this manager is running; wait() for it")
        self._all_captured = False
        for engine in self._engines.values():
            engine.clear()
        for planned in self._planned.values():
            planned.last_cut = None

    def reset_stats(self) -> None:
        for planned in self._planned.values():
            planned.replays = 0
        self._eager_reasons.clear()
        self._padded_tokens = self._idle_steps = self._dummy_steps = 0

    # -- capture --

    def capture(self, *, progress: bool | None = None) -> CaptureReport:
        """Capture every key of the plan not captured yet (PIECEWISE, then FULL, largest first, one pool).

        Each key's views are filled with pad values; its engine warms the shape
        up (``options.warmup_runs``) and captures it; its outputs are checked
        against ``output_rows``. ``progress``: a tqdm bar (default: when stderr
        is a terminal). A ``CaptureError`` names the key and propagates; keys
        captured before it stay usable and ``capture()`` again captures the
        rest (into the shared pool; ``CaptureOptions.pool`` says when a pool of
        your own allows that). Without CUDA the report says why nothing was captured.
        Synchronizes the device once, at the end.

        With ``ranks``, a collective: every rank calls it. It first checks
        that all ranks would capture the same keys in the same order
        (``RanksDisagreeError`` on every rank, before any capture), then
        after each key that every rank captured it: if one failed, every
        rank drops that key and raises (the failed rank its own error, the
        others a ``CaptureError`` naming the failed ranks).
        """
        if progress is not None:
            check_bool("progress", progress)
        if self._background is not None and not self._background.done:
            raise RuntimeError("capture: a background capture of this manager is running; wait() for it")
        ranks = self._ranks
        pending = [
            p
            for p in self._planned.values()
            if p.engine is not None and not p.engine.is_captured(p.descriptor)
        ]
        if ranks is not None:
            unable = self._no_graphs if self._no_graphs is not None else (
                None if capture_enabled() else "capture is disabled (set_capture_enabled(False))"
            )
            ranks.agree_plan([(p.mode, p.descriptor) for p in pending], can_capture=unable)
        if self._no_graphs is not None:
            return CaptureReport(graphs=(), seconds=0.0, reserved_bytes=0, not_captured=self._no_graphs)
        device = self._device
        compiled_before = dynamo_compiles()
        records: list[CapturedGraph] = []
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with collector_paused(self._options.gc_disable), torch.no_grad(), on_device:
            reserved_before = _reserved_bytes(device)
            start = time.perf_counter()
            for planned in progress_bar(pending, desc="Capturing CUDA graphs", enabled=progress):
                if ranks is None:
                    records.append(self._capture_one(planned))
                else:
                    records.append(self._capture_one_with_ranks(planned, ranks))
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # once, so the total includes the device's work
            seconds = time.perf_counter() - start
            reserved = _reserved_bytes(device) - reserved_before
        self._all_captured = self.num_captured == len(self._planned)
        return CaptureReport(
            graphs=tuple(records),
            seconds=seconds,
            reserved_bytes=reserved,
            compiles=compiles_since(compiled_before),
        )

    def _capture_one_with_ranks(self, planned: _PlannedGraph[OutputT], ranks: RankAgreement) -> CapturedGraph:
        """One key's capture on every rank, kept only if every rank captured it (one exchange).

        An exception (not a ``KeyboardInterrupt``) is held until the ranks
        have compared notes, so a failure on one rank never leaves the others
        waiting for it in their next collective.
        """
        error: Exception | None = None
        record: CapturedGraph | None = None
        try:
            record = self._capture_one(planned)
        except Exception as exc:
            error = exc
        failed = ranks.failed_ranks(error is not None)
        if error is not None:
            if sys.version_info >= (3, 11):
                error.add_note(f"rank {ranks.rank} of {ranks.world_size}: every rank dropped this key")
            raise error
        if failed:
            assert planned.engine is not None  # only keys with an engine are captured
            planned.engine.discard(planned.descriptor)  # the graphs of all ranks stay the same set
            raise CaptureError(
                f"rank(s) {failed} of {ranks.world_size} failed to capture this key, so rank "
                f"{ranks.rank} dropped it too; their errors say why",
                planned.descriptor,
            )
        assert record is not None
        return record

    def start_capture(self) -> BackgroundCapture:
        """Capture the plan's pending keys in a thread while ``run()`` keeps serving; returns at once.

        Until a key is captured, its steps run eagerly and are counted as
        ``not_captured`` (allowed in ``strict`` mode until the capture is done);
        a key replays from the first step after its capture finished. The
        handle reports progress, errors and the report (``wait()``). Call it
        from the serving thread; meanwhile that thread must not synchronize
        the whole device, use the legacy default stream, or draw from the
        default CUDA generator (see ``_background``'s notes). Keys recent
        steps needed are captured first.
        """
        if self._background is not None and not self._background.done:
            raise RuntimeError("start_capture: a background capture of this manager is already running")
        if self._ranks is not None:
            raise RuntimeError(
                "start_capture: a manager with ranks= captures with capture(), on every rank at once; "
                "a background capture would interleave its collectives with the serving steps' "
                "differently on each rank"
            )
        pending = [
            p.descriptor
            for p in self._planned.values()
            if p.engine is not None and not p.engine.is_captured(p.descriptor)
        ]
        handle = self._background = BackgroundCapture(len(pending))
        if self._no_graphs is not None or not pending:
            handle._finish(0.0, 0)
            return handle
        if self._device.type == "cuda":
            self._turn_stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]  # untyped stubs
        self._replay_lock = threading.Lock()
        thread = threading.Thread(
            target=capture_loop,
            args=(
                handle,
                pending,
                self._misses,
                self._capture_turn,
                self._device,
                self._options.gc_disable,
                self._end_background,
            ),
            name="cudagraph-background-capture",
            daemon=True,
        )
        thread.start()
        return handle

    def _capture_turn(self, key: BatchDescriptor) -> CapturedGraph:
        """One key's capture in the background thread, in turn with the replays (see ``_background``)."""
        lock, stream = self._replay_lock, self._turn_stream
        assert lock is not None
        with lock:
            if stream is None:  # no CUDA streams (an engine of another kind, on the CPU)
                return self._capture_one(self._planned[key])
            if self._serving_stream is not None:
                stream.wait_stream(self._serving_stream)  # the replays queued so far come first
            with torch.cuda.stream(stream):
                return self._capture_one(self._planned[key])

    def _end_background(self) -> None:
        """The capture thread's last act: its work done on the device, replays lock-free again."""
        lock, stream = self._replay_lock, self._turn_stream
        assert lock is not None
        with lock:
            if stream is not None:
                stream.synchronize()  # this stream only: a device-wide sync could break a capture elsewhere
            self._replay_lock = None

    def _capture_one(self, planned: _PlannedGraph[OutputT]) -> CapturedGraph:
        engine = planned.engine
        assert engine is not None  # only planned graphs with an engine are captured
        start = time.perf_counter()
        # The warm-up and a breakable capture really run the model (its eager
        # breaks included) on the buffers: pad values, never the last real batch.
        self._buffers.fill_padding(planned.num_tokens, planned.num_reqs)
        before = _reserved_bytes(self._device)
        output = engine.capture(planned.descriptor, **planned.inputs)
        pool_bytes = _reserved_bytes(self._device) - before
        try:
            self._layout_of(output).check(output, planned.num_tokens, planned.num_reqs)
        except ValueError:
            engine.discard(planned.descriptor)  # outputs that cannot be cut: the key stays uncaptured
            raise
        del output  # the engine keeps a non-owning alias: smaller graphs may reuse this memory
        planned.last_cut = None
        return CapturedGraph(planned.mode, planned.descriptor, time.perf_counter() - start, pool_bytes)

    # -- run --

    def run(
        self,
        /,
        *,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = _NO_MODES,
        **inputs: torch.Tensor,
    ) -> OutputT:
        """Run one step: replay its graph on the padded batch, or run the model eagerly.

        Bad inputs (names, dtypes, devices, trailing shapes, row counts) raise
        ``ValueError`` naming the input before a buffer is touched. With a
        graph: copy in, pad with ``pad_value``, replay, and return the outputs
        cut to the real rows: views of graph memory, valid until the next
        ``run`` (or any replay from the same pool); copy what must live longer.
        Without one the model runs eagerly (on the padded buffers where CUDA
        graphs are unavailable), counted per ``EagerReason``; ``strict`` raises
        ``NoGraphError`` instead. 0 tokens is an idle step: empty outputs, no
        model call. No autograd. ``run_batch``: the inputs in one mapping.
        """
        return self._run(inputs, uniform_decode, num_active_loras, invalid_modes)

    def run_batch(
        self,
        inputs: Mapping[str, torch.Tensor],
        /,
        *,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = _NO_MODES,
    ) -> OutputT:
        """``run`` with the inputs in one mapping: the same checks, dispatch and outputs.

        For typed callers holding a ``dict[str, Tensor]``: mypy rejects
        ``run(**batch)`` because such a dict could hold ``run``'s own keywords.
        """
        given: object = inputs
        if given.__class__ is not dict and not isinstance(given, Mapping):
            raise ValueError(
                f"inputs: expected a mapping of input names to tensors, got {type(given).__name__}"
            )
        return self._run(inputs, uniform_decode, num_active_loras, invalid_modes)

    def _run(
        self,
        inputs: Mapping[str, torch.Tensor],
        uniform_decode: bool,
        num_active_loras: int,
        invalid_modes: frozenset[CUDAGraphMode],
    ) -> OutputT:
        """The step: check, dispatch, copy in, replay, cut; or a step without a graph.

        One step at a time: a call from a second thread meanwhile raises
        instead of mixing two steps in the static buffers.
        """
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError(
                "CUDAGraphManager.run: another thread is inside run() of this manager; its static "
                "buffers serve one step at a time (serialize the calls, or use a manager per thread)"
            )
        try:
            num_tokens, num_reqs, requires_grad = self._buffers.check(inputs, uniform_decode)
            if self._ranks is not None:
                step = (uniform_decode, num_active_loras, invalid_modes)
                return self._run_with_ranks(self._ranks, inputs, num_tokens, num_reqs, requires_grad, step)
            decision = self._dispatcher.dispatch(
                num_tokens,
                uniform_decode=uniform_decode,
                num_active_loras=num_active_loras,
                invalid_modes=invalid_modes,
            )
            planned = self._planned.get(decision.descriptor) if decision.mode is not _NONE else None
            engine = planned.engine if planned is not None else None
            busy = False
            if planned is not None and engine is not None and engine.is_captured(planned.descriptor):
                turns = self._replay_lock  # a background capture runs: replays take turns with it
                if turns is None:
                    return self._replay(planned, engine, inputs, num_tokens, num_reqs, requires_grad)
                # Never wait for a key's capture to end: while it holds the buffers, run eagerly.
                if turns.acquire(blocking=False):
                    try:  # a key is captured before its check ends: inside, check it again
                        if engine.is_captured(planned.descriptor):
                            if self._turn_stream is not None:
                                stream = self._serving_stream = torch.cuda.current_stream()
                                stream.wait_stream(self._turn_stream)  # what the capture did comes first
                            return self._replay(planned, engine, inputs, num_tokens, num_reqs, requires_grad)
                    finally:
                        turns.release()
                busy = True
            step = (uniform_decode, num_active_loras, invalid_modes)
            return self._run_without_graph(inputs, num_tokens, num_reqs, decision, planned, step, busy)
        finally:
            self._step_lock.release()

    def _run_with_ranks(
        self,
        ranks: RankAgreement,
        inputs: Mapping[str, torch.Tensor],
        num_tokens: int,
        num_reqs: int,
        requires_grad: bool,
        step: tuple[bool, int, frozenset[CUDAGraphMode]],  # uniform_decode, num_active_loras, invalid_modes
    ) -> OutputT:
        """A step every rank runs alike: agree (one exchange), then replay the agreed key, or all eager.

        A rank with 0 tokens takes part all the same, so the collectives of
        the others meet it: it replays the agreed graph on pad values (the
        padded dummy step), or, when the others run eagerly, runs the model
        once on one padding row (as vLLM's dummy batch). Only when every
        rank is idle does none call the model.
        """
        uniform_decode, num_active_loras, invalid_modes = step
        # This rank's own dispatch first: it checks the step's arguments before the exchange.
        own = self._dispatcher.dispatch(
            num_tokens,
            uniform_decode=uniform_decode,
            num_active_loras=num_active_loras,
            invalid_modes=invalid_modes,
        )
        agreed = ranks.agree_step(
            self._dispatcher,
            RankRequest(num_tokens, uniform_decode, num_active_loras),
            invalid_modes=invalid_modes,
            can_replay=self._all_captured,
        )
        if agreed.mode is not _NONE:
            planned = self._planned[agreed.descriptor]
            engine = planned.engine
            if engine is None or not engine.is_captured(planned.descriptor):
                raise RuntimeError(  # every rank reported all its keys captured: a bug if reached
                    f"CUDAGraphManager.run: the ranks agreed on {agreed.descriptor}, not captured here"
                )
            if num_tokens == 0:
                self._dummy_steps += 1
            return self._replay(planned, engine, inputs, num_tokens, num_reqs, requires_grad)
        if num_tokens == 0 and agreed.descriptor.num_tokens > 0:
            if self._strict:
                raise NoGraphError(0, f"the other ranks of the {ranks.world_size} run this step eagerly")
            return self._dummy_eager()
        reason: tuple[EagerReason, str] | None = None
        if own.mode is not _NONE and self._all_captured:  # this rank had a graph; another rank had none
            reason = (
                EagerReason.OTHER_RANK,
                f"another rank of the {ranks.world_size} runs this step without a graph, so all do "
                f"(the agreed step: {agreed.descriptor.num_tokens} tokens)",
            )
        own_graph = self._planned.get(own.descriptor) if own.mode is not _NONE else None
        return self._run_without_graph(inputs, num_tokens, num_reqs, own, own_graph, step, known=reason)

    def _replay(
        self,
        planned: _PlannedGraph[OutputT],
        engine: GraphEngine[..., OutputT],
        inputs: Mapping[str, torch.Tensor],
        num_tokens: int,
        num_reqs: int,
        requires_grad: bool,
    ) -> OutputT:
        """Copy the step in, padded; replay its graph; cut the outputs to the real rows."""
        if requires_grad and torch.is_grad_enabled():
            with torch.no_grad():  # a copy from a tensor that requires grad would record history
                self._buffers.copy_in(inputs, num_tokens, num_reqs, planned.num_tokens, planned.num_reqs)
        else:
            self._buffers.copy_in(inputs, num_tokens, num_reqs, planned.num_tokens, planned.num_reqs)
        if self._guard is not None:
            self._guard.retire(planned.descriptor)
        if planned.mode is _PIECEWISE:  # its eager breaks run for real, and may read the context
            token = FORWARD_CONTEXT_VAR.set(ForwardContext(_PIECEWISE, planned.descriptor))
            try:
                raw = engine.replay(planned.descriptor)
            finally:
                FORWARD_CONTEXT_VAR.reset(token)
        else:
            raw = engine.replay(planned.descriptor)
        planned.replays += 1
        self._padded_tokens += planned.num_tokens - num_tokens
        out = self._cut(planned, raw, num_tokens, num_reqs)
        return out if self._guard is None else cast(OutputT, self._guard.hand_out(out))

    def _cut(self, planned: _PlannedGraph[OutputT], raw: OutputT, num_tokens: int, num_reqs: int) -> OutputT:
        """The graph's outputs cut to the real rows, in a fresh container (a caller's edits stay theirs)."""
        last = planned.last_cut
        if last is not None and last[0] is raw and last[1] == num_tokens and last[2] == num_reqs:
            cut = last[3]
        else:
            layout = self._layout
            assert layout is not None  # set by the capture of every captured key
            cut = layout.cut(raw, num_tokens, num_reqs)
            planned.last_cut = (raw, num_tokens, num_reqs, cut)
        return cast(OutputT, cut.copy() if isinstance(cut, (list, dict)) else cut)

    def _run_without_graph(
        self,
        inputs: Mapping[str, torch.Tensor],
        num_tokens: int,
        num_reqs: int,
        decision: Dispatch,
        planned: _PlannedGraph[OutputT] | None,
        step: tuple[bool, int, frozenset[CUDAGraphMode]],  # uniform_decode, num_active_loras, invalid_modes
        busy: bool = False,  # its graph is captured, but a background capture holds the buffers
        known: tuple[EagerReason, str] | None = None,  # the reason, decided by the caller
    ) -> OutputT:
        """An idle step, or the model run eagerly; counted per reason (strict: ``NoGraphError``)."""
        if num_tokens == 0:
            return self._idle(inputs)
        if known is not None:
            reason, why = known
        elif busy:
            reason = EagerReason.CAPTURE_RUNNING
            why = "the background capture holds the static buffers for another key"
        else:
            reason, why = self._why_eager(decision, num_tokens, *step)
        capturing = self._background is not None and not self._background.done
        if reason is EagerReason.CAPTURE_RUNNING:
            pass  # expected while capturing, in strict mode too
        elif reason is EagerReason.NOT_CAPTURED and capturing:
            self._misses.add(decision.descriptor)  # captured next
        elif self._strict:
            raise NoGraphError(num_tokens, why)
        if reason not in self._logged_reasons:  # once per reason: visible, never a flood
            self._logged_reasons.add(reason)
            level = logging.INFO if reason is EagerReason.NO_CUDA else logging.WARNING
            _logger.log(level, "running a step of %d tokens eagerly (%s): %s", num_tokens, reason.value, why)
        self._eager_reasons[reason] = self._eager_reasons.get(reason, 0) + 1
        with torch.no_grad():
            if reason is not EagerReason.NO_CUDA or planned is None:
                with set_forward_context(_NONE, BatchDescriptor(num_tokens)):
                    out = self._model(**inputs)
                self._layout_of(out)
                return out
            # No CUDA graphs here: the step the graph would replay, run eagerly
            # on the padded static buffers, then cut like a replay's outputs.
            self._buffers.copy_in(inputs, num_tokens, num_reqs, planned.num_tokens, planned.num_reqs)
            with set_forward_context(_NONE, planned.descriptor):
                padded = self._model(**planned.inputs)
        self._padded_tokens += planned.num_tokens - num_tokens
        return cast(OutputT, self._layout_of(padded).cut(padded, num_tokens, num_reqs))

    def _dummy_eager(self) -> OutputT:
        """An idle rank's part in an eager step of the others: the model once on one padding row.

        Outputs with 0 rows; counted in ``stats.dummy_steps``.
        """
        self._dummy_steps += 1
        self._buffers.fill_padding(1, 1)
        with torch.no_grad(), set_forward_context(_NONE, BatchDescriptor(1)):
            out = self._model(**self._buffers.views(1, 1))
        return cast(OutputT, self._layout_of(out).cut(out, 0, 0))

    def _idle(self, inputs: Mapping[str, torch.Tensor]) -> OutputT:
        """A step of 0 tokens: the outputs' structure with no rows, without calling the model.

        Only a manager that has seen no outputs yet (no capture, no step) calls
        the model once, on the empty inputs, to learn their structure.
        """
        self._idle_steps += 1
        layout = self._layout
        if layout is None:
            with torch.no_grad(), set_forward_context(_NONE, BatchDescriptor(0)):
                out = self._model(**inputs)
            self._layout_of(out)
            return out
        return cast(OutputT, layout.empty())

    def _layout_of(self, output: object) -> OutputLayout:
        """The output layout, taken from the first outputs seen (a capture's or an eager step's)."""
        if self._layout is None:
            self._layout = OutputLayout.of(output, self._output_rows)
        return self._layout

    def _why_eager(
        self,
        decision: Dispatch,
        num_tokens: int,
        uniform_decode: bool,
        num_active_loras: int,
        invalid_modes: frozenset[CUDAGraphMode],
    ) -> tuple[EagerReason, str]:
        """Why a step has no graph: its reason, and the reason in words (for logs and errors)."""
        if decision.mode is not _NONE:
            if self._no_graphs is not None:
                return EagerReason.NO_CUDA, self._no_graphs
            mode, key = decision.mode.name, decision.descriptor
            return (
                EagerReason.NOT_CAPTURED,
                f"its {mode} graph {key} was not captured yet; call capture() first",
            )
        dispatcher = self._dispatcher
        words = dispatcher.explain(
            num_tokens,
            uniform_decode=uniform_decode,
            num_active_loras=num_active_loras,
            invalid_modes=invalid_modes,
        )
        if num_tokens > dispatcher.config.capture_sizes.max:
            return EagerReason.ABOVE_LARGEST_SIZE, words
        if num_active_loras > max(dispatcher.config.lora_counts, default=0):
            return EagerReason.LORA_COUNT, words
        if invalid_modes:
            allowed = dispatcher.dispatch(
                num_tokens, uniform_decode=uniform_decode, num_active_loras=num_active_loras
            )
            if allowed.mode is not _NONE:
                return EagerReason.INVALID_MODES, words
        return EagerReason.NO_GRAPH_FOR_BATCH, words


def _reserved_bytes(device: torch.device) -> int:
    """The device's reserved memory (0 off CUDA): its growth is what a capture cost."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
