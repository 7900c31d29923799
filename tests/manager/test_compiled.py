"""Managers over a compiled model: one compile for every size, FULL and PIECEWISE over compiled code.

The reference decoder is compiled with ``compile_decoder`` (inductor, no
inductor graphs, the token dimension symbolic; attention one opaque op that
is an eager break at run time). CPU tests check the compile counts and the
arguments given to ``torch.compile`` (with ``aot_eager``: no C++ compiler,
fast); GPU tests capture FULL, PIECEWISE and FULL_AND_PIECEWISE managers over
one inductor compile and compare every replay with the compiled model run
directly and with the plain decoder, on fresh random steps.

Compile counts: one graph for the steps of two tokens or more (the token
count symbolic) and one for the step of one token, because dynamo
specializes sizes 0 and 1 (a size-1 dimension broadcasts, so the symbolic
graph cannot assume it is not 1). Capture sizes without 1 compile once.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Final, TypeVar

import pytest
import torch

from cudagraph_capture import (
    BreakableCUDAGraphCapture,
    BreakableCUDAGraphWrapper,
    CaptureOptions,
    CUDAGraphWrapper,
    GraphEngine,
)
from cudagraph_capture._recorder import Entry as _Entry
from cudagraph_dispatch import BatchDescriptor, CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import (
    CompiledModel,
    CUDAGraphManager,
    ManagerOptions,
    StaticInput,
    compile_for_capture,
)
from cudagraph_manager._compiled import dynamo_compiles
from examples.compiled import compile_decoder, compiled_cached_attention
from examples.config import DecoderConfig
from examples.demo import run_graph
from examples.inputs import make_step_inputs
from examples.reference import ReferenceDecoder, static_inputs
from tests.capture.test_lean_import_capture import run_fresh
from tests.manager.helpers import FakeEngines
from tests.manager.reference_support import GPU_STEPS
from tests.torch_support import highest_fp32_matmul_precision, rel_err

R = TypeVar("R")

pytestmark = pytest.mark.filterwarnings(
    # Inductor's advice where fp32 matmuls run in full fp32, as these tests ask.
    "ignore:TensorFloat32 tensor cores:UserWarning"
)

CONFIG: Final = DecoderConfig.small()
SIZES: Final = CaptureSizes([1, 2, 4, 8, 16])
#: Dynamo's graphs for every size: 2+ tokens (symbolic), and 1 token (specialized).
EXPECTED_COMPILES: Final = 2
STEPS: Final = GPU_STEPS
TOL: Final = 1e-4  # fp32, full-precision matmuls: rounding only
_ROOT: Final = Path(__file__).resolve().parents[2]
_EXAMPLES: Final = _ROOT / "examples"


def _compiles() -> int:
    count = dynamo_compiles()
    assert count is not None, "torch._dynamo is not loaded: nothing was compiled"
    return count


def _cudagraph_skips() -> int:
    """How often inductor fell back from CUDA graphs of its own: never, when it records none."""
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


def _steps(device: str, seed: int) -> Iterator[tuple[int, bool, dict[str, torch.Tensor]]]:
    """``STEPS`` as fresh random inputs."""
    generator = torch.Generator().manual_seed(seed)
    for num_tokens, uniform in STEPS:
        inputs = make_step_inputs(
            CONFIG, num_tokens, uniform_decode=uniform, generator=generator, device=device
        )
        yield num_tokens, uniform, inputs


# -- CPU: what is compiled, and how often --


def test_one_compile_serves_every_size_of_two_tokens_or_more_and_one_the_single_token() -> None:
    """The manager's padded buffers on the CPU: sizes 16, 8, 4, 2 share a compile; 1 has its own."""
    torch.manual_seed(0)
    model = ReferenceDecoder(CONFIG)
    compiled = compile_for_capture(
        model.with_attention(compiled_cached_attention), static_inputs(CONFIG), backend="aot_eager"
    )
    config = DispatchConfig(CUDAGraphMode.FULL, SIZES, max_num_seqs=CONFIG.max_num_seqs)
    manager = CUDAGraphManager(compiled, static_inputs(CONFIG), config, device="cpu")
    before = _compiles()  # compile_for_capture loaded dynamo
    counts: list[int] = []
    with torch.no_grad():
        for num_tokens, uniform, inputs in _steps("cpu", seed=1):
            out = run_graph(manager, uniform, inputs)  # the model on the padded buffers
            assert rel_err(out, model.step(inputs)) < 1e-5, num_tokens
            counts.append(_compiles() - before)
    # STEPS: 1 (a compile of its own), 3 -> 4 (the symbolic compile), then nothing new.
    assert counts == [1, 2, 2, 2, 2, 2, 2, 2]
    assert manager.stats.eager_reasons == {"no_cuda": 7, "above_largest_size": 1}


