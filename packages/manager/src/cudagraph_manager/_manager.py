"""Model-level CUDA graphs: dispatch, capture and replay over static buffers.

``CUDAGraphManager`` owns one static buffer per model input, one engine per
runtime mode and one ``PlannedKey`` per key of the dispatcher's plan; a key's
entry, once captured, replays itself. A step is one screen (``_step``):

    check the inputs -> route -> copy into the static buffers -> entry.replay() -> cut

or, when the route is a reason instead of a graph, an eager step counted per
reason (``_eager``). Captures are in ``_capturing``, the background capture in
``_background``, the ranks' agreements in ``ranks``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Final, Generic, cast

import torch

from cudagraph_capture import (
    CaptureOptions,
    GraphEngine,
    GraphPool,
    OutputGuard,
    capture_enabled,
    resolve_device,
)
from cudagraph_dispatch import (
    FORWARD_CONTEXT_VAR,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    Dispatch,
    DispatchConfig,
    RankRequest,
    Route,
    check_bool,
)

from ._background import BackgroundCapture
from ._buffers import StaticBuffers, check_inputs_spec
from ._capturing import Capturer
from ._eager import EagerSteps
from ._engines import default_engine_factory
from ._outputs import LayoutCell, OutputRows, check_output_rows, uses_reqs
from ._planned import PlannedKey
from ._protocols import GraphEngineFactory, OutputT
from ._report import CaptureReport, ManagerStats, MemoryEstimate, StepCounts
from ._static import StaticInput
from ._weights import WeightWatch, watched_module
from .ranks import RankAgreement

_NO_MODES: Final[frozenset[CUDAGraphMode]] = frozenset()


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
    and other engines). ``check_overwritten_outputs=True`` (a debug check)
    makes the outputs of a replay unreadable once a later replay may have
    overwritten them.

    Without CUDA (a CPU device, and no ``engine_factory``) nothing is
    captured: every step still goes through the checks, dispatch, static
    buffers and padding, then runs the model eagerly on the padded buffers;
    ``strict=True`` then raises ``ValueError`` at construction.

    Threads: the static buffers serve one step at a time, so ``run`` while
    another thread is inside ``run``, ``capture()``, ``clear()``,
    ``start_capture()``, ``release()`` or ``estimate_memory()`` of the same
    manager raises ``RuntimeError``; those wait for a ``run`` in progress to
    return, and all but ``release()`` (which stops it) refuse to start while
    a background capture runs.

    ``ranks`` (a ``RankAgreement``) makes the ranks of a data-parallel group,
    or of a tensor-parallel group whose graphs hold collectives, step
    together: ``capture()`` checks that every rank captures the same plan and
    fails on every rank when one fails; each ``run()`` is one exchange, after
    which every rank replays the same graph (a rank with 0 tokens replays it
    on pad values) or every rank runs eagerly (a rank with 0 tokens then runs
    the model on one padding row).
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
        check_bool("strict", strict)
        given_options: object = options
        if given_options is not None and not isinstance(given_options, CaptureOptions):
            raise ValueError(f"options: expected CaptureOptions or None, got {options!r}")
        self._options: Final = options if options is not None else CaptureOptions()
        rows = check_output_rows(output_rows)
        if uses_reqs(rows) and not any(s.rows == "reqs" for s in checked.values()):
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
        self._buffers: Final = StaticBuffers(
            checked,
            max_tokens=config.capture_sizes.max,
            max_num_seqs=config.max_num_seqs,
            query_len=config.uniform_decode_query_len,
            device=self._device,
        )
        plan = self._dispatcher.capture_plan()
        factory = default_engine_factory if engine_factory is None else engine_factory
        self._model: Final = model
        self._factory: Final = factory
        self._engines: Final[dict[CUDAGraphMode, GraphEngine[OutputT]]] = (
            {}
            if self._no_graphs is not None
            else {mode: factory(model, mode, self._options) for mode, _ in plan}
        )
        #: Every key of the plan, in capture order; its entry says whether it is captured.
        self._keys: Final = {
            key: PlannedKey[OutputT](mode, key, self._buffers, config.max_num_seqs)
            for mode, keys in plan
            for key in keys
        }
        self._layout: Final = LayoutCell(rows)  # from the first outputs seen
        self._counts: Final = StepCounts()
        self._eager: Final = EagerSteps(
            model, self._buffers, self._layout, self._counts, strict, self._dispatcher, self._no_graphs, ranks
        )

        def probe_engine(mode: CUDAGraphMode, pool: GraphPool) -> GraphEngine[OutputT]:
            return factory(model, mode, dataclasses.replace(self._options, pool=pool))

        self._capturer: Final = Capturer(
            self._keys, self._engines, probe_engine, self._buffers, self._layout, self._device, self._options
        )
        self._step_lock: Final = threading.Lock()
        self._session: BackgroundCapture | None = None  # the last background capture
        #: The addresses of the model's parameters and buffers that its graphs read.
        self._weights: Final = WeightWatch(watched_module(model))

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
        """How many keys of the capture plan have a captured graph."""
        return sum(key.entry is not None for key in self._keys.values())

    @property
    def stats(self) -> ManagerStats:
        """A snapshot of what ``run`` did since construction or ``reset_stats``."""
        replays: dict[tuple[CUDAGraphMode, int], int] = {}
        for key in self._keys.values():
            if key.replays:
                size = (key.mode, key.num_tokens)
                replays[size] = replays.get(size, 0) + key.replays
        return self._counts.snapshot(replays)

    def reset_stats(self) -> None:
        for key in self._keys.values():
            key.replays = 0
        self._counts.reset()

    def clear(self) -> None:
        """Free every captured graph (the pool stays usable); ``capture()`` captures them anew."""
        with self._exclusive("clear"):
            self._capturer.drop_all()
            self._weights.forget()

    def release(self) -> None:
        """Free every graph and give its memory back to the device; steps run eagerly until a capture.

        For a sleep mode (a trainer takes the GPU): a running background
        capture is stopped first (the key being recorded finishes), every
        graph is freed, and ``release_graph_memory`` returns the pool's
        memory to the device (``torch.cuda.empty_cache()`` included; the
        driver keeps the memory of the first graphs' executables for the
        graphs a wake captures). Steps meanwhile run eagerly, counted as
        ``EagerReason.RELEASED`` (``strict`` raises). The static buffers stay
        (they are small and keep their addresses). The outputs of the last
        ``run()`` are invalid afterwards, as after a next ``run()``. Wake up
        with ``start_capture()`` (serving meanwhile) or ``capture()``; new
        weights may be loaded in between, in place or as new tensors.
        Waits for a ``run()`` in progress on another thread.
        """
        with self._step_lock:
            session = self._session
            if session is not None and not session.done:
                session.stop()
                session.wait()
            self._capturer.drop_all()
            self._weights.forget()
            self._eager.released = True
            if self._guard is not None:
                self._guard.retire_all()
            self._capturer.release_memory()  # last: the manager is released even if this raises

    def check_weights(self) -> None:
        """Raise ``WeightsReplacedError`` if a tensor the captured graphs read was replaced.

        Each replay notices an assignment of a parameter or buffer and a move
        of the whole model by itself; call this after a reload that did
        neither (``param.data = t`` on one parameter, a submodule moved).
        """
        self._weights.check()

    # -- capture --

    def capture(self, *, progress: bool | None = None) -> CaptureReport:
        """Capture every key of the plan not captured yet (PIECEWISE, then FULL, largest first, one pool).

        Per key: its views are filled with pad values and the model warms up
        on them (``options.warmup_runs``, eagerly); then its graph is
        recorded without running (nothing in the pool or the model's buffers
        is written, so the outputs of the last ``run`` stay intact) and its
        outputs are checked against ``output_rows``. ``progress``: a tqdm bar
        (default: when stderr is a terminal). A ``CaptureError`` names the key
        and propagates; keys captured before it stay usable and ``capture()``
        again captures the rest. Without CUDA the report says why nothing was
        captured. Synchronizes the calling stream once, at the end.

        With ``ranks``, a collective: every rank calls it. It first checks
        that all ranks would capture the same keys in the same order
        (``RanksDisagreeError`` on every rank, before any capture), then
        after each key that every rank captured it: if one failed, every
        rank drops that key and raises (the failed rank its own error, the
        others a ``CaptureError`` naming the failed ranks).
        """
        if progress is not None:
            check_bool("progress", progress)
        with self._exclusive("capture"):
            pending = self._capturer.pending()
            self._before_capture(len(pending))
            self._agree_plan(pending)
            if self._no_graphs is not None:
                return CaptureReport(graphs=(), seconds=0.0, reserved_bytes=0, not_captured=self._no_graphs)
            return self._capturer.foreground(pending, self._ranks, progress)

    def estimate_memory(self) -> MemoryEstimate:
        """Predict what ``capture()`` of the pending keys will cost the device, before capturing.

        For sizing a KV cache from the memory the graphs leave. Captures a few
        probe keys per mode (the largest, then about 8% of the others) into a
        pool of its own, measures them and extrapolates (``_estimate`` says
        how); takes a small share of the capture's time (the first call
        also pays for lazy initialization and compiles). Leaves nothing
        behind: the probes are freed, and torch's cache is emptied
        (``torch.cuda.empty_cache()``) at the start and at the end; only the
        driver keeps a few MiB of the probes' executables, which the capture
        after reuses. ``total_bytes`` predicts
        the drop of free memory over the ``capture()`` that follows, from
        that emptied cache (``CaptureReport.device_bytes``); memory allocated
        in between (a KV cache) does not change it. Synchronizes the calling
        stream. With ``ranks``, a collective: every rank calls it, and, as
        in ``capture()``, ranks whose plans differ or of which some cannot
        capture raise ``RanksDisagreeError`` on every rank before any probe
        (all disabled: ``CaptureDisabledError`` on every rank); a warm-up
        failing on one rank leaves the others in the model's collective
        until its timeout. A failing probe raises ``CaptureError`` naming
        its key, and nothing is kept.
        """
        with self._exclusive("estimate_memory"):
            self._agree_plan(self._capturer.pending())
            return self._capturer.estimate(self._no_graphs)

    def start_capture(self) -> BackgroundCapture:
        """Capture the plan's pending keys in a thread while ``run()`` keeps serving.

        Call it from the serving thread, on the stream steps run on. It
        returns once the capture thread has queued its warm-ups (the largest
        and the smallest pending key of each mode; the stream waits for them
        on the device, never the host); the keys are then recorded one by
        one, running nothing on the device, and each replays from the first
        step after its capture. Until then its steps run eagerly, counted as
        ``not_captured`` (allowed in ``strict`` mode while the capture runs),
        and the key is captured next. What the serving thread must not do
        meanwhile: the package README, "Serving from step 0". The handle
        reports progress, errors and the report (``wait()``).
        """
        with self._exclusive("start_capture"):
            if self._ranks is not None:
                raise RuntimeError(
                    "start_capture: a manager with ranks= captures with capture(), on every rank at once; "
                    "a background capture would interleave its collectives with the serving steps' "
                    "differently on each rank"
                )
            pending = [] if self._no_graphs is not None else self._capturer.pending()
            self._before_capture(len(pending))
            session = self._session = self._capturer.background(pending, self._no_graphs)
        return session

    def _agree_plan(self, pending: Sequence[PlannedKey[OutputT]]) -> None:
        """With ``ranks``: every rank captures (or probes) the same keys, or all raise before any."""
        if self._ranks is not None:
            unable = self._no_graphs or (
                None if capture_enabled() else "capture is disabled (set_capture_enabled(False))"
            )
            self._ranks.agree_plan([(key.mode, key.descriptor) for key in pending], can_capture=unable)

    def _before_capture(self, num_pending: int) -> None:
        """New graphs read the weights as they are now; the graphs kept must still read theirs."""
        if num_pending == len(self._keys):
            self._weights.take()
        else:
            self._weights.check()
        self._eager.released = False

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """Hold the step lock (waiting for a ``run`` in progress); refuse while a background capture runs."""
        with self._step_lock:
            session = self._session
            if session is not None and not session.done:
                raise RuntimeError(f"{what}: a background capture of this manager is running; wait() for it")
            yield

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
        ``run`` of this manager (a capture meanwhile leaves them intact; a
        replay of another manager sharing the pool does not); copy what must
        live longer. Without one the model runs eagerly (on the padded
        buffers where CUDA graphs are unavailable), counted per
        ``EagerReason``; ``strict`` raises ``NoGraphError`` instead. 0 tokens
        is an idle step: empty outputs, no model call. No autograd.
        ``run_batch``: the inputs in one mapping.
        """
        return self._step(inputs, uniform_decode, num_active_loras, invalid_modes)

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
        return self._step(inputs, uniform_decode, num_active_loras, invalid_modes)

    def _step(
        self,
        inputs: Mapping[str, torch.Tensor],
        uniform_decode: bool,
        num_active_loras: int,
        invalid_modes: frozenset[CUDAGraphMode],
    ) -> OutputT:
        """The step: check -> route -> copy in -> replay -> cut; or a step without a graph."""
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError(
                "CUDAGraphManager.run: another thread is inside run(), capture(), clear(), start_capture(), "
                "release() or estimate_memory() of this manager; its static buffers serve one step at a time "
                "(serialize the calls, or use a manager per thread)"
            )
        try:
            num_tokens, num_reqs, requires_grad = self._buffers.check(inputs, uniform_decode)
            ranks, pads_along = self._ranks, False
            route: Route
            if ranks is not None:  # one exchange: every rank takes the same route
                request = RankRequest(num_tokens, uniform_decode, num_active_loras)
                can_replay = all(key.entry is not None for key in self._keys.values())
                route, pads_along = ranks.route_step(
                    self._dispatcher, request, invalid_modes=invalid_modes, can_replay=can_replay
                )
            elif num_tokens == 0:
                return self._eager.idle(inputs)
            else:
                route = self._dispatcher.route(
                    num_tokens,
                    uniform_decode=uniform_decode,
                    num_active_loras=num_active_loras,
                    invalid_modes=invalid_modes,
                )
            key = self._keys[route.descriptor] if isinstance(route, Dispatch) else None  # the one look-up
            entry = key.entry if key is not None else None
            if key is not None and entry is not None:
                if self._weights.moved():  # a tensor the graphs read was assigned, or the model moved
                    self._weights.check()  # WeightsReplacedError names it, before a buffer is touched
                self._buffers.copy_in(
                    inputs, num_tokens, num_reqs, key.num_tokens, key.num_reqs, requires_grad
                )
                if self._guard is not None:
                    self._guard.retire(key.descriptor)
                if key.context is None:
                    entry.replay()
                else:
                    token = FORWARD_CONTEXT_VAR.set(key.context)
                    try:
                        entry.replay()
                    finally:
                        FORWARD_CONTEXT_VAR.reset(token)
                key.replays += 1
                counts = self._counts
                counts.padded_tokens += key.num_tokens - num_tokens
                if pads_along:
                    counts.dummy_steps += 1
                layout = self._layout.layout
                assert layout is not None  # set by the capture of every captured key
                out = key.cut(entry, layout, num_tokens, num_reqs)
                return out if self._guard is None else cast(OutputT, self._guard.hand_out(out))
            if num_tokens == 0:  # an idle rank
                if not pads_along:
                    return self._eager.idle(inputs)
                assert ranks is not None
                return self._eager.pad_along(
                    f"the other ranks of the {ranks.world_size} run this step eagerly"
                )
            request_args = (num_tokens, uniform_decode, num_active_loras, invalid_modes)
            return self._eager.run(inputs, num_reqs, route, key, request_args, self._session)
        finally:
            self._step_lock.release()
