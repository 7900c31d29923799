"""The READMEs' complete Python examples run as written (GPU): users copy them.

Covered elsewhere: the dispatch README (``tests/dispatch/test_readme.py``,
on the CPU), the top-level "In an engine" block and docs/compiled.md's
"Compiled models" blocks (they are the example files, run by ``tests/manager``), the manager README's
compiled block (``tests/manager/test_compiled.py``). Here: the capture
README's three blocks, one program read top to bottom, and the manager
README's first example. The other blocks are excerpts of a serving loop or of
a multi-GPU program, and say so where they stand.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Final, cast

import pytest
import torch

ROOT: Final = Path(__file__).resolve().parents[1]


def python_blocks(readme: Path) -> list[str]:
    """The README's Python code blocks, dedented (a block inside a list item is indented)."""
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", readme.read_text(), flags=re.DOTALL | re.MULTILINE)
    return [textwrap.dedent(code) for _, code in blocks]


def _run(code: str, where: str) -> None:
    exec(compile(code, where, "exec"), {"__name__": "readme_example"})


@pytest.mark.gpu
def test_the_capture_readme_runs_top_to_bottom() -> None:
    blocks = python_blocks(ROOT / "packages/capture/README.md")
    assert len(blocks) == 5
    _run("\n".join(blocks), "packages/capture/README.md")


