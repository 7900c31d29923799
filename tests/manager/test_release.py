"""Release, wake and weights: graphs freed, brought back by a capture; replaced weights caught.

On both backends: after ``release()`` every step runs eagerly (counted as
``released``; strict raises), ``start_capture()`` or ``capture()`` captures
every key again, a running background capture is stopped by it; a parameter
or buffer replaced under live graphs (assigned, ``load_state_dict(...,
assign=True)``, moved) makes the next replayed step raise
``WeightsReplacedError`` naming it, before any static buffer is written,
while weights updated in place keep the graphs. Every served step is compared
with the model run eagerly on the current weights.
"""

from __future__ import annotations

import threading
import time
from typing import Final

import pytest
import torch
from torch import nn

from cudagraph_dispatch import CUDAGraphMode
from cudagraph_manager import CUDAGraphManager, NoGraphError, WeightsReplacedError
from cudagraph_manager._memory._weights import WeightWatch, watched_module
from tests.torch_support import rel_err

from .helpers import (
    SIZES,
    TOL,
    Backend,
    FirstRecordingGate,
    ToyModel,
    assert_unchanged,
    make_batch,
    make_manager,
    snapshot,
)

FULL: Final = CUDAGraphMode.FULL
MODES: Final = (FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)
WAIT_S: Final = 120.0


def _check_steps(
    manager: CUDAGraphManager[torch.Tensor], model: ToyModel, device: torch.device, seed: int
) -> None:
    """Steps of several sizes (mixed and uniform decode), each equal to eager on the current weights."""
    for i, tokens in enumerate((1, 3, 8, 17, 32)):
        reqs = min(tokens, 5)
        batch = make_batch(tokens, reqs, device, seed=seed + i)
        assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL, (seed, tokens)
        decode = make_batch(min(tokens, 16), min(tokens, 16), device, seed=seed + 100 + i)
        out = manager.run_batch(decode, uniform_decode=True)
        assert rel_err(out, model.eager(decode)) < TOL, (seed, tokens, "decode")


def _new_weights(model: ToyModel, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=g).to(t) for name, t in model.state_dict().items()}


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_release_serves_eagerly_and_a_capture_brings_every_graph_back(
    backend: Backend, mode: CUDAGraphMode
) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, mode)
    manager.capture(progress=False)
    planned = manager.num_captured
    assert planned > 0
    _check_steps(manager, model, backend.device, seed=0)
    manager.release()
    assert manager.num_captured == 0
    replays = manager.stats.num_replays
    _check_steps(manager, model, backend.device, seed=10)
    stats = manager.stats
    assert stats.num_replays == replays  # nothing replays after a release
    assert stats.eager_reasons.get("released", 0) == 10
    handle = manager.start_capture()  # the wake: steps are served meanwhile
    _check_steps(manager, model, backend.device, seed=20)
    assert handle.wait(WAIT_S).num_graphs == planned
    assert handle.errors == ()
    assert manager.num_captured == planned
    manager.reset_stats()
    _check_steps(manager, model, backend.device, seed=30)
    assert manager.stats.eager_steps == 0  # every step replays again
    manager.release()
    manager.capture(progress=False)  # a foreground wake works too
    assert manager.num_captured == planned
    _check_steps(manager, model, backend.device, seed=40)


def test_a_strict_manager_refuses_steps_after_a_release(backend: Backend) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, strict=True)
    manager.capture(progress=False)
    manager.release()
    batch = make_batch(5, 2, backend.device, seed=0)
    with pytest.raises(NoGraphError, match=r"released \(release\(\)\)"):
        manager.run_batch(batch)
    manager.capture(progress=False)
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL


def test_release_stops_a_running_background_capture() -> None:
    model = ToyModel(torch.device("cpu"))
    gate = FirstRecordingGate(WAIT_S)
    manager = gate.manager_on_cpu(model)
    handle = manager.start_capture()
    assert gate.entered.wait(WAIT_S)  # the largest key is being recorded
    releasing = threading.Thread(target=manager.release)
    releasing.start()
    batch = make_batch(4, 2, torch.device("cpu"), seed=0)
    deadline = time.monotonic() + WAIT_S
    while not manager.busy:  # release() holds the static buffers, waiting for the capture
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match=r"release\(\)"):
        manager.run_batch(batch)  # refused while release() runs on another thread, never mixed in
    gate.open()  # the key in progress finishes, no other starts
    releasing.join(WAIT_S)
    assert not releasing.is_alive()
    report = handle.wait(0)
    assert handle.done
    assert report.num_graphs == 1
    assert "stopped" in str(report.no_graphs)
    assert manager.num_captured == 0  # the one recorded was released too
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    assert manager.stats.eager_reasons == {"released": 1}


def test_weights_updated_in_place_keep_the_graphs(backend: Backend) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, CUDAGraphMode.FULL_AND_PIECEWISE)
    manager.capture(progress=False)
    model.load_state_dict(_new_weights(model, seed=1))  # copies into the same storages
    with torch.no_grad():
        model.w2.mul_(-0.5)
    manager.check_weights()  # nothing replaced
    _check_steps(manager, model, backend.device, seed=0)
    assert manager.stats.eager_steps == 0  # the graphs computed with the new weights


def _assign_new_tensor(model: ToyModel) -> None:
    model.w1 = nn.Parameter(model.w1.detach().clone() * 2, requires_grad=False)


def _load_with_assign(model: ToyModel) -> None:
    model.load_state_dict(_new_weights(model, seed=2), assign=True)


