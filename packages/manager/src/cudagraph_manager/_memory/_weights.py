"""The model's weights under live graphs: a graph reads each parameter and buffer at its captured address.

Updating weights in place keeps every graph valid; replacing a tensor does
not (the graphs keep reading the old storage). ``WeightWatch`` notices a
replacement before the next replay, cheaply (``needs_check``: an assignment
hook's flag, or the first parameter's address), and ``check()`` names the
replaced tensors (``WeightsReplacedError``). What it sees and what it cannot:
docs/design.md, "Weights under graphs".
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Final

import torch
from torch import nn

from .._compiled import CompiledModel

#: Where ``torch.compile`` keeps the module it compiled (its names are prefixed with it).
_COMPILED_PREFIX: Final = "_orig_mod."

#: (data_ptr, shape, dtype, device) of a watched tensor when the graphs were captured.
_Address = tuple[int, tuple[int, ...], torch.dtype, torch.device]

_watches: Final[weakref.WeakSet[WeightWatch]] = weakref.WeakSet()
_hooks_lock: Final = threading.RLock()  # the hooks' installation and _watches
_hooks_installed = False


class WeightsReplacedError(RuntimeError):
    """A parameter or buffer the captured graphs read was replaced by another tensor.

    Raised by ``run()`` before any static buffer is touched (and by
    ``check_weights()``, ``capture()``): replaying would read the old
    storage. ``names`` lists the replaced tensors. Update weights in place
    instead, or ``release()`` the graphs and capture them anew.
    """

    def __init__(self, names: tuple[str, ...], detail: str) -> None:
        shown = ", ".join(repr(name) for name in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        super().__init__(
            f"the model's {shown}{more} replaced since its CUDA graphs were captured ({detail}); the "
            "graphs would read the old memory. Update weights in place (param.copy_(new), "
            "load_state_dict(sd) without assign=True), or call release() and then start_capture() "
            "(or capture()) to capture them with the new tensors"
        )
        self.names: Final = names


#: The child under which torch.compile's ``OptimizedModule`` registers the module it compiled.
COMPILED_CHILD: Final = "_orig_mod"


def watched_module(model: object) -> nn.Module | None:
    """The ``nn.Module`` whose tensors ``model``'s graphs read: the model, its ``self``, what was compiled."""
    if isinstance(model, CompiledModel):
        return watched_module(model.model)
    if isinstance(model, functools.partial):
        return watched_module(model.func)
    if isinstance(model, nn.Module):
        original = dict(model.named_children()).get(COMPILED_CHILD)  # a compiled module: its original
        return original if isinstance(original, nn.Module) else model
    owner = getattr(model, "__self__", None)  # a bound method (model.forward)
    return watched_module(owner) if isinstance(owner, nn.Module) else None


