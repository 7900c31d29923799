"""Capture first, then size the KV cache (issue 48), on the GPU: every step compared with eager.

Each backend (the reference decoder's row cache, and the paged decoder's
flex, gather, varlen and split_decode) over reserved memory: the graphs
captured while only the scratch page (or the request rows and the scratch
row) is backed, then the cache backed and served.

- 1,000 random steps per backend, in FULL and FULL_AND_PIECEWISE, captured
  in the foreground and in the background (serving meanwhile), each
  replay compared with the same step run eagerly; one step in ten carries
  a request whose block table (or cache row) names units past the ones
  backed: no device fault, the valid requests equal an eager step of them
  alone, and nothing but the scratch unit and the valid requests' own
  slots is written.
- Grow, shrink, a sleep that keeps the graphs and its wake, a full sleep
  and its wake: no recapture where the graphs were kept, the next step
  replays, refusals change nothing.
- After the start-up the device's free memory is the margin to within one
  chunk.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, KVCacheMemory, ManagerOptions
from cudagraph_manager.attention import AttentionOptions
from examples import DecoderConfig
from examples.inputs import make_paged_inputs, make_step_inputs
from examples.paged import PagedDecoder, max_flex_pages, paged_static_inputs, reserve_paged_cache
from examples.reference import ReferenceDecoder, reserve_row_cache, static_inputs
from tests.test_readmes import python_blocks
from tests.torch_support import rel_err

pytestmark = pytest.mark.gpu

M: Final = CUDAGraphMode
CONFIG: Final = DecoderConfig(
    num_layers=2,
    hidden_size=256,
    num_heads=4,
    intermediate_size=704,
    vocab_size=1024,
    max_num_seqs=16,
    max_seq_len=256,
)
#: Steps are drawn with a request to spare, for the wrong one a step may carry.
DRAW: Final = dataclasses.replace(CONFIG, max_num_seqs=CONFIG.max_num_seqs - 1)
SIZES: Final = CaptureSizes([1, 2, 4, 8, 16, 24, 32, 48, 64])
LARGEST: Final = 64
#: bf16 activations: a padded replay against an unpadded eager step (other GEMM kernels).
TOLERANCE: Final = 3e-2
#: The backends and their page sizes (rows: the reference decoder's row cache).
BACKENDS: Final = {"rows": 0, "flex": 64, "gather": 16, "varlen": 16, "split_decode": 16}
#: Units backed for serving, of a reservation of MAX_UNITS.
SERVED: Final = {"rows": 96, "paged": 600}
MAX_UNITS: Final = {"rows": 256, "paged": 4096}
#: 1,000 steps per backend: four cases of 250 (two modes, two kinds of capture).
STEPS: Final = 250
WRONG_EVERY: Final = 10
MIB: Final = 2**20
CHUNK: Final = 2 * MIB
ROOT: Final = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # mode downgrades (split_decode), flex's notes
        yield
    gc.collect()
    torch.cuda.empty_cache()


@dataclasses.dataclass
class Served:
    """A model over reserved memory and its manager."""

    attention: str
    model: ReferenceDecoder | PagedDecoder
    manager: CUDAGraphManager[torch.Tensor]
    kv: KVCacheMemory

    @property
    def paged(self) -> bool:
        return isinstance(self.model, PagedDecoder)

    def close(self) -> None:
        self.manager.release()
        self.kv.close()


def _serving(attention: str, mode: CUDAGraphMode, *, seed: int = 0, max_units: int | None = None) -> Served:
    torch.manual_seed(seed)
    dispatch = DispatchConfig(mode, SIZES, max_num_seqs=CONFIG.max_num_seqs)
    if attention == "rows":
        kv = reserve_row_cache(CONFIG, max_rows=max_units or MAX_UNITS["rows"], device="cuda")
        model: ReferenceDecoder | PagedDecoder = ReferenceDecoder(CONFIG, device="cuda", kv_cache=kv)
        options: ManagerOptions[torch.Tensor] = ManagerOptions(kv_cache=kv)
        manager = CUDAGraphManager(model.forward, static_inputs(CONFIG), dispatch, options=options)
        return Served(attention, model, manager, kv)
    kv = reserve_paged_cache(
        CONFIG, page_size=BACKENDS[attention], max_pages=max_units or MAX_UNITS["paged"], device="cuda"
    )
    model = PagedDecoder(CONFIG, backend=attention, device="cuda", kv_cache=kv)
    options = ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend), kv_cache=kv)
    manager = CUDAGraphManager(model, paged_static_inputs(model.layout), dispatch, options=options)
    if attention == "flex":
        with torch.no_grad():
            model.warm_up(LARGEST)  # compiled before anything is captured
    return Served(attention, model, manager, kv)


def _row_step(
    served: Served, num_tokens: int, uniform: bool, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A random step of the row cache on rows anywhere in the rows backed (the scratch row excepted)."""
    inputs = make_step_inputs(DRAW, num_tokens, uniform_decode=uniform, generator=generator)
    scratch = CONFIG.scratch_row
    pool = torch.randperm(served.kv.units - 1, generator=generator)
    pool = pool + (pool >= scratch).long()  # every backed row but the scratch row
    rows = inputs["cache_rows"]
    remap = torch.full((DRAW.max_num_seqs,), -1, dtype=torch.int64)
    distinct = torch.tensor(sorted(set(rows.tolist())), dtype=torch.int64)
    remap[distinct] = pool[: distinct.numel()]
    return {**{k: v.cuda() for k, v in inputs.items()}, "cache_rows": remap[rows].cuda()}


