"""A state machine over nested forward contexts, dispatch calls and exceptions.

The model is a plain stack of the contexts entered; after every step the
active context must be its top (or None when it is empty), whatever mix of
enters, exits, dispatches and raised exceptions led there.
"""

from __future__ import annotations

import contextlib
from typing import Final

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cudagraph_dispatch import (
    BatchDescriptor,
    CUDAGraphDispatcher,
    CUDAGraphMode,
    ForwardContext,
    get_forward_context,
    set_forward_context,
)
from tests.strategies import (
    active_lora_counts,
    dispatchers,
    forward_context_args,
    forward_context_extras,
    invalid_mode_sets,
    step_count,
    step_loras,
)

MAX_DEPTH: Final = 12


class _StepFailedError(Exception):
    """Stands for a model forward that raises inside its context."""


class ForwardContextMachine(RuleBasedStateMachine):
    """Drives set_forward_context like an engine loop; the model is the stack of entered contexts."""

    def __init__(self) -> None:
        super().__init__()
        # One ExitStack per level, innermost last: exits are strictly last-in, first-out.
        self.levels: list[contextlib.ExitStack] = []
        self.model: list[ForwardContext] = []
        self.dispatcher: CUDAGraphDispatcher | None = None

    @initialize(dispatcher=dispatchers)
    def start(self, dispatcher: CUDAGraphDispatcher) -> None:
        """Every run starts outside any context, with one dispatcher for its dispatch steps."""
        assert get_forward_context() is None
        self.dispatcher = dispatcher

    def _enter(self, mode: CUDAGraphMode, key: BatchDescriptor | None, extra: dict[str, object]) -> None:
        level = contextlib.ExitStack()
        entered = level.enter_context(set_forward_context(mode, key, **extra))
        self.levels.append(level)
        assert entered.runtime_mode is mode
        assert entered.batch_descriptor == key
        assert dict(entered.extra) == extra
        self.model.append(entered)

    @precondition(lambda self: len(self.model) < MAX_DEPTH)
    @rule(args=forward_context_args, extra=forward_context_extras)
    def enter(self, args: tuple[CUDAGraphMode, BatchDescriptor | None], extra: dict[str, object]) -> None:
        """Enter a context given directly (e.g. NONE for a warm-up, a key for capture)."""
        mode, key = args
        self._enter(mode, key, extra)

    @precondition(lambda self: len(self.model) < MAX_DEPTH)
    @rule(
        num_tokens=st.integers(min_value=0, max_value=700),
        uniform_decode=st.booleans(),
        num_active_loras=active_lora_counts,
        invalid_modes=invalid_mode_sets,
    )
    def dispatch_and_enter(
        self,
        num_tokens: int,
        uniform_decode: bool,
        num_active_loras: int,
        invalid_modes: frozenset[CUDAGraphMode],
    ) -> None:
        """An engine step: dispatch (which must leave the context alone), then enter its decision."""
        assert self.dispatcher is not None
        before = get_forward_context()
        num_tokens = step_count(self.dispatcher.config, num_tokens, uniform_decode)
        num_active_loras = step_loras(self.dispatcher.config, num_tokens, uniform_decode, num_active_loras)
        mode, key = self.dispatcher.dispatch(
            num_tokens,
            uniform_decode=uniform_decode,
            num_active_loras=num_active_loras,
            invalid_modes=invalid_modes,
        )
        assert get_forward_context() is before
        self._enter(mode, key, {"num_tokens": num_tokens})

    @precondition(lambda self: len(self.model) > 0)
    @rule()
    def exit(self) -> None:
        """Leave the innermost context; the one around it becomes active again."""
        self._exit_innermost(None)

    @precondition(lambda self: len(self.model) > 0)
    @rule()
    def exit_with_exception(self) -> None:
        """Leave the innermost context by an exception: it must propagate and the outer context come back."""
        self._exit_innermost(_StepFailedError("forward failed"))

    @precondition(lambda self: len(self.model) > 0)
    @rule(levels=st.integers(min_value=1, max_value=MAX_DEPTH))
    def fail_through(self, levels: int) -> None:
        """An exception unwinding several with-blocks at once restores the context outside all of them."""
        error = _StepFailedError("failed deep inside")
        for _ in range(min(levels, len(self.model))):
            self._exit_innermost(error)

    def _exit_innermost(self, error: _StepFailedError | None) -> None:
        level = self.levels.pop()
        if error is None:
            level.close()
        else:
            # What a with-block does when its body raises: __exit__ with the exception,
            # which must not be swallowed.
            suppressed = level.__exit__(type(error), error, error.__traceback__)
            assert suppressed is False
        self.model.pop()

    @rule(
        args=forward_context_args,
        extra=forward_context_extras,
    )
    def raise_inside_a_fresh_context(
        self, args: tuple[CUDAGraphMode, BatchDescriptor | None], extra: dict[str, object]
    ) -> None:
        """A forward that fails inside its own with-block leaves the surrounding context active."""
        mode, key = args
        before = get_forward_context()
        try:
            with set_forward_context(mode, key, **extra) as inside:
                assert get_forward_context() is inside
                raise _StepFailedError
        except _StepFailedError:
            pass
        assert get_forward_context() is before

    @invariant()
    def active_context_is_the_top_of_the_model(self) -> None:
        """The active context is always the innermost entered one, or None when nothing is entered."""
        expected = self.model[-1] if self.model else None
        assert get_forward_context() is expected

    def teardown(self) -> None:
        """Leave every context still open, innermost first, and check the machine ends outside all."""
        while self.levels:
            self._exit_innermost(None)
        assert get_forward_context() is None


ForwardContextMachine.TestCase.settings = settings(
    ForwardContextMachine.TestCase.settings, stateful_step_count=30
)
TestForwardContextMachine = ForwardContextMachine.TestCase
