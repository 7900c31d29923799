"""CUDAGraphManager behaviour: replay equals eager in every mode, padding, stats, strict mode.

Most tests run on two backends (see ``helpers``): ``cpu`` drives the manager
with a fake engine that keeps the graph contract, ``cuda`` with the real
engines (marked ``gpu``). A few are CUDA-only (what only real graphs show) or
CPU-only (the capture phase's surroundings, the report's text).
"""

from __future__ import annotations

import functools
import gc
import random
import re
import warnings
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.functional import linear

from cudagraph_capture import CaptureOptions
from cudagraph_dispatch import (
    BatchDescriptor,
    CaptureSizes,
    CUDAGraphMode,
    DispatchConfig,
    get_forward_context,
)
from cudagraph_manager import CaptureReport, CUDAGraphManager, ManagerOptions, NoGraphError, StaticInput
from cudagraph_manager._values._reports import CapturedGraph, ManagerStats

from .helpers import (
    ALL_MODES,
    DIM,
    INPUTS,
    MAX_NUM_SEQS,
    SIZES,
    TOL,
    Backend,
    DictModel,
    FakeEngines,
    ToyModel,
    assert_unchanged,
    config_for,
    highest_fp32_matmul_precision,
    make_batch,
    make_manager,
    rel_err,
    snapshot,
)

FULL = CUDAGraphMode.FULL
PIECEWISE = CUDAGraphMode.PIECEWISE
NONE = CUDAGraphMode.NONE


def batch_plan(seed: int, count: int) -> list[tuple[int, int, bool]]:
    """``(num_tokens, num_reqs, uniform)`` batches: fixed corner cases, then seeded random ones.

    Sizes go up to 40, above the largest capture size (32), so some run
    eagerly; uniform (q = 1: one token per request) where it fits max_num_seqs.
    """
    plan = [(3, 3, True), (5, 2, False), (32, MAX_NUM_SEQS, False), (40, 7, False), (16, 16, True)]
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, 40)
        uniform = n <= MAX_NUM_SEQS and rng.random() < 0.5
        plan.append((n, n if uniform else rng.randint(1, min(n, MAX_NUM_SEQS)), uniform))
    return plan


# ---------------------------------------------------------------------------
# Outputs equal eager
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
def test_replay_matches_eager_in_every_mode(backend: Backend, mode: CUDAGraphMode) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, mode)
    report = manager.capture()
    planned = sum(len(keys) for _, keys in manager.dispatcher.capture_plan())
    assert report.num_graphs == manager.num_captured == planned > 0

    replays: Counter[tuple[CUDAGraphMode, int]] = Counter()
    eager = padded = 0
    for i, (n, r, uniform) in enumerate(batch_plan(seed=len(mode.name), count=12)):
        batch = make_batch(n, r, backend.device, seed=i)
        out = manager.run_batch(batch, uniform_decode=uniform)
        err = rel_err(out, model.eager(batch))
        assert err < TOL, f"{mode.name}: {n} tokens, {r} reqs, uniform={uniform}: rel err {err:.2e}"
        decision = manager.dispatcher.dispatch(n, uniform_decode=uniform)
        if decision.mode is NONE:
            eager += 1
        else:
            replays[(decision.mode, decision.descriptor.num_tokens)] += 1
            padded += decision.descriptor.num_tokens - n

    stats = manager.stats
    assert dict(stats.replays) == dict(replays)
    assert (stats.eager_steps, stats.uncaptured_steps, stats.padded_tokens) == (eager, 0, padded)
    # The plan reached the graphs of both routines and the eager path.
    assert stats.replays_of(mode.decode_mode()) > 0
    assert stats.eager_steps > 0
    if mode.mixed_mode() is not NONE:
        assert stats.replays_of(mode.mixed_mode()) > 0


