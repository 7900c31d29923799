"""Every paged backend in every mode and page size on the GPU, against the float64 oracle.

For each backend x mode x page size: 50 random ragged steps (block tables
redrawn every step, prefill chunks mixed with decodes, uniform decodes in
between), each replayed by the manager and compared with the oracle
(``dense_reference``: float64 attention over each request's logical keys).
The counters are checked exactly: FULL replays where the backend's level
allows them, PIECEWISE or eager steps (with their reason) where it does not.
A background capture serves the same steps while it captures.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Final

import pytest
import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig, EagerReason
from cudagraph_dispatch.support import GraphSupport
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.attention import AttentionOptions
from examples import DecoderConfig
from examples.inputs import make_paged_inputs
from examples.paged import PagedDecoder, PagedLayout, paged_static_inputs
from tests.manager.oracles import dense_reference
from tests.torch_support import rel_err

pytestmark = pytest.mark.gpu

M: Final = CUDAGraphMode
CONFIG: Final = DecoderConfig(num_layers=2, max_num_seqs=32, max_seq_len=256)
LARGEST: Final = 64
STEPS: Final = 50
#: bf16 activations against float64 attention over the same bf16 cache.
TOLERANCE: Final = 3e-2
MODES: Final = (M.FULL, M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY, M.PIECEWISE)
#: (backend, page size): FlexAttention's kernel reads keys in blocks of 64, the others take any page.
CASES: Final = (
    ("flex", 64),
    ("flex", 128),
    ("gather", 16),
    ("gather", 64),
    ("varlen", 16),
    ("varlen", 64),
    ("split_decode", 16),
    ("split_decode", 64),
)


@pytest.fixture(autouse=True)
def _quiet_downgrades() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _model(backend: str, page_size: int, seed: int) -> PagedDecoder:
    torch.manual_seed(seed)
    layout = PagedLayout.for_config(CONFIG, page_size=page_size)
    return PagedDecoder(CONFIG, layout=layout, backend=backend, device="cuda")


def _manager(model: PagedDecoder, mode: CUDAGraphMode) -> CUDAGraphManager[torch.Tensor]:
    dispatch = DispatchConfig(mode, CaptureSizes.default(LARGEST), max_num_seqs=CONFIG.max_num_seqs)
    return CUDAGraphManager(
        model,
        paged_static_inputs(model.layout),
        dispatch,
        options=ManagerOptions(attention=AttentionOptions(metadata_builder=model.backend)),
    )


def _steps(seed: int) -> Iterator[tuple[int, bool]]:
    """``(num_tokens, uniform)``: decodes of 1 to 32 requests, and mixed batches of 1 to LARGEST tokens."""
    generator = torch.Generator().manual_seed(seed)
    for i in range(STEPS):
        if i % 2 == 0:
            yield int(torch.randint(1, CONFIG.max_num_seqs + 1, (), generator=generator)), True
        else:
            yield int(torch.randint(1, LARGEST + 1, (), generator=generator)), False


def _serve(manager: CUDAGraphManager[torch.Tensor], model: PagedDecoder, seed: int) -> tuple[float, int, int]:
    """Run the steps, each against the oracle; the worst relative error, uniform and mixed step counts."""
    generator = torch.Generator().manual_seed(seed + 1)
    worst, counts = 0.0, [0, 0]
    with torch.no_grad():
        for num_tokens, uniform in _steps(seed):
            inputs = make_paged_inputs(
                CONFIG, model.layout, num_tokens, uniform_decode=uniform, generator=generator, device="cuda"
            )
            replayed = manager.run_batch(inputs, uniform_decode=uniform).clone()
            expected = dense_reference(model, inputs, uniform_decode=uniform)
            assert torch.isfinite(replayed).all()
            worst = max(worst, rel_err(replayed, expected))
            counts[not uniform] += 1
    return worst, counts[0], counts[1]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize(("backend", "page_size"), CASES)
def test_every_backend_mode_and_page_size_equals_the_oracle(
    backend: str, page_size: int, mode: CUDAGraphMode
) -> None:
    seed = CASES.index((backend, page_size)) * 10 + MODES.index(mode)
    model = _model(backend, page_size, seed)
    manager = _manager(model, mode)
    with torch.no_grad():
        manager.capture(progress=False)
    worst, uniform, mixed = _serve(manager, model, seed)
    assert worst < TOLERANCE, f"{backend} pages of {page_size}, {mode.name}: worst relative error {worst}"
    resolved = manager.dispatcher.resolution.mode
    level = model.backend.support.level
    stats = manager.stats
    full = (uniform if resolved.decode_mode() is M.FULL else 0) + (
        mixed if resolved.mixed_mode() is M.FULL else 0
    )
    piecewise = (mixed if resolved.mixed_mode() is M.PIECEWISE else 0) + (
        uniform if resolved.decode_mode() is M.PIECEWISE else 0
    )
    assert stats.replays_of(M.FULL) == full, (resolved, stats)
    assert stats.replays_of(M.PIECEWISE) == piecewise, (resolved, stats)
    assert stats.eager_steps == STEPS - full - piecewise, (resolved, stats)
    if stats.eager_steps:
        assert dict(stats.eager_reasons) == {EagerReason.NO_GRAPH_FOR_BATCH.value: stats.eager_steps}
    if level < GraphSupport.ALWAYS and mode.mixed_mode() is M.FULL:
        assert resolved.mixed_mode() is not M.FULL  # the downgrade, end to end
        assert stats.replays_of(M.FULL) == uniform


@pytest.mark.parametrize(("backend", "page_size"), CASES[::2])
def test_a_background_capture_serves_every_step_right(backend: str, page_size: int) -> None:
    seed = 100 + CASES.index((backend, page_size))
    model = _model(backend, page_size, seed)
    manager = _manager(model, M.FULL_AND_PIECEWISE)
    with torch.no_grad():
        model.warm_up(LARGEST)
    session = manager.start_capture()
    worst, _, _ = _serve(manager, model, seed)
    session.wait()
    assert not session.errors
    assert worst < TOLERANCE, f"{backend} pages of {page_size} under a background capture: {worst}"
    assert manager.num_captured == len(manager.dispatcher.keys(M.FULL)) + len(
        manager.dispatcher.keys(M.PIECEWISE)
    )
    worst, _, _ = _serve(manager, model, seed + 7)  # after it: every step replays
    assert worst < TOLERANCE
    assert manager.stats.replays_of(M.FULL) + manager.stats.replays_of(M.PIECEWISE) >= STEPS