def _move_away_and_back(model: ToyModel) -> None:
    """``to()`` another device and back (on CPU: every ``param.data`` re-homed): new addresses.

    The old storages are held meanwhile, so the allocator cannot hand the
    same addresses back (a tensor back at its old address would be valid).
    """
    held = [param.data for param in model.parameters()]
    device = model.embed.device
    if device.type == "cpu":  # no second device here: re-home each parameter, which to() does too
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.clone()
    else:
        model.to("cpu")
        model.to(device)
    del held


REPLACEMENTS: Final = {
    "new_tensor": (_assign_new_tensor, ("w1",)),
    "assign_true": (_load_with_assign, ("embed", "w1", "w2")),
    "moved": (_move_away_and_back, ("embed", "w1", "w2")),
}


@pytest.mark.parametrize("how", list(REPLACEMENTS))
def test_a_replaced_weight_is_named_before_the_next_replay(backend: Backend, how: str) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, CUDAGraphMode.FULL_AND_PIECEWISE)
    manager.capture(progress=False)
    _check_steps(manager, model, backend.device, seed=0)
    replace, names = REPLACEMENTS[how]
    replace(model)
    before = snapshot(manager.static_buffers)
    batch = make_batch(6, 2, backend.device, seed=1)
    with pytest.raises(WeightsReplacedError, match=repr(names[0])) as caught:
        manager.run_batch(batch)
    assert caught.value.names == names
    assert_unchanged(before, manager.static_buffers)  # refused before a buffer was written
    with pytest.raises(WeightsReplacedError):  # and again: never a silent replay
        manager.run_batch(batch)
    with pytest.raises(WeightsReplacedError):
        manager.capture(progress=False)  # graphs kept would read the old tensors
    manager.release()
    manager.capture(progress=False)  # recaptured on the new tensors
    _check_steps(manager, model, backend.device, seed=2)
    assert manager.stats.eager_reasons.get("not_captured", 0) == 0


def test_eager_steps_need_no_check_and_data_swaps_are_caught_by_check_weights(backend: Backend) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model)
    manager.capture(progress=False)
    with torch.no_grad():
        model.w2.data = model.w2.data.clone()  # no hook sees it, and w2 is not the first parameter
    with pytest.raises(WeightsReplacedError, match="'w2' is another tensor"):
        manager.check_weights()
    batch = make_batch(40, 2, backend.device, seed=0)  # above the largest size: eager, no check needed
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    manager.release()
    manager.check_weights()  # no graphs, nothing to compare


def test_an_unrelated_module_assignment_costs_one_check_and_no_error(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model)
    manager.capture(progress=False)
    checks: list[WeightWatch] = []
    real_check = WeightWatch.check

    def counted(watch: WeightWatch) -> None:
        checks.append(watch)
        real_check(watch)

    monkeypatch.setattr(WeightWatch, "check", counted)
    other = nn.Linear(4, 4)
    other.weight = nn.Parameter(torch.zeros(4, 4))  # marks every watch dirty
    _check_steps(manager, model, backend.device, seed=0)
    assert manager.stats.eager_steps == 0
    assert len(checks) == 1  # the first replay's; the watch is clean again for the other nine
    assert max(SIZES) == 32  # _check_steps stays within the plan


def test_parameters_registered_on_other_threads_while_watches_are_built_raise_nothing() -> None:
    """torch's registration hook and new weight watches (a manager builds one) meet from several
    threads: no error, every watch marked."""
    errors: list[BaseException] = []
    done = threading.Event()

    def register_parameters() -> None:
        try:
            while not done.is_set():
                nn.Linear(2, 2)  # two parameters registered: the hook runs over every watch
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=register_parameters) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        watches = [WeightWatch(watched_module(ToyModel(torch.device("cpu")))) for _ in range(50)]
    finally:
        done.set()
        for thread in threads:
            thread.join(WAIT_S)
    assert errors == []
    nn.Linear(2, 2)
    assert all(watch.dirty for watch in watches)


def test_a_wake_with_the_weights_kept_says_so_and_a_replaced_weight_does_not() -> None:
    model = nn.Linear(4, 4)
    watch = WeightWatch(model)
    watch.take()
    assert not _kept(watch)  # the first capture: no earlier graphs
    watch.forget()  # release()
    with torch.no_grad():
        model.weight.copy_(torch.ones(4, 4))  # updated in place: the same tensors
    watch.take()  # the wake
    assert _kept(watch)
    watch.forget()
    model.weight = nn.Parameter(torch.zeros(4, 4))  # replaced: a compiled model may recompile
    watch.take()
    assert not _kept(watch)
    watch.forget()
    watch.take()  # the replacement is what the last graphs read now
    assert _kept(watch)


def test_a_wake_is_not_kept_where_a_compiled_models_guards_would_see_a_change() -> None:
    """Same storage, but another parameter object, other strides or requires_grad: dynamo may recompile."""
    model = nn.Linear(4, 4)
    watch = WeightWatch(model)
    watch.take()
    changes = (
        lambda: model.requires_grad_(False),
        lambda: setattr(model, "weight", nn.Parameter(model.weight.data, requires_grad=False)),
        lambda: setattr(model, "weight", nn.Parameter(model.weight.data.t(), requires_grad=False)),
    )
    for change in changes:
        watch.forget()
        change()
        watch.take()
        assert not _kept(watch), change
        watch.forget()
        watch.take()  # nothing changed since
        assert _kept(watch)


def _kept(watch: WeightWatch) -> bool:
    return watch.kept