def test_uniform_decode_with_speculative_tokens(backend: Backend) -> None:
    """q = 2 tokens per request: uniform batches replay FULL graphs keyed num_reqs = size // 2."""
    model = ToyModel(backend.device)
    config = config_for(CUDAGraphMode.FULL_AND_PIECEWISE, query_len=2)
    manager = make_manager(backend, model, config=config)
    manager.capture()
    for i, reqs in enumerate((1, 3, 5, 8, 12, 16)):
        batch = make_batch(2 * reqs, reqs, backend.device, seed=i)
        out = manager.run_batch(batch, uniform_decode=True)
        assert rel_err(out, model.eager(batch)) < TOL
        if reqs == 3:  # 6 tokens: the graph for 8 tokens reads 4 request rows, the 4th is padding
            assert manager.static_buffers["scale"][3].item() == 1.0
    mixed = make_batch(5, 2, backend.device, seed=99)
    assert rel_err(manager.run_batch(mixed), model.eager(mixed)) < TOL
    stats = manager.stats
    assert stats.replays_of(FULL) == 6
    assert stats.replays_of(PIECEWISE) == 1
    assert stats.eager_steps == 0


@pytest.mark.parametrize("mode", [FULL, PIECEWISE], ids=lambda m: m.name)
def test_dict_outputs_are_cut_per_output_rows(backend: Backend, mode: CUDAGraphMode) -> None:
    model = DictModel(backend.device)
    manager: CUDAGraphManager[dict[str, torch.Tensor]] = CUDAGraphManager(
        model,
        INPUTS,
        config_for(mode),
        device=backend.device,
        options=ManagerOptions(output_rows=DictModel.OUTPUT_ROWS, engine_factory=backend.factory),
    )
    manager.capture()
    for i, (n, r) in enumerate([(5, 3), (8, 8), (40, 9)]):  # padded, exact, eager
        batch = make_batch(n, r, backend.device, seed=i)
        out = manager.run_batch(batch)
        expected = model.eager_dict(batch)
        assert out.keys() == expected.keys()
        assert out["hidden"].shape == (n, DIM)
        assert rel_err(out["hidden"], expected["hidden"]) < TOL
        assert torch.equal(out["per_req"], expected["per_req"])  # [r]: cut to the requests
        assert torch.equal(out["bias2"], expected["bias2"])  # [DIM]: never cut
    assert manager.stats.num_replays == 2