class WeightWatch:
    """The addresses of a module's parameters and buffers when its graphs were captured.

    ``dirty`` and the first tensor's address are what a replay checks (see
    the module docstring); ``check()`` does the full comparison.
    """

    __slots__ = (
        "__weakref__",
        "_addresses",
        "_first",
        "_first_name",
        "_first_ptr",
        "_guards",
        "_last",
        "_module",
        "dirty",
        "kept",
    )

    def __init__(self, module: nn.Module | None) -> None:
        self._module: Final = module
        self._addresses: dict[str, _Address] = {}
        # The first parameter, looked up in its owner's table on each check: a conversion
        # that swaps the Parameter object in that table is seen too.
        self._first: Mapping[str, torch.Tensor | None] = {}
        self._first_name = ""
        self._first_ptr = 0
        self.dirty = False
        # The addresses the last graphs read (kept by ``forget()``), and whether ``take()`` found
        # the same tensors again: a compiled model then meets the guards it was compiled under.
        self._last: dict[str, _Address] = {}
        # What else a compiled model's guards read of each tensor: the object, its strides, requires_grad.
        self._guards: dict[str, tuple[int, tuple[int, ...], bool]] = {}
        self.kept = False
        if module is not None:
            _install_hooks()
            with _hooks_lock:
                _watches.add(self)

    def needs_check(self) -> bool:
        """Whether a replay must run ``check()`` first: a tensor was assigned, or the first one moved."""
        if self.dirty:
            return True
        first = self._first.get(self._first_name)
        return first is not None and first.data_ptr() != self._first_ptr

    def take(self) -> None:
        """Remember the address of every watched tensor (the graphs about to be captured read them)."""
        named = _named_tensors(self._module)
        self._addresses = {name: _address(t) for name, t in named.items()}
        guards = {name: (id(t), t.stride(), t.requires_grad) for name, t in named.items()}
        self.kept = bool(self._last) and self._addresses == self._last and guards == self._guards
        self._last, self._guards = self._addresses, guards
        first = next(
            (
                (module._parameters, name, param.data_ptr())
                for module in (self._module.modules() if self._module is not None else ())
                for name, param in module._parameters.items()
                if param is not None
            ),
            None,
        )
        self._first, self._first_name, self._first_ptr = first if first is not None else ({}, "", 0)
        self.dirty = False

    def before_capture(self, *, every_key: bool) -> None:
        """Before a capture: ``take()`` where ``every_key`` is captured anew, else ``check()``.

        New graphs read the weights as they are now; the graphs kept must still read theirs.
        """
        if every_key:
            self.take()
        else:
            self.check()

    def forget(self) -> None:
        """No graphs read the model any more (released or cleared): nothing to compare.

        The addresses are still remembered for ``take()``'s ``kept`` (a wake with the same tensors).
        """
        self._addresses = {}
        self._first, self._first_name, self._first_ptr = {}, "", 0
        self.dirty = False

    def check(self) -> None:
        """``WeightsReplacedError`` naming every watched tensor replaced since ``take()``; else clean."""
        if self._addresses:
            now = _named_tensors(self._module)
            replaced = tuple(
                name for name, was in self._addresses.items() if _address_or_none(now.get(name)) != was
            )
            if replaced:
                first = replaced[0]
                raise WeightsReplacedError(replaced, _describe(first, self._addresses[first], now.get(first)))
        self.dirty = False


def _named_tensors(module: nn.Module | None) -> dict[str, torch.Tensor]:
    if module is None:
        return {}
    named: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return {name.removeprefix(_COMPILED_PREFIX): t for name, t in named.items()}


def _address(tensor: torch.Tensor) -> _Address:
    return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tensor.device


def _address_or_none(tensor: torch.Tensor | None) -> _Address | None:
    return None if tensor is None else _address(tensor)


def _describe(name: str, was: _Address, now: torch.Tensor | None) -> str:
    """What happened to one replaced tensor, in words."""
    if now is None:
        return f"{name!r} was removed"
    ptr, shape, dtype, device = was
    if now.device != device:
        return f"{name!r} moved from {device} to {now.device}"
    if (tuple(now.shape), now.dtype) != (shape, dtype):
        return f"{name!r} changed from {dtype} {list(shape)} to {now.dtype} {list(now.shape)}"
    return f"{name!r} is another tensor (storage at {now.data_ptr():#x}, captured at {ptr:#x})"


def _mark_dirty(module: nn.Module, name: str, tensor: object) -> None:
    """torch's global registration hook: some module got a parameter or buffer assigned."""
    del module, name, tensor  # any module: the next replay's check() compares its own tensors
    with _hooks_lock:  # a WeakSet must not change while it is iterated (a manager built on another thread)
        watches = list(_watches)
    for watch in watches:
        watch.dirty = True


def _install_hooks() -> None:
    """Register the global parameter and buffer registration hooks, once per process."""
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        hook: Callable[[nn.Module, str, object], None] = _mark_dirty
        nn.modules.module.register_module_parameter_registration_hook(hook)
        nn.modules.module.register_module_buffer_registration_hook(hook)
        _hooks_installed = True