def test_the_capture_report_counts_the_compiles_of_its_capture() -> None:
    """A first capture compiles (1 token, then the symbolic rest); a second one, after clear(), nothing."""
    # Dynamo reuses a compile across instances of one module class: start from an empty cache.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ReferenceDecoder(CONFIG)
    compiled = compile_for_capture(
        model.with_attention(compiled_cached_attention), static_inputs(CONFIG), backend="aot_eager"
    )
    config = DispatchConfig(CUDAGraphMode.FULL, SIZES, max_num_seqs=CONFIG.max_num_seqs)
    manager = CUDAGraphManager(
        compiled,
        static_inputs(CONFIG),
        config,
        device="cpu",
        options=ManagerOptions(engine_factory=FakeEngines()),
    )
    with torch.no_grad():
        first = manager.capture()
        manager.clear()
        second = manager.capture()
    assert first.num_graphs == second.num_graphs == len(SIZES)
    assert first.compiles == EXPECTED_COMPILES
    assert second.compiles == 0
    assert f"{EXPECTED_COMPILES} torch.compile graph(s) compiled" in str(first)


def test_compile_for_capture_compiles_without_inductor_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile`` gets static shapes, a full graph, the mode's options and its CUDA graphs off."""
    calls: list[dict[str, object]] = []

    def fake_compile(model: Callable[..., torch.Tensor], **kwargs: object) -> Callable[..., torch.Tensor]:
        calls.append(kwargs)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    inputs = {"x": StaticInput((4,))}
    compile_for_capture(torch.relu, inputs)
    compile_for_capture(torch.relu, inputs, mode="max-autotune-no-cudagraphs", fullgraph=False)
    compile_for_capture(torch.relu, inputs, backend="aot_eager")
    from torch._inductor import list_mode_options

    no_graphs = {"triton.cudagraphs": False}
    assert calls == [
        {"fullgraph": True, "dynamic": False, "backend": "inductor", "options": no_graphs},
        {
            "fullgraph": False,
            "dynamic": False,
            "backend": "inductor",
            "options": {**list_mode_options("max-autotune-no-cudagraphs"), **no_graphs},
        },
        {"fullgraph": True, "dynamic": False, "backend": "aot_eager"},
    ]
    autotuned = calls[1]["options"]
    assert isinstance(autotuned, dict)
    assert autotuned["max_autotune"] is True


def test_only_the_batched_inputs_get_a_symbolic_leading_dimension() -> None:
    """A batched input's new row count reuses the compile; an unbatched input's new shape recompiles."""

    def scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x * scale.sum()  # [T, 4]

    inputs = {"x": StaticInput((4,)), "scale": StaticInput((3,), rows=None)}
    compiled: CompiledModel[torch.Tensor] = compile_for_capture(scaled, inputs, backend="eager")
    assert compiled.model is scaled
    compiled(x=torch.ones(5, 4), scale=torch.ones(3))  # dynamo loaded: the count starts here
    before = _compiles()
    for rows in (6, 9, 2):
        assert torch.equal(compiled(x=torch.ones(rows, 4), scale=torch.ones(3)), torch.full((rows, 4), 3.0))
    assert _compiles() == before
    compiled(x=torch.ones(6, 4), scale=torch.ones(7))  # the unbatched input's shape is static
    assert _compiles() == before + 1


# -- GPU: FULL, PIECEWISE and FULL_AND_PIECEWISE over one inductor compile --