# ---------------------------------------------------------------------------
# Static buffers and padding
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [FULL, PIECEWISE], ids=lambda m: m.name)
def test_padding_rows_are_refilled_every_run(backend: Backend, mode: CUDAGraphMode) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, mode)
    manager.capture()
    buffers = manager.static_buffers
    full = make_batch(8, 8, backend.device, seed=1)
    manager.run_batch(full)
    assert torch.equal(buffers["x"][:8], full["x"])  # the batch went into the buffers

    small = make_batch(5, 3, backend.device, seed=2)  # pads to 8 tokens and 8 request rows
    out = manager.run(ids=small["ids"], x=small["x"], scale=small["scale"], bias=small["bias"])
    assert torch.equal(buffers["ids"][:5], small["ids"])
    assert torch.equal(buffers["ids"][5:8], torch.zeros(3, dtype=torch.int64, device=backend.device))
    assert torch.equal(buffers["x"][:5], small["x"])
    assert torch.equal(buffers["x"][5:8], torch.zeros(3, DIM, device=backend.device))
    assert torch.equal(buffers["scale"][:3], small["scale"])
    assert torch.equal(buffers["scale"][3:8], torch.ones(5, device=backend.device))
    assert torch.equal(buffers["bias"], small["bias"])
    assert rel_err(out, model.eager(small)) < TOL


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
def test_each_graph_sees_its_rows_of_the_static_buffers(backend: Backend, mode: CUDAGraphMode) -> None:
    """Tokens inputs: the key's num_tokens rows; reqs inputs: its num_reqs, else min(tokens, max_num_seqs)."""
    model = ToyModel(backend.device)
    seen: dict[BatchDescriptor, dict[str, tuple[int, ...]]] = {}

    def recording(**inputs: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        assert context is not None
        if context.runtime_mode is not NONE:  # the capture call (replays of real graphs run no Python)
            assert context.batch_descriptor is not None
            seen[context.batch_descriptor] = {name: tuple(t.shape) for name, t in inputs.items()}
        return model.eager(inputs)

    config = config_for(mode, query_len=2)
    manager: CUDAGraphManager[torch.Tensor] = CUDAGraphManager(
        recording,
        INPUTS,
        config,
        device=backend.device,
        options=ManagerOptions(engine_factory=backend.factory),
    )
    manager.capture()
    assert seen.keys() == manager.dispatcher.keys(FULL) | manager.dispatcher.keys(PIECEWISE)
    for key, shapes in seen.items():
        reqs = key.num_reqs if key.num_reqs is not None else min(key.num_tokens, MAX_NUM_SEQS)
        expected = {"ids": (key.num_tokens,), "x": (key.num_tokens, DIM), "scale": (reqs,), "bias": (DIM,)}
        assert shapes == expected, key


def test_static_buffers_are_allocated_once_with_pad_values(backend: Backend) -> None:
    manager = make_manager(backend, ToyModel(backend.device))
    buffers = manager.static_buffers
    assert buffers["ids"].shape == (max(SIZES),)
    assert buffers["x"].shape == (max(SIZES), DIM)
    assert buffers["scale"].shape == (MAX_NUM_SEQS,)
    assert buffers["bias"].shape == (DIM,)
    assert bool((buffers["scale"] == 1.0).all())
    assert not bool(buffers["ids"].any())
    addresses = {name: b.data_ptr() for name, b in buffers.items()}
    manager.capture()
    manager.run_batch(make_batch(5, 3, backend.device, seed=0))
    assert {name: b.data_ptr() for name, b in manager.static_buffers.items()} == addresses


def test_an_input_may_already_be_its_static_buffer(backend: Backend) -> None:
    """Zero-copy use: views of the static buffers as inputs (real rows are copied before padding)."""
    model = ToyModel(backend.device)
    manager = make_manager(backend, model)
    manager.capture()
    batch = make_batch(5, 3, backend.device, seed=3)
    buffers = manager.static_buffers
    views: dict[str, torch.Tensor] = {}
    for name, tensor in batch.items():
        target = buffers[name] if name == "bias" else buffers[name][: tensor.shape[0]]
        target.copy_(tensor)
        views[name] = target
    out = manager.run_batch(views)
    assert rel_err(out, model.eager(batch)) < TOL


def test_outputs_alias_graph_memory_until_the_next_run(backend: Backend) -> None:
    manager = make_manager(backend, ToyModel(backend.device))
    manager.capture()
    first = manager.run_batch(make_batch(8, 4, backend.device, seed=1))
    kept = first.clone()
    second = manager.run_batch(make_batch(8, 4, backend.device, seed=2))
    assert first.data_ptr() == second.data_ptr()
    assert torch.equal(first, second)  # the first run's output was overwritten...
    assert not torch.equal(first, kept)  # ...so a caller must copy what it keeps


def test_inputs_that_require_grad_leave_no_autograd_history(backend: Backend) -> None:
    """The outputs are detached from inputs that require grad: said once per manager, naming them (#33)."""
    model = ToyModel(backend.device)
    manager = make_manager(backend, model)
    manager.capture()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for n in (5, 40, 5):  # replayed, eager, replayed again: one warning
            batch = make_batch(n, 3, backend.device, seed=n)
            batch["x"].requires_grad_(True)
            out = manager.run_batch(batch)
            assert not out.requires_grad
            for name, buffer in manager.static_buffers.items():
                assert not buffer.requires_grad, name
                assert buffer.grad_fn is None, name
    assert [(w.category, w.filename) for w in warned] == [(UserWarning, __file__)]  # at the caller's run
    detached = r"^CUDAGraphManager.run: input\(s\) \['x'\] require grad, but the outputs are detached"
    assert re.search(detached, str(warned[0].message))
    other = make_manager(Backend.of(backend.name), model)  # once per manager: another says it again
    with pytest.warns(UserWarning, match=r"input\(s\) \['x', 'scale'\] require grad"):
        other.run_batch({**batch, "scale": batch["scale"].requires_grad_(True)})


# ---------------------------------------------------------------------------
# Stats, eager steps, strict mode
# ---------------------------------------------------------------------------


def test_stats_count_replays_eager_steps_and_padding(backend: Backend) -> None:
    manager = make_manager(backend, ToyModel(backend.device))
    manager.capture()
    for n in (3, 8, 8, 40):  # 3 pads to 4; 40 is above the largest size
        manager.run_batch(make_batch(n, 2, backend.device, seed=n))
    stats = manager.stats
    assert dict(stats.replays) == {(FULL, 4): 1, (FULL, 8): 2}
    assert (stats.num_replays, stats.eager_steps, stats.uncaptured_steps, stats.padded_tokens) == (3, 1, 0, 1)
    assert stats.replays_of(PIECEWISE) == 0
    assert str(stats) == (
        "3 replays (FULL 4: 1, FULL 8: 2), 1 eager steps (above_largest_size: 1), "
        "0 idle steps, 0 dummy steps, 1 padded tokens"
    )

    manager.run_batch(make_batch(1, 1, backend.device, seed=0))
    assert stats.num_replays == 3  # a snapshot: later runs do not change it
    manager.reset_stats()
    assert manager.stats == ManagerStats({}, 0, 0, 0)


def test_runs_before_capture_are_eager_and_counted(backend: Backend) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model)
    batch = make_batch(5, 3, backend.device, seed=4)
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    assert (manager.stats.eager_steps, manager.stats.uncaptured_steps, manager.stats.num_replays) == (1, 1, 0)
    manager.capture()
    assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    assert (manager.stats.eager_steps, manager.stats.uncaptured_steps, manager.stats.num_replays) == (1, 1, 1)


