"""Model-level CUDA graphs: dispatch, capture and replay over static buffers.

``CUDAGraphManager`` is the facade over the package's layers
(docs/design.md, "Layers"): its parts (``_parts``: model, dispatcher, static buffers, counters),
the step path (``_step``), the captures (``_capture``), the weights the
graphs read (``_memory``), the reports (``_reports``) and the ranks
(``ranks``). A step is one screen (``CUDAGraphManager._run_step``):

    check the inputs -> route -> build the metadata -> copy in -> entry.replay() -> count and cut

or, when the route is a reason instead of a graph, an eager step counted per
reason (``_step/_eager``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Final, Generic, TypeAlias, cast

import torch
from torch import Tensor

from cudagraph_capture import OutputGuard
from cudagraph_dispatch import (
    FORWARD_CONTEXT_VAR,
    NO_MODES,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    Dispatch,
    DispatchConfig,
    Route,
    StepRequest,
    check_bool,
)

from ._arguments import check_arguments
from ._attention._seam import StepBatch
from ._capture._background import BackgroundCapture
from ._capture._capturer import Capturer, agree_plan
from ._capture._planned import replays_by_size
from ._options import ManagerOptions
from ._parts import ManagerParts
from ._protocols import OutputT
from ._reports._report import CaptureReport, ManagerStats, MemoryEstimate
from ._step._decode_loop import LoopResult
from ._step._eager import EagerSteps
from ._step._static import StaticInput

_Modes: TypeAlias = frozenset[CUDAGraphMode]  # a step's invalid modes


class CUDAGraphManager(Generic[OutputT]):
    """Captures a model's forward as CUDA graphs and replays them, one call per step.

    ``model`` takes the ``inputs`` as keywords and returns a tensor or a flat
    tuple, list or dict of tensors; each input gets a static buffer on
    ``device`` (default: the current CUDA device, else the CPU, where every
    step runs eagerly on the padded buffers). ``config`` decides which
    graphs exist. ``strict`` raises ``NoGraphError`` where a step would run
    eagerly. ``options`` (``ManagerOptions``) holds the rest: the capture
    engines' options and factory, which count each output's rows follow, a
    debug check of overwritten outputs, the ranks that step together, the
    attention (``AttentionOptions``: its support, strictness and metadata
    builder) and a decode loop for ``run_loop``. One step at a time: ``run``
    while another thread is inside a method of this manager raises
    ``RuntimeError``. README and docs/design.md say more.
    """

    def __init__(
        self,
        model: Callable[..., OutputT],
        inputs: Mapping[str, StaticInput],
        config: DispatchConfig,
        *,
        device: torch.device | str | int | None = None,
        strict: bool = False,
        options: ManagerOptions[OutputT] | None = None,
    ) -> None:
        checked = check_arguments(model, inputs, config, device, strict, options)
        given: ManagerOptions[OutputT] = ManagerOptions() if options is None else options
        ranks = given.ranks
        parts = self._parts = ManagerParts.of(
            model, checked, strict, None if ranks is None else ranks.world_size
        )
        self._dispatcher: Final = parts.dispatcher
        self._buffers: Final = parts.buffers
        self._layout: Final = parts.layout  # from the first outputs seen
        self._counts: Final = parts.counts
        self._guard: Final = _output_guard() if given.check_overwritten_outputs else None
        self._ranks: Final = ranks
        self._eager: Final = EagerSteps(parts)
        self._capturer: Final = Capturer(parts, checked.factory, checked.options, given.decode_loop)
        self._keys: Final = self._capturer.keys  # the plan's keys; a key's entry says if it is captured
        self._step_lock: Final = threading.Lock()
        self._weights: Final = self._capturer.weights  # the tensors the graphs read

    # -- accessors --

    @property
    def device(self) -> torch.device:
        return self._parts.device

    @property
    def dispatcher(self) -> CUDAGraphDispatcher:
        """The dispatcher built from ``config``: the graphs that exist are its keys."""
        return self._dispatcher

    @property
    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        """The static input buffers by name (read-only mapping; the tensors are the live buffers)."""
        return MappingProxyType({b.name: b.tensor for b in self._buffers.buffers})

    @property
    def busy(self) -> bool:
        """Whether a call of this manager holds its static buffers now (a ``run`` would raise)."""
        return self._step_lock.locked()

    @property
    def num_captured(self) -> int:
        """How many keys of the capture plan have a captured graph."""
        return sum(key.entry is not None for key in self._keys.values())

    @property
    def stats(self) -> ManagerStats:
        """A snapshot of what ``run`` did since construction or ``reset_stats``."""
        return self._counts.snapshot(replays_by_size(self._keys.values()), self._parts.resolution)

    def reset_stats(self) -> None:
        for key in self._keys.values():
            key.reset_replays()
        self._counts.reset()

    def clear(self) -> None:
        """Free every captured graph (the pool stays usable); ``capture()`` captures them anew."""
        with self._exclusive("clear"):
            self._capturer.drop_all()

    def release(self) -> None:
        """Free every graph and give its memory back to the device; steps run eagerly until a capture.

        For a sleep mode: stops a running background capture first. Steps run
        as ``EagerReason.RELEASED``, the static buffers stay, the last outputs
        are invalid. Wake with ``start_capture()`` or ``capture()`` (README).
        """
        with self._step_lock:
            if self._guard is not None:
                self._guard.retire_all()
            self._capturer.release()  # stops a background capture first, gives the memory back last

    def check_weights(self) -> None:
        """Raise ``WeightsReplacedError`` if a tensor the captured graphs read was replaced.

        Replays notice assigned parameters or buffers and a moved model; call
        this after a reload that did neither (``param.data = t``).
        """
        self._weights.check()

    # -- capture --

    def capture(self, *, progress: bool | None = None) -> CaptureReport:
        """Capture every key of the plan not captured yet (PIECEWISE, then FULL, largest first, one pool).

        Per key: a warm-up on pad values, then a recording that runs nothing
        (the last ``run``'s outputs stay intact), then its outputs are checked
        against ``output_rows``. ``progress``: a tqdm bar (default: when
        stderr is a terminal). A ``CaptureError`` names the key; keys before
        it stay captured. Synchronizes the calling stream once, at the end.
        With ``ranks``, a collective: the ranks agree on the plan first
        (``RanksDisagreeError`` on all), then keep each key on all or none.
        """
        if progress is not None:
            check_bool("progress", progress)
        with self._exclusive("capture"):
            pending = self._capturer.pending()
            self._capturer.begin(pending)
            agree_plan(self._ranks, pending, self._parts.no_graphs)
            return self._capturer.foreground(pending, self._ranks, progress)

    def estimate_memory(self) -> MemoryEstimate:
        """Predict what ``capture()`` of the pending keys will cost the device, before capturing.

        For sizing a KV cache: a few probe keys per mode are captured into a
        pool of their own, measured and freed (``_capture/_estimate``).
        ``total_bytes`` predicts the drop of free memory over the next
        ``capture()`` (its ``device_bytes``). Synchronizes the calling stream.
        With ``ranks``, a collective, with ``capture()``'s plan agreement.
        """
        with self._exclusive("estimate_memory"):
            agree_plan(self._ranks, self._capturer.pending(), self._parts.no_graphs)
            return self._capturer.estimate(self._ranks)

    def start_capture(self) -> BackgroundCapture:
        """Capture the plan's pending keys in a thread while ``run()`` keeps serving.

        Call it from the serving thread, on the stream steps run on; it
        returns once the thread queued its warm-ups. Each key replays from
        the step after its capture; until then its steps run eagerly as
        ``not_captured`` (allowed in ``strict`` mode meanwhile). What the
        serving thread must not do meanwhile: README, "Serving from step 0".
        """
        with self._exclusive("start_capture"):
            if self._ranks is not None:
                raise RuntimeError(_NO_BACKGROUND_WITH_RANKS)
            pending = self._capturer.pending()
            self._capturer.begin(pending)
            return self._capturer.background(pending)

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """Hold the step lock (waiting for a ``run`` in progress); refuse while a background capture runs."""
        with self._step_lock:
            if self._capturer.running() is not None:
                raise RuntimeError(f"{what}: a background capture of this manager is running; wait() for it")
            yield

    # -- run --

    def run(
        self,
        /,
        *,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = NO_MODES,
        **inputs: torch.Tensor,
    ) -> OutputT:
        """Run one step: replay its graph on the padded batch, or run the model eagerly.

        Bad inputs raise ``ValueError`` naming the input before a buffer is
        touched. The outputs are cut to the real rows: views of graph memory,
        valid until the next ``run`` or ``run_loop`` of this manager (copy
        what must live longer). A step without a graph is counted per ``EagerReason``
        (``strict`` raises ``NoGraphError``); 0 tokens is an idle step.
        Inputs that require grad give outputs detached from them (the step
        copies them into static buffers under ``no_grad``; no gradient flows
        back): the first such step warns once per manager, naming them.
        """
        return self._run_step(inputs, uniform_decode, num_active_loras, invalid_modes)

    def run_batch(
        self,
        inputs: Mapping[str, torch.Tensor],
        /,
        *,
        uniform_decode: bool = False,
        num_active_loras: int = 0,
        invalid_modes: frozenset[CUDAGraphMode] = NO_MODES,
    ) -> OutputT:
        """``run`` with the inputs in one mapping (mypy rejects ``run(**batch)`` of a dict)."""
        given: object = inputs  # checked inline: the step path calls nothing of ours before the route
        if given.__class__ is not dict and not isinstance(given, Mapping):
            raise ValueError(
                f"inputs: expected a mapping of input names to tensors, got {type(given).__name__}"
            )
        return self._run_step(inputs, uniform_decode, num_active_loras, invalid_modes)

    def _run_step(
        self, inputs: Mapping[str, torch.Tensor], uniform_decode: bool, loras: int, invalid: _Modes
    ) -> OutputT:
        """One step: check -> route -> build -> copy in -> replay -> count and cut; or ``without_graph``."""
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError(_BUSY)
        try:
            num_tokens, num_reqs, requires_grad = self._buffers.check(inputs, uniform_decode)
            if self._ranks is not None:  # one exchange: every rank takes the same route
                route, dummy = self._agreed_route(StepRequest(num_tokens, uniform_decode, loras, invalid))
            elif num_tokens == 0:
                return self._eager.idle(inputs)
            else:
                route, dummy = self._dispatcher.route(num_tokens, uniform_decode, loras, invalid), False
            key = self._keys[route.descriptor] if isinstance(route, Dispatch) else None  # the one look-up
            entry = None if key is None else key.entry
            if key is None or entry is None:
                request = StepRequest(num_tokens, uniform_decode, loras, invalid)
                return self._eager.without_graph(inputs, request, num_reqs, route, key, dummy, self._capturer)
            if self._weights.moved():  # a tensor the graphs read was assigned, or the model moved
                self._weights.check()  # WeightsReplacedError names it, before a buffer is touched
            # The attention's metadata first: a builder refuses a batch before a static buffer is touched.
            ctx = key.context if key.builder is None else key.build(StepBatch(num_tokens, num_reqs, inputs))
            self._buffers.copy_in(inputs, num_tokens, num_reqs, key.num_tokens, key.num_reqs, requires_grad)
            if ctx is None:
                entry.replay()
            else:  # a PIECEWISE replay runs its eager breaks, which read the forward context
                token = FORWARD_CONTEXT_VAR.set(ctx)
                try:
                    entry.replay()
                finally:
                    FORWARD_CONTEXT_VAR.reset(token)
            out = key.replayed(entry, self._layout.layout, num_tokens, num_reqs)
            self._counts.padded_tokens += key.num_tokens - num_tokens
            if dummy:
                self._counts.dummy_steps += 1
            return out if self._guard is None else cast(OutputT, self._guard.replayed(key.descriptor, out))
        finally:
            self._step_lock.release()

    def run_loop(
        self,
        batch: Mapping[str, torch.Tensor] | None = None,
        /,
        *,
        max_steps: int | None = None,
        **inputs: Tensor,
    ) -> LoopResult:
        """Up to ``max_steps`` decode steps of a uniform batch in one call (``ManagerOptions.decode_loop``).

        The inputs as keywords or in one mapping (``batch``), one token per
        request, checked as ``run`` checks. On the device where ``capture()``
        captured the key's loop, else on the host. Synchronizes once;
        ``LoopResult.tokens`` is valid until the next ``run_loop`` or capture.
        """
        loops = self._capturer.loops
        if loops is None:
            raise RuntimeError("run_loop: this manager was built without ManagerOptions(decode_loop=...)")
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError(_BUSY)
        try:
            return loops.call(batch, inputs, max_steps, self._weights)
        finally:
            self._step_lock.release()

    def _agreed_route(self, request: StepRequest) -> tuple[Route, bool]:
        """The route every rank takes (one exchange), and whether this rank runs a dummy step along."""
        assert self._ranks is not None
        can_replay = all(key.entry is not None for key in self._keys.values())
        return self._ranks.route_step(self._dispatcher, request, can_replay=can_replay)


_BUSY: Final = (
    "CUDAGraphManager.run: another thread is inside run(), capture(), clear(), start_capture(), "
    "release() or estimate_memory() of this manager; its static buffers serve one step at a time "
    "(serialize the calls, or use a manager per thread)"
)
_NO_BACKGROUND_WITH_RANKS: Final = (
    "start_capture: a manager with ranks (ManagerOptions.ranks) captures with capture(), "
    "on every rank at once; a background capture would interleave its collectives with the "
    "serving steps' differently on each rank"
)


def _output_guard() -> OutputGuard:
    """``OutputGuard()``, its error naming the manager's argument that asked for it."""
    try:
        return OutputGuard()
    except ValueError as error:
        raise ValueError(f"options.check_overwritten_outputs: {error}") from None