class _Compiled:
    """The decoder, its compiled twin (same weights and caches), and the compile count before it ran."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model: Final = ReferenceDecoder(CONFIG, device="cuda")
        self.compiled: Final = compile_decoder(self.model)  # compiles on its first call
        self.compiles_before: Final = _compiles()
        self.skips_before: Final = _cudagraph_skips()


@pytest.fixture(scope="module")
def compiled() -> Iterator[_Compiled]:
    """One compiled decoder for the module: the first manager's capture compiles it, the others reuse it."""
    with highest_fp32_matmul_precision():
        yield _Compiled()


class _KeepingBreakable(BreakableCUDAGraphWrapper[..., R]):
    """The breakable engine, keeping what it recorded so the test can count the segments."""

    def __init__(self, model: Callable[..., R], options: CaptureOptions) -> None:
        super().__init__(model, options)
        self.recorded: dict[BatchDescriptor, BreakableCUDAGraphCapture] = {}

    def record(self, descriptor: BatchDescriptor, inputs: Mapping[str, torch.Tensor], /) -> _Entry[R]:
        entry = super().record(descriptor, inputs)
        assert isinstance(entry.owner, BreakableCUDAGraphCapture)
        self.recorded[descriptor] = entry.owner
        return entry


class _Engines:
    """The default engines, kept so the test can read what the breakable engine captured."""

    def __init__(self) -> None:
        self.breakable: object = None

    def __call__(
        self, model: Callable[..., R], mode: CUDAGraphMode, options: CaptureOptions
    ) -> GraphEngine[R]:
        if mode is CUDAGraphMode.FULL:
            return CUDAGraphWrapper(model, CUDAGraphMode.FULL, options)
        breakable = _KeepingBreakable(model, options)
        self.breakable = breakable
        return breakable


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode",
    [CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE],
    ids=lambda mode: mode.name,
)
def test_manager_over_the_compiled_decoder_replays_like_eager(
    compiled: _Compiled, mode: CUDAGraphMode
) -> None:
    pytest.importorskip("triton")
    engines = _Engines()
    config = DispatchConfig(mode, SIZES, max_num_seqs=CONFIG.max_num_seqs)
    manager = CUDAGraphManager(
        compiled.compiled,
        static_inputs(CONFIG),
        config,
        device="cuda",
        options=ManagerOptions(engine_factory=engines),
    )
    first = _compiles() == compiled.compiles_before
    report = manager.capture()
    planned = sum(len(keys) for _, keys in manager.dispatcher.capture_plan())
    assert report.num_graphs == manager.num_captured == planned
    # Whichever mode's test runs first compiled the two graphs; every other capture reuses them.
    assert _compiles() - compiled.compiles_before == EXPECTED_COMPILES
    assert report.compiles == (EXPECTED_COMPILES if first else 0)
    assert isinstance(engines.breakable, _KeepingBreakable) is (mode is not CUDAGraphMode.FULL)
    if isinstance(engines.breakable, _KeepingBreakable):
        # The breaks happen inside the compiled code: one per layer, a graph segment around each.
        segments = engines.breakable.recorded[BatchDescriptor(8)]
        assert segments.num_eager_breaks == CONFIG.num_layers
        assert segments.num_graphs == CONFIG.num_layers + 1
    with torch.no_grad():
        for num_tokens, uniform, inputs in _steps("cuda", seed=40 + list(CUDAGraphMode).index(mode)):
            replayed = run_graph(manager, uniform, inputs).clone()
            assert replayed.shape == (num_tokens, CONFIG.hidden_size)
            from_compiled = compiled.compiled(**inputs)  # the same step, compiled code run directly
            assert rel_err(replayed, from_compiled) < TOL, (mode, num_tokens, uniform, "compiled")
            assert rel_err(replayed, compiled.model.step(inputs)) < TOL, (mode, num_tokens, uniform, "eager")
    stats = manager.stats
    assert stats.num_replays == len(STEPS) - 1
    assert stats.eager_reasons == {"above_largest_size": 1}
    if mode is CUDAGraphMode.FULL_AND_PIECEWISE:
        # Uniform decode steps replay the FULL graphs, mixed steps the PIECEWISE ones.
        assert stats.replays_of(CUDAGraphMode.FULL) == sum(uniform for _, uniform in STEPS)
        assert stats.replays_of(CUDAGraphMode.PIECEWISE) == len(STEPS) - 1 - sum(u for _, u in STEPS)
    assert _compiles() - compiled.compiles_before == EXPECTED_COMPILES  # running the steps compiled nothing
    assert _cudagraph_skips() == compiled.skips_before == 0