def test_lora_batches_replay_the_graph_of_their_adapter_count(backend: Backend) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, config=config_for(FULL, lora_counts=(2,)))
    manager.capture()
    assert manager.num_captured == 2 * len(SIZES)
    batch = make_batch(6, 3, backend.device, seed=5)
    for loras in (0, 1, 2):
        assert rel_err(manager.run_batch(batch, num_active_loras=loras), model.eager(batch)) < TOL
    assert manager.stats.replays == {(FULL, 8): 3}
    manager.run_batch(batch, num_active_loras=3)  # more adapters than any graph holds
    assert manager.stats.eager_steps == 1


def test_strict_mode_raises_where_a_batch_would_run_eagerly(backend: Backend) -> None:
    manager = make_manager(backend, ToyModel(backend.device), strict=True)
    batch = make_batch(8, 4, backend.device, seed=6)
    before = snapshot(manager.static_buffers)
    with pytest.raises(NoGraphError, match=r"8 tokens: .*not captured yet; call capture\(\) first"):
        manager.run_batch(batch)
    assert_unchanged(before, manager.static_buffers)

    manager.capture()
    manager.run_batch(batch)
    before = snapshot(manager.static_buffers)
    with pytest.raises(NoGraphError, match="40 tokens exceed the largest capture size 32") as info:
        manager.run_batch(make_batch(40, 4, backend.device, seed=7))
    assert info.value.num_tokens == 40
    with pytest.raises(NoGraphError, match="num_active_loras=1 exceeds the largest captured count 0"):
        manager.run_batch(batch, num_active_loras=1)
    with pytest.raises(
        NoGraphError, match=r"mode FULL has no graph for a mixed batch with invalid_modes \['FULL'\]"
    ):
        manager.run_batch(batch, invalid_modes=frozenset({FULL}))
    assert_unchanged(before, manager.static_buffers)
    assert (manager.stats.eager_steps, manager.stats.num_replays) == (0, 1)


def test_strict_full_decode_only_raises_on_mixed_batches(backend: Backend) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, CUDAGraphMode.FULL_DECODE_ONLY, strict=True)
    manager.capture()
    decode = make_batch(6, 6, backend.device, seed=8)
    assert rel_err(manager.run_batch(decode, uniform_decode=True), model.eager(decode)) < TOL
    with pytest.raises(NoGraphError, match="mode FULL_DECODE_ONLY has no graph for a mixed batch"):
        manager.run_batch(make_batch(6, 2, backend.device, seed=9))