def _step(
    served: Served, num_tokens: int, uniform: bool, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    model = served.model
    if not isinstance(model, PagedDecoder):
        return _row_step(served, num_tokens, uniform, generator)
    return make_paged_inputs(
        DRAW,
        model.layout,
        num_tokens,
        uniform_decode=uniform,
        generator=generator,
        device="cuda",
        num_pages=served.kv.units,
    )


def _no_request(served: Served) -> dict[str, torch.Tensor]:
    """A step of no request: what ``_with_wrong_request`` adds its request to, alone."""
    empty = torch.zeros(0, dtype=torch.int64, device="cuda")
    model = served.model
    if not isinstance(model, PagedDecoder):
        return {"input_ids": empty, "positions": empty, "cache_rows": empty}
    none = torch.zeros(0, dtype=torch.int32, device="cuda")
    table = torch.zeros(0, model.layout.pages_per_seq, dtype=torch.int32, device="cuda")
    return {
        "input_ids": empty,
        "positions": empty,
        "slot_mapping": empty,
        "query_lens": none,
        "seq_lens": none,
        "block_table": table,
    }


def _with_wrong_request(
    served: Served, inputs: dict[str, torch.Tensor], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """``inputs`` and one more request of one token whose units lie past those backed (in the reservation)."""
    kv, model = served.kv, served.model
    past = int(torch.randint(kv.units, kv.max_units, (), generator=generator))
    token = torch.randint(0, CONFIG.vocab_size, (1,), generator=generator).cuda()
    if not isinstance(model, PagedDecoder):
        return {
            "input_ids": torch.cat([inputs["input_ids"], token]),
            "positions": torch.cat([inputs["positions"], torch.tensor([5], device="cuda")]),
            "cache_rows": torch.cat([inputs["cache_rows"], torch.tensor([past], device="cuda")]),
        }
    layout = model.layout
    length = int(torch.randint(1, layout.max_seq_len + 1, (), generator=generator))
    row = torch.randint(
        kv.units, kv.max_units, (1, layout.pages_per_seq), generator=generator, dtype=torch.int32
    )
    row[0, 0] = past
    page = int(row[0, (length - 1) // layout.page_size])
    return {
        "input_ids": torch.cat([inputs["input_ids"], token]),
        "positions": torch.cat([inputs["positions"], torch.tensor([length - 1], device="cuda")]),
        "slot_mapping": torch.cat(
            [
                inputs["slot_mapping"],
                torch.tensor([page * layout.page_size + (length - 1) % layout.page_size]).cuda(),
            ]
        ),
        "query_lens": torch.cat([inputs["query_lens"], torch.ones(1, dtype=torch.int32, device="cuda")]),
        "seq_lens": torch.cat([inputs["seq_lens"], torch.tensor([length], dtype=torch.int32, device="cuda")]),
        "block_table": torch.cat([inputs["block_table"], row.cuda()]),
    }


def _written_units(served: Served, inputs: dict[str, torch.Tensor]) -> set[int]:
    """The units a valid step writes its K/V to (pages of its slots, or its rows), and the scratch unit."""
    model = served.model
    if isinstance(model, PagedDecoder):
        return {0, *(inputs["slot_mapping"] // model.layout.page_size).tolist()}
    return {CONFIG.scratch_row, *inputs["cache_rows"].tolist()}


#: How an eager step refuses a unit past those backed: by the input's name (on a replay it is clamped).
_REFUSED: Final = r"^(cache_rows|block_table|slot_mapping): .*backed"


def _run_or_refusal(
    manager: CUDAGraphManager[torch.Tensor], inputs: dict[str, torch.Tensor], uniform: bool
) -> torch.Tensor | ValueError:
    """The step's outputs, or the ``ValueError`` an eager step refuses it with."""
    try:
        return manager.run_batch(inputs, uniform_decode=uniform)
    except ValueError as error:
        return error


def _serve(served: Served, steps: int, seed: int, *, wrong_every: int = WRONG_EVERY) -> float:
    """``steps`` random steps through the manager, each against an eager step; the worst relative error."""
    generator = torch.Generator().manual_seed(seed)
    manager, model, kv = served.manager, served.model, served.kv
    worst = 0.0
    with torch.no_grad():
        for i in range(steps):
            uniform = i % 2 == 0
            high = DRAW.max_num_seqs if uniform else LARGEST - 1
            num_tokens = int(torch.randint(1, high + 1, (), generator=generator))
            valid = _step(served, num_tokens, uniform, generator)
            wrong = wrong_every > 0 and i % wrong_every == wrong_every - 1
            inputs = _with_wrong_request(served, valid, generator) if wrong else valid
            small = kv.units * kv.unit_bytes < 2**30  # a snapshot of what is backed, where it is small
            before = kv.tensor[: kv.units].clone() if wrong and small else None
            outcome = _run_or_refusal(manager, inputs, uniform)
            if isinstance(outcome, ValueError):  # an eager step (a background capture under way)
                assert wrong, outcome
                assert re.match(_REFUSED, str(outcome)), outcome  # refused by the input's name
                continue
            replayed = outcome[:num_tokens].clone()
            if before is not None:  # the wrong request wrote the scratch unit only
                changed = (kv.tensor[: kv.units] != before).flatten(1).any(1).nonzero().flatten().tolist()
                assert set(changed) <= _written_units(served, valid), (served.attention, changed)
            expected = model.step(valid, uniform_decode=uniform)
            assert torch.isfinite(replayed).all()
            worst = max(worst, rel_err(replayed, expected))
    return worst


CASES: Final = [
    pytest.param(attention, mode, background, id=f"{attention}-{mode.name}-{'bg' if background else 'fg'}")
    for attention in BACKENDS
    for mode in (M.FULL, M.FULL_AND_PIECEWISE)
    for background in (False, True)
]


@pytest.mark.parametrize(("attention", "mode", "background"), CASES)
def test_random_steps_over_a_cache_backed_after_the_capture_equal_eager(
    attention: str, mode: CUDAGraphMode, background: bool
) -> None:
    served = _serving(attention, mode, seed=len(attention))
    manager, kv = served.manager, served.kv
    assert kv.memory.backed_bytes == -(-kv.min_units * kv.unit_bytes // CHUNK) * CHUNK  # min_units alone
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    try:
        with torch.cuda.stream(stream):
            if background:
                units = manager.back_kv_cache(units=SERVED["paged" if served.paged else "rows"])
                session = manager.start_capture()
                with pytest.raises(
                    RuntimeError, match="back_kv_cache: a background capture of this manager is running"
                ):
                    manager.back_kv_cache(units=units + 1)
                worst = _serve(served, STEPS // 2, seed=1)  # served while it captures
                session.wait()
                assert not session.errors
                worst = max(worst, _serve(served, STEPS - STEPS // 2, seed=2))
            else:
                report = manager.capture(progress=False)  # against min_units alone
                assert report.kv_cache is not None
                assert report.kv_cache.units == kv.units
                units = manager.back_kv_cache(units=SERVED["paged" if served.paged else "rows"])
                worst = _serve(served, STEPS, seed=3)
        stream.synchronize()
        assert worst < TOLERANCE, f"{attention} {mode.name}: worst relative error {worst}"
        stats = manager.stats
        assert stats.num_replays >= STEPS // 2, stats
        assert stats.kv_cache is not None
        assert stats.kv_cache.units == units
    finally:
        served.close()


@pytest.mark.parametrize("attention", list(BACKENDS))
def test_grow_shrink_sleep_and_wake_need_no_recapture(attention: str) -> None:
    served = _serving(attention, M.FULL_AND_PIECEWISE, seed=7)
    manager, kv = served.manager, served.kv
    base = SERVED["paged" if served.paged else "rows"]
    try:
        report = manager.capture(progress=False)
        assert report.kv_cache is not None
        assert f"{report.kv_cache.units} of {kv.max_units} units backed" in str(report)
        captured = manager.num_captured
        assert manager.back_kv_cache(units=base) >= base
        assert _serve(served, 20, seed=10) < TOLERANCE

        grown = manager.back_kv_cache(units=2 * base)  # grow: the new units are served at once
        assert grown >= 2 * base
        replays = manager.stats.num_replays
        assert _serve(served, 20, seed=11) < TOLERANCE
        assert manager.stats.num_replays > replays
        assert manager.num_captured == captured

        with pytest.raises(ValueError, match=r"in_use: unit\(s\) \[.*\] in use lie at or past the new end"):
            manager.back_kv_cache(units=base, in_use=[1, grown - 1])
        assert kv.units == grown
        assert manager.back_kv_cache(units=base, in_use=range(base)) >= base  # shrink
        assert _serve(served, 20, seed=12) < TOLERANCE
        assert manager.num_captured == captured

        free = torch.cuda.mem_get_info()[0]
        assert manager.drop_kv_cache() == kv.units  # a sleep that keeps the graphs
        assert kv.units < base
        assert torch.cuda.mem_get_info()[0] > free
        with torch.no_grad():  # a step naming units no longer backed: the scratch unit, no fault
            replays = manager.stats.num_replays
            stale = _with_wrong_request(served, _no_request(served), torch.Generator().manual_seed(13))
            manager.run_batch(stale, uniform_decode=True)
            torch.cuda.synchronize()
            assert manager.stats.num_replays == replays + 1
        assert manager.back_kv_cache(units=base) >= base  # its wake: no recapture
        replays = manager.stats.num_replays
        assert _serve(served, 20, seed=14) < TOLERANCE
        assert manager.stats.num_replays > replays
        assert manager.num_captured == captured

        manager.release()  # a full sleep: the graphs too
        manager.drop_kv_cache()
        manager.capture(progress=False)  # its wake: the graphs first, then the cache
        assert manager.back_kv_cache(units=base) >= base
        assert _serve(served, 20, seed=15) < TOLERANCE
        assert manager.stats.kv_cache is not None
        assert manager.stats.kv_cache.changes == 7
    finally:
        served.close()


@pytest.mark.parametrize("attention", ["rows", "flex", "varlen", "gather"])
def test_after_the_start_up_the_device_has_the_margin_free_to_within_one_chunk(attention: str) -> None:
    """The start-up in the new order: capture, then back everything the device has free but the margin."""
    margin = 512 * MIB
    torch.manual_seed(0)
    dispatch = DispatchConfig(M.FULL_AND_PIECEWISE, SIZES, max_num_seqs=CONFIG.max_num_seqs)
    if attention == "rows":
        kv = reserve_row_cache(CONFIG, device="cuda")  # as many rows as the device could hold
        model: ReferenceDecoder | PagedDecoder = ReferenceDecoder(CONFIG, device="cuda", kv_cache=kv)
        options: ManagerOptions[torch.Tensor] = ManagerOptions(kv_cache=kv)
        manager = CUDAGraphManager(model.forward, static_inputs(CONFIG), dispatch, options=options)
    else:
        # FlexAttention's fused kernel addresses about 4 GiB of this layout (32-bit offsets): capped.
        cap = max_flex_pages(CONFIG, BACKENDS[attention]) if attention == "flex" else None
        kv = reserve_paged_cache(CONFIG, page_size=BACKENDS[attention], max_pages=cap, device="cuda")
        model = PagedDecoder(CONFIG, backend=attention, device="cuda", kv_cache=kv)
        options = ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend), kv_cache=kv)
        manager = CUDAGraphManager(model, paged_static_inputs(model.layout), dispatch, options=options)
    try:
        with torch.no_grad():
            if isinstance(model, PagedDecoder):
                model.warm_up(LARGEST)
            manager.capture(progress=False)
            units = manager.back_kv_cache(margin_bytes=margin)
            torch.cuda.synchronize()
            left = torch.cuda.mem_get_info()[0]
            if attention == "flex":  # the whole (capped) reservation backed, the rest of the device free
                assert units == kv.max_units
                assert left > margin + 8 * 2**30
            else:
                assert abs(left - margin) < CHUNK, (
                    left - margin
                ) / MIB  # the driver's page tables may take a little
                assert units * kv.unit_bytes > 8 * 2**30, "the cache should take most of the device"
            served = Served(attention, model, manager, kv)
            capped = kv.units == kv.max_units  # flex: every unit backed, none past them to name
            assert _serve(served, 10, seed=20, wrong_every=0 if capped else 5) < TOLERANCE
            if not capped:
                more = r"units: \d+ units need \d+ more bytes of device memory"
                with pytest.raises(ValueError, match=more):
                    manager.back_kv_cache(units=kv.max_units)  # more than is free: refused, nothing backed
            assert kv.units == units
    finally:
        manager.release()
        kv.close()
        del model, manager
        gc.collect()


def test_flex_refuses_a_cache_its_kernel_cannot_address() -> None:
    """Past ``max_flex_pages`` the fused kernel's 32-bit offsets would read wrong keys: refused by name."""
    pages = max_flex_pages(CONFIG, BACKENDS["flex"]) + 64
    kv = reserve_paged_cache(CONFIG, page_size=BACKENDS["flex"], max_pages=pages, device="cuda")
    try:
        model = PagedDecoder(CONFIG, backend="flex", device="cuda", kv_cache=kv)
        backed = kv.units
        with torch.no_grad(), pytest.raises(ValueError, match=r"^kv_cache: FlexAttention's fused kernel"):
            model.warm_up(LARGEST)  # its first forward: nothing was read
        assert kv.units == backed
    finally:
        kv.close()


def test_the_readmes_start_up_in_the_new_order_runs() -> None:
    (block,) = [
        b for b in python_blocks(ROOT / "packages/manager/README.md") if "back_kv_cache(margin_bytes" in b
    ]
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(block, "packages/manager/README.md", "exec"), namespace)
    manager, kv = namespace["manager"], namespace["kv"]
    assert isinstance(manager, CUDAGraphManager)
    assert isinstance(kv, KVCacheMemory)
    assert manager.stats.num_replays >= 1
    manager.release()
    kv.close()
    namespace.clear()
    gc.collect()