# -- the READMEs' recipes --


def _python_blocks(readme: Path) -> list[str]:
    """The README's Python code blocks, dedented (a block inside a list item is indented)."""
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", readme.read_text(), flags=re.DOTALL | re.MULTILINE)
    return [textwrap.dedent(code) for _, code in blocks]


def test_the_docs_show_the_compiled_example_and_the_op_as_they_are() -> None:
    """docs/compiled.md's blocks are the example file's code and the op's declaration, verbatim."""
    blocks = _python_blocks(_ROOT / "docs/compiled.md")
    example = (_EXAMPLES / "compiled_engine.py").read_text().split('"""', 2)[2].lstrip("\n")
    assert example in blocks
    (op,) = [block for block in blocks if "torch.library.custom_op(" in block]
    assert op in (_EXAMPLES / "compiled.py").read_text()


@pytest.mark.gpu
def test_the_compiled_example_runs_as_written() -> None:
    pytest.importorskip("triton")
    stdout = run_fresh("-m", "examples.compiled_engine")
    assert "Captured 70 " in stdout
    assert " replays (" in stdout  # print(manager.stats)


def test_the_manager_readme_compiled_example_runs() -> None:
    """A GPU compiles, captures and replays; a CPU (where it crashed before) compiles and runs eagerly."""
    if torch.cuda.is_available():
        pytest.importorskip("triton")
    (block,) = [
        b for b in _python_blocks(_ROOT / "packages/manager/README.md") if "compile_for_capture(" in b
    ]
    with highest_fp32_matmul_precision():
        exec(compile(block, "packages/manager/README.md", "exec"), {"__name__": "readme_example"})


def _size_specialized(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ x.T) @ x  # [n, 64]: one compile per size (dynamic=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recapture", ["clear", "release"])
def test_a_model_compiled_per_size_recaptures_without_compiling_and_replays_like_eager(
    recapture: str,
) -> None:
    """A model that compiles once per size is compiled in the first capture's warm-ups, one per key.

    A recapture warms up only the smallest key (the ``WarmUpRule`` of
    ``cudagraph_manager/_capture/_warm_up.py``: ``foreground`` warms a key's
    first capture and each mode's smallest) and compiles nothing: a compile
    inside a recording would fail, so a size the first warm-ups had not
    compiled would show here. Every replay is
    compared with eager on fresh random inputs, before and after.
    """
    torch._dynamo.reset()
    compiled = torch.compile(_size_specialized, dynamic=False)
    sizes = CaptureSizes([1, 2, 4, 8])  # under dynamo's default recompile limit of 8
    manager = CUDAGraphManager(
        compiled,
        {"x": StaticInput(shape=(64,), dtype=torch.float32, rows="tokens")},
        DispatchConfig(CUDAGraphMode.FULL, sizes, max_num_seqs=8),
    )
    with highest_fp32_matmul_precision():
        first = manager.capture(progress=False)
        assert first.compiles is not None
        assert first.compiles >= len(sizes)  # one per size, in the warm-ups
        getattr(manager, recapture)()
        again = manager.capture(progress=False)
        assert again.compiles == 0, "the recapture compiled: a size's compile was not in the first warm-ups"
        assert [g.descriptor.num_tokens for g in again.graphs if g.warmup_seconds > 0] == [1]
        generator = torch.Generator(device="cuda").manual_seed(0)
        for num_tokens in (1, 2, 3, 5, 8):
            x = torch.randn(num_tokens, 64, device="cuda", generator=generator)
            out = manager.run(x=x)
            assert rel_err(out, _size_specialized(x)) < TOL, num_tokens
    assert manager.stats.eager_steps == 0