def test_config_mode_none_runs_everything_eagerly(backend: Backend) -> None:
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, NONE)
    assert manager.capture().num_graphs == 0
    # Every kind of step: a capture size, between sizes, the largest, above it, uniform decodes.
    steps = [(4, 2, False), (5, 3, False), (max(SIZES), 4, False), (max(SIZES) + 3, 4, False)]
    steps += [(n, n, True) for n in (1, 3, 8)]
    for seed, (tokens, reqs, uniform) in enumerate(steps):
        batch = make_batch(tokens, reqs, backend.device, seed=10 + seed)
        out = manager.run_batch(batch, uniform_decode=uniform)
        assert rel_err(out, model.eager(batch)) < TOL, (tokens, uniform)
    stats = manager.stats
    assert (stats.eager_steps, stats.num_replays, stats.padded_tokens) == (len(steps), 0, 0)
    batch = make_batch(4, 2, backend.device, seed=10)
    strict = make_manager(backend, model, NONE, strict=True)
    with pytest.raises(NoGraphError, match="the config's mode is NONE"):
        strict.run_batch(batch)


# ---------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------


def test_capture_follows_the_plan_and_reports_each_graph(backend: Backend) -> None:
    manager = make_manager(backend, ToyModel(backend.device), CUDAGraphMode.FULL_AND_PIECEWISE)
    report = manager.capture()
    plan = [(mode, key) for mode, keys in manager.dispatcher.capture_plan() for key in keys]
    assert [(g.mode, g.descriptor) for g in report.graphs] == plan  # PIECEWISE, then FULL, largest first
    assert plan[0] == (PIECEWISE, BatchDescriptor(max(SIZES)))
    assert all(g.seconds >= 0.0 and g.pool_bytes >= 0 for g in report.graphs)
    assert report.seconds >= max(g.seconds for g in report.graphs)
    assert len(str(report).splitlines()) == 4 + len(plan) + 1  # title, phases, header, rule, rows, total
    again = manager.capture()
    assert again.num_graphs == 0
    assert manager.num_captured == len(plan)


def test_capture_pauses_gc_and_restores_it_also_on_error() -> None:
    torch.manual_seed(0)
    seen: list[tuple[bool, int]] = []

    def observe() -> None:
        seen.append((gc.isenabled(), gc.get_freeze_count()))
        if len(seen) == 3:
            raise RuntimeError("capture failed")

    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    engines = FakeEngines(on_capture=observe)
    model = ToyModel(torch.device("cpu"))
    manager: CUDAGraphManager[torch.Tensor] = CUDAGraphManager(
        model, INPUTS, config_for(FULL), device="cpu", options=ManagerOptions(engine_factory=engines)
    )
    with pytest.raises(RuntimeError, match="capture failed"):
        manager.capture()
    assert len(seen) == 3
    assert all(not enabled and frozen > 0 for enabled, frozen in seen)
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen_before
    # The graphs captured before the error are used; the rest run eagerly, counted.
    assert manager.num_captured == 2  # 32 and 24 tokens
    manager.run_batch(make_batch(30, 4, torch.device("cpu"), seed=0))
    manager.run_batch(make_batch(3, 2, torch.device("cpu"), seed=1))
    assert (manager.stats.num_replays, manager.stats.uncaptured_steps) == (1, 1)


@pytest.mark.parametrize("progress", [True, False, None])
def test_capture_progress_bar(capsys: pytest.CaptureFixture[str], progress: bool | None) -> None:
    pytest.importorskip("tqdm")
    manager: CUDAGraphManager[torch.Tensor] = CUDAGraphManager(
        ToyModel(torch.device("cpu")),
        INPUTS,
        config_for(FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines()),
    )
    manager.capture(progress=progress)
    err = capsys.readouterr().err
    if progress:
        assert "Capturing CUDA graphs" in err
    else:  # None: only on a terminal, and pytest's stderr is not one
        assert err == ""


def test_output_rows_are_checked_at_the_warm_up() -> None:
    def first_row(**inputs: torch.Tensor) -> torch.Tensor:
        return inputs["x"][:1]  # [1, DIM] whatever the batch: not per token

    manager: CUDAGraphManager[torch.Tensor] = CUDAGraphManager(
        first_row,
        INPUTS,
        config_for(FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines()),
    )
    with pytest.raises(ValueError, match=r"model output: shape \(1, 32\) does not have the 32 rows"):
        manager.capture()
    assert manager.num_captured == 0
    unsliced: CUDAGraphManager[torch.Tensor] = CUDAGraphManager(
        first_row,
        INPUTS,
        config_for(FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines(), output_rows=None),
    )
    unsliced.capture()
    batch = make_batch(5, 3, torch.device("cpu"), seed=0)
    assert torch.equal(unsliced.run_batch(batch), batch["x"][:1])