def test_the_capture_readme_says_its_cuda_examples_need_a_cuda_device() -> None:
    """Issue 39: its blocks put tensors on ``device="cuda"``; on a CPU torch dies with a bare AssertionError.

    Every section with such a block says, before its first block, that it
    needs a CUDA device; and the engines themselves, on CPU tensors, say so too.
    """
    readme = (ROOT / "packages/capture/README.md").read_text()
    for section in re.split(r"^## ", readme, flags=re.MULTILINE)[1:]:
        before_block, _, rest = section.partition("```python")
        if 'device="cuda"' in rest.partition("```")[0]:
            assert re.search(r"needs? a\s+CUDA\s+device", before_block), section.splitlines()[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where there is no CUDA device")
def test_the_capture_readmes_first_example_on_cpu_tensors_names_the_missing_device() -> None:
    """The first block with its tensors on the CPU: a ``CaptureError`` that says a CUDA device is needed."""
    from cudagraph_capture import CaptureError

    first = python_blocks(ROOT / "packages/capture/README.md")[0]
    assert first.count('device="cuda"') == 2
    with pytest.raises(
        CaptureError, match=r"^CUDAGraphWrapper needs a CUDA device, and none is available here"
    ):
        _run(first.replace('device="cuda"', 'device="cpu"'), "packages/capture/README.md")


def test_the_manager_readmes_first_example_runs() -> None:
    """On a GPU it captures and replays; on a CPU (the newcomer's 5: it crashed there) it runs eagerly."""
    first = python_blocks(ROOT / "packages/manager/README.md")[0]
    assert "manager.run(input_ids=ids)" in first
    _run(first, "packages/manager/README.md")


def test_the_manager_readmes_seam_example_runs_and_pads_offsets_with_the_padded_total() -> None:
    """On a GPU a FULL graph of 8 tokens replays it; on a CPU it runs eagerly; both equal the rule."""
    blocks = python_blocks(ROOT / "packages/manager/README.md")
    (block,) = [b for b in blocks if "metadata_builder=builder" in b]
    namespace: dict[str, object] = {"__name__": "__main__"}  # a script's: its dataclass finds its module
    exec(compile(block, "packages/manager/README.md", "exec", dont_inherit=True), namespace)
    ids, out, table = namespace["ids"], namespace["out"], namespace["table"]
    assert isinstance(ids, torch.Tensor)
    assert isinstance(out, torch.Tensor)
    assert callable(table)
    builder = namespace["builder"]
    # Padded to the key of 8 tokens and 8 requests (a replay, or without CUDA the same batch eagerly).
    assert builder.padded.tolist() == [0, 3, 5, 8, 8, 8, 8, 8, 8]  # type: ignore[attr-defined]  # the example's
    first = torch.tensor([0, 0, 0, 3, 3], device=ids.device)  # requests of 3 and 2 tokens
    with torch.no_grad():
        torch.testing.assert_close(out, table(ids) + table(ids[first]))


@pytest.mark.parametrize("engines", ["as written", "fake engines"])
def test_the_manager_readmes_options_example_runs(engines: str) -> None:
    """One ``ManagerOptions`` value: capture options, output rows, the attention's support (CPU and GPU).

    As written it replays on a GPU and runs eagerly on a CPU; with the tests'
    fake engines (``engine_factory``) the CPU takes the graph path too.
    """
    from cudagraph_dispatch import CUDAGraphMode
    from cudagraph_manager import CUDAGraphManager
    from tests.manager.helpers import FakeEngines

    (block,) = [b for b in python_blocks(ROOT / "packages/manager/README.md") if "warmup_runs=2" in b]
    if engines == "fake engines":
        given = "capture=CaptureOptions(warmup_runs=2),"
        assert given in block
        block = block.replace(given, given + " engine_factory=FakeEngines(),")
    namespace: dict[str, object] = {"__name__": "__main__", "FakeEngines": FakeEngines}
    exec(compile(block, "packages/manager/README.md", "exec", dont_inherit=True), namespace)
    manager = namespace["manager"]
    assert isinstance(manager, CUDAGraphManager)
    assert manager.dispatcher.resolution.mode is CUDAGraphMode.FULL_AND_PIECEWISE
    graphs = engines == "fake engines" or torch.cuda.is_available()
    assert manager.stats.replays_of(CUDAGraphMode.PIECEWISE) == (1 if graphs else 0)


def test_the_capture_readmes_own_engine_runs_a_manager_on_the_cpu() -> None:
    """Issue 33: the README's custom engine, as written, is a GraphEngine a manager captures and replays with.

    Its entry has exactly what the README says the manager reads (``replay``,
    ``output``, ``seconds``); an engine written from an older README, without
    ``seconds``, failed with an ``AttributeError`` inside ``capture()``.
    """
    from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
    from cudagraph_manager import CUDAGraphManager, ManagerOptions, StaticInput
    from cudagraph_manager.lowlevel import GraphEngineFactory

    (code,) = [b for b in python_blocks(ROOT / "packages/capture/README.md") if "class RerunEngine" in b]
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(code, "packages/capture/README.md", "exec"), namespace)
    engine_factory = cast("GraphEngineFactory", namespace["RerunEngine"])  # a class: called with 3 args
    weight = torch.randn(8, 8)

    def model(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ weight)

    config = DispatchConfig(CUDAGraphMode.FULL, CaptureSizes([2, 4, 8]), max_num_seqs=8)
    manager = CUDAGraphManager(
        model,
        {"x": StaticInput((8,))},
        config,
        device="cpu",
        options=ManagerOptions(engine_factory=engine_factory),
    )
    report = manager.capture()
    assert manager.num_captured == 3
    assert report.num_graphs == 3
    for n in (3, 8, 1):
        x = torch.randn(n, 8)
        torch.testing.assert_close(manager.run(x=x), model(x))
    assert manager.stats.replays_of(CUDAGraphMode.FULL) == 3


def test_the_readmes_cpu_demo_paragraph_says_what_it_times_and_what_it_honours() -> None:
    """Issue 39: "about 30 s" was mostly the environment (the demo: 4 s); ``--dtype`` was ignored silently.

    The paragraph now says the demo prints its own time and what ``make
    demo`` adds, that ``--dtype`` applies on a CPU too, and that two host loops
    show no speedup.
    """
    readme = (ROOT / "README.md").read_text()
    cpu = readme.split("**On a CPU**", 1)[1].split("\n\n", 1)[0]
    assert "30 s" not in cpu
    assert "last line says how long the demo itself took" in cpu
    assert "builds\n`.venv`" in cpu or "builds `.venv`" in cpu
    assert "`--dtype`" in cpu
    assert "no speedup" in cpu