def test_tuple_and_list_outputs_are_cut_by_index() -> None:
    def pair(**inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs["x"] * 2.0, inputs["scale"] + 1.0  # [T, DIM], [R]

    def listed(**inputs: torch.Tensor) -> list[torch.Tensor]:
        return [inputs["x"] * 2.0, inputs["scale"] + 1.0]

    batch = make_batch(5, 3, torch.device("cpu"), seed=0)
    tupled: CUDAGraphManager[tuple[torch.Tensor, torch.Tensor]] = CUDAGraphManager(
        pair,
        INPUTS,
        config_for(FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines(), output_rows=("tokens", "reqs")),
    )
    tupled.capture()
    doubled, scaled = tupled.run_batch(batch)
    assert torch.equal(doubled, batch["x"] * 2.0)
    assert torch.equal(scaled, batch["scale"] + 1.0)
    as_list: CUDAGraphManager[list[torch.Tensor]] = CUDAGraphManager(
        listed,
        INPUTS,
        config_for(PIECEWISE),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines(), output_rows=("tokens", "reqs")),
    )
    as_list.capture()
    out = as_list.run_batch(batch)
    assert type(out) is list
    assert [t.shape for t in out] == [(5, DIM), (3,)]
    assert tupled.stats.num_replays == as_list.stats.num_replays == 1


def test_report_prints_an_aligned_table() -> None:
    graphs = (
        CapturedGraph(FULL, BatchDescriptor(512, 256), 0.0123, 3 * 2**20, 4 * 2**20, 0.004, 0.006, 0.002),
        CapturedGraph(
            FULL,
            BatchDescriptor(8, 8, uniform=True, has_lora=True, num_active_loras=2),
            0.001,
            1536,
            2 * 2**20,
            0.0,
            0.0006,
            0.0003,
        ),
        CapturedGraph(PIECEWISE, BatchDescriptor(1), 0.0005, 0),
    )
    report = CaptureReport(graphs, seconds=0.25, reserved_bytes=5 * 2**30, device_bytes=5 * 2**30 + 6 * 2**20)
    lines = str(report).splitlines()
    assert lines[0] == (
        "Captured 3 CUDA graph(s) in 0.250 s; pool 3.0 MiB, reserved 5.0 GiB, "
        "device 5.0 GiB (outside the allocator 6.0 MiB)"
    )
    # The phases: the graphs' sums, and what the capture's wall time spent besides.
    assert lines[1] == "warm-up 0.004 s, recording 0.007 s, instantiation 0.002 s, rest 0.237 s"
    table = lines[2:]
    header = "mode tokens reqs uniform loras seconds warm-up record instantiate pool driver"
    assert table[0].split() == header.split()
    assert len({len(line) for line in table}) == 1  # every column aligned, the last right-aligned
    row = "FULL 512 256 no 0 0.0123 0.0040 0.0060 0.0020 3.0 MiB 4.0 MiB"
    assert table[2].split() == row.split()
    assert table[3].split()[:9] == ["FULL", "8", "8", "yes", "2", "0.0010", "0.0000", "0.0006", "0.0003"]
    assert table[4].split()[:6] == ["PIECEWISE", "1", "-", "no", "0", "0.0005"]
    assert table[5].split() == ["total", "0.0138", "0.0040", "0.0066", "0.0023", "3.0", "MiB", "6.0", "MiB"]
    assert report.pool_bytes == 3 * 2**20 + 1536
    assert report.outside_allocator_bytes == 6 * 2**20
    assert report.num_graphs == 3
    assert graphs[0].rest_seconds == pytest.approx(0.0123 - 0.004 - 0.006 - 0.002)
    phases = report.phases
    assert phases.warmup + phases.recording + phases.instantiation + phases.rest == pytest.approx(0.25)


def test_a_fake_capture_splits_its_seconds_into_phases() -> None:
    """Each key's seconds add up from its warm-up, recording, instantiation and rest, all >= 0."""
    manager = CUDAGraphManager(
        ToyModel(torch.device("cpu")),
        INPUTS,
        config_for(FULL),
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines(), warm_ups="every_key"),
    )
    report = manager.capture(progress=False)
    assert report.num_graphs > 1
    for graph in report.graphs:
        assert graph.warmup_seconds > 0  # the fake runs the model in both
        assert graph.recording_seconds > 0
        assert graph.instantiation_seconds == 0.0  # the fake builds nothing
        assert graph.rest_seconds >= 0
    assert report.phases.rest >= 0


def test_stats_snapshot_sums_by_mode() -> None:
    stats = ManagerStats(
        {(FULL, 8): 2, (FULL, 4): 1, (PIECEWISE, 8): 5}, eager_steps=1, uncaptured_steps=0, padded_tokens=3
    )
    assert (
        stats.num_replays,
        stats.replays_of(FULL),
        stats.replays_of(PIECEWISE),
        stats.replays_of(NONE),
    ) == (
        8,
        3,
        5,
        0,
    )


# ---------------------------------------------------------------------------
# CUDA only: what only real graphs show
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "calls_per_replay"), [(FULL, 0), (PIECEWISE, 1)], ids=["FULL", "PIECEWISE"])
def test_replays_run_python_only_at_eager_breaks(mode: CUDAGraphMode, calls_per_replay: int) -> None:
    """A FULL replay runs no Python of the model; a PIECEWISE one runs its eager break."""
    torch.manual_seed(0)
    backend = Backend.of("cuda")
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, mode)
    manager.capture()
    calls = model.request_scale.calls
    for seed in range(3):
        manager.run_batch(make_batch(8, 4, backend.device, seed=seed))
    assert model.request_scale.calls == calls + 3 * calls_per_replay
    assert manager.stats.num_replays == 3


@pytest.mark.gpu
def test_replays_pass_the_engine_the_tensors_it_captured() -> None:
    """With the engines' address check on, every replay gets the captured buffers' addresses."""
    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    model = ToyModel(device)
    manager: CUDAGraphManager[torch.Tensor] = CUDAGraphManager(
        model,
        INPUTS,
        config_for(CUDAGraphMode.FULL_AND_PIECEWISE),
        device=device,
        options=ManagerOptions(capture=CaptureOptions(check_input_addresses=True)),
    )
    with highest_fp32_matmul_precision():
        manager.capture()
        for i, (n, r, uniform) in enumerate([(3, 3, True), (5, 2, False), (16, 16, True), (20, 9, False)]):
            batch = make_batch(n, r, device, seed=i)
            assert rel_err(manager.run_batch(batch, uniform_decode=uniform), model.eager(batch)) < TOL
    assert manager.stats.num_replays == 4


def _pointwise(t: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(t) * t + 1.0


@functools.cache
def _compiled_pointwise() -> Callable[[torch.Tensor], torch.Tensor]:
    compiled: Callable[[torch.Tensor], torch.Tensor] = torch.compile(_pointwise, dynamic=True)
    return compiled


class _CompiledModel(nn.Module):
    """A Linear, then a ``torch.compile``'d pointwise function: ``[T, DIM] -> [T, DIM]``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM, device=device) / DIM**0.5, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _compiled_pointwise()(linear(x, self.w))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return _pointwise(linear(x, self.w))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [FULL, PIECEWISE], ids=lambda m: m.name)
def test_captures_a_model_with_a_compiled_function(mode: CUDAGraphMode) -> None:
    pytest.importorskip("triton")
    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    model = _CompiledModel(device)
    manager: CUDAGraphManager[torch.Tensor] = CUDAGraphManager(
        model, {"x": StaticInput((DIM,))}, config_for(mode, sizes=(2, 8)), device=device
    )
    with highest_fp32_matmul_precision():
        manager.capture()
        for n in (8, 5, 2):
            x = torch.randn(n, DIM, device=device)
            assert rel_err(manager.run(x=x), model.reference(x)) < TOL
    assert manager.stats.num_replays == 3


@pytest.mark.gpu
def test_captures_the_51_default_sizes() -> None:
    """vLLM's default sizes up to 512, FULL: every graph captured, a large padded batch is right."""
    torch.manual_seed(0)
    backend = Backend.of("cuda")
    config = DispatchConfig(FULL, CaptureSizes.default(512), 256)
    model = ToyModel(backend.device)
    manager = make_manager(backend, model, config=config)
    batch = make_batch(300, 200, backend.device, seed=0)  # pads to 304
    with highest_fp32_matmul_precision():
        report = manager.capture()
        assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    assert report.num_graphs == manager.num_captured == 51
    assert manager.stats.replays == {(FULL, 304): 1}


@pytest.mark.parametrize("policy", ["auto", "per_class"])
def test_a_first_capture_per_class_warms_each_class_up_once(
    monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """Per class (the default where nothing compiled): each class's first key and each mode's smallest.

    The other keys record without a warm-up of their own (``warmup_seconds``
    0); every replay still matches eager.
    """
    from cudagraph_manager._graphs import _warm_up

    monkeypatch.setattr(_warm_up, "dynamo_compiles", lambda: None)  # nothing compiled in this process
    engines = FakeEngines()
    model = ToyModel(torch.device("cpu"))
    options: ManagerOptions[torch.Tensor] = ManagerOptions(engine_factory=engines, warm_ups=policy)  # type: ignore[arg-type]  # a name
    manager = CUDAGraphManager(
        model, INPUTS, config_for(CUDAGraphMode.FULL_AND_PIECEWISE), device="cpu", options=options
    )
    report = manager.capture(progress=False)
    plan = manager.dispatcher.capture_plan()
    expected = [(keys[0], keys[-1]) for _, keys in plan]  # one class per mode here: largest, smallest
    warmed = [g.descriptor for g in report.graphs if g.warmup_seconds > 0]
    assert warmed == [key for pair in expected for key in pair]
    assert sum(e.warm_ups for e in engines.engines.values()) == len(warmed) < report.num_graphs
    with highest_fp32_matmul_precision():
        steps = [(n, min(n, 2), False) for n in (1, 3, 5, max(SIZES))] + [(n, n, True) for n in (1, 3, 16)]
        for num_tokens, num_reqs, uniform in steps:
            batch = make_batch(num_tokens, num_reqs, torch.device("cpu"), seed=num_tokens)
            assert rel_err(manager.run_batch(batch, uniform_decode=uniform), model.eager(batch)) < TOL
    assert manager.stats.eager_steps == 0


@pytest.mark.parametrize("mode", [FULL, CUDAGraphMode.FULL_AND_PIECEWISE])
def test_a_recapture_warms_up_only_the_smallest_key_of_each_mode(mode: CUDAGraphMode) -> None:
    """A key's first capture warms it up (``"every_key"``); a recapture (clear(), release()) one key per mode.

    The keys' compiles and plans were made by their first warm-up; the
    smallest key of each mode is warmed again for the capturing thread.
    Every replay after the recapture still matches eager.
    """
    engines = FakeEngines()
    model = ToyModel(torch.device("cpu"))
    options: ManagerOptions[torch.Tensor] = ManagerOptions(engine_factory=engines, warm_ups="every_key")
    manager = CUDAGraphManager(model, INPUTS, config_for(mode), device="cpu", options=options)
    first = manager.capture(progress=False)
    plan = manager.dispatcher.capture_plan()
    assert sum(e.warm_ups for e in engines.engines.values()) == first.num_graphs  # every first use
    assert all(g.warmup_seconds > 0 for g in first.graphs)
    for recapture in (manager.clear, manager.release):
        recapture()
        before = {m: e.warm_ups for m, e in engines.engines.items()}
        report = manager.capture(progress=False)
        assert {m: e.warm_ups - before[m] for m, e in engines.engines.items()} == {m: 1 for m, _ in plan}
        warmed = [g.descriptor for g in report.graphs if g.warmup_seconds > 0]
        assert warmed == [keys[-1] for _, keys in plan]  # the smallest of each mode
        for num_tokens in (1, 3, max(SIZES)):
            batch = make_batch(num_tokens, min(num_tokens, 2), torch.device("cpu"), seed=num_tokens)
            assert rel_err(manager.run_batch(batch), model.eager(batch)) < TOL
    assert manager.stats.eager_steps == 0
