"""``import cudagraph_manager`` loads the library only: no example code, no custom op.

The reference decoder registers a ``torch.library`` op and the demo pulls in
argparse and the decoder; both live in the repository's top-level ``examples``
(in no wheel), imported on purpose. Checked in a fresh interpreter, with a
positive control (importing the examples does register the op), so the check
can fail.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest
import torch

from tests.capture.test_lean_import_capture import probe, run_fresh, subprocess_env

pytest.importorskip("torch")

_PROBE = """
import json, sys
import torch

def ours():
    names = (str(s.name) for s in torch._C._jit_get_all_schemas())
    return sorted(n for n in names if n.startswith("cudagraph_manager::"))

import {module}
from cudagraph_manager._compiled import dynamo_compiles
print(json.dumps({{
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("cudagraph_manager", "examples")),
    "ops": ours(),
    "cuda_initialized": torch.cuda.is_initialized(),
    "compiles": dynamo_compiles(),
    "compilers_loaded": sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules),
}}))
"""


def _probe(module: str) -> dict[str, object]:
    return probe(_PROBE.format(module=module))


def test_import_loads_no_example_code_and_registers_no_op() -> None:
    report = _probe("cudagraph_manager")
    modules = report["modules"]
    assert isinstance(modules, list)
    assert "cudagraph_manager" in modules
    assert [m for m in modules if m.split(".")[0] == "examples"] == []
    assert report["ops"] == []
    assert report["cuda_initialized"] is False
    # compile_for_capture is there, but dynamo and inductor load when it is called, not before;
    # and counting compiles does not load them either.
    assert report["compilers_loaded"] == []
    assert report["compiles"] is None


def test_importing_the_examples_registers_the_reference_op() -> None:
    """The positive control: the probe sees the op once the examples are imported."""
    report = _probe("examples")
    modules = report["modules"]
    assert isinstance(modules, list)
    assert "examples.reference" in modules  # the probe sees example modules when they are loaded
    assert report["ops"] == ["cudagraph_manager::cached_attention"]
    assert report["cuda_initialized"] is False


def test_the_compiled_example_registers_its_op_and_a_compile_is_counted() -> None:
    """The compiled decoder's op is registered on its own import; ``dynamo_compiles`` sees a compile."""
    report = probe(
        _PROBE.format(module="examples.compiled")
        + "\nbefore = dynamo_compiles()"
        + "\ntorch.compile(lambda x: x + 1, backend='eager')(torch.zeros(2))"
        + "\nprint(json.dumps({'ops': ours(), 'before': before, 'after': dynamo_compiles()}))"
    )
    assert report["ops"] == [
        "cudagraph_manager::breakable_cached_attention",
        "cudagraph_manager::cached_attention",
    ]
    before = report["before"]
    assert before is None or before == 0  # nothing compiled yet
    assert report["after"] == 1


_EXAMPLE: Final = Path(__file__).resolve().parents[2] / "examples/in_an_engine.py"


def test_the_readme_shows_the_engine_example_as_it_is() -> None:
    """The README's "In an engine" block is the example file's code, so the two cannot drift."""
    code = _EXAMPLE.read_text().split('"""', 2)[2].lstrip("\n")
    readme = (_EXAMPLE.parents[1] / "README.md").read_text()
    assert f"```python\n{code}```" in readme


@pytest.mark.gpu
def test_the_engine_example_runs_as_written() -> None:
    stdout = run_fresh("-m", "examples.in_an_engine")
    assert "Captured " in stdout
    assert " replays (" in stdout  # print(manager.stats)


@pytest.mark.parametrize("example", ["in_an_engine", "compiled_engine"])
def test_the_cuda_examples_say_they_need_cuda_on_a_cpu(example: str) -> None:
    """Without CUDA the examples exit with a sentence, not torch's assertion from deep inside."""
    if torch.cuda.is_available():
        pytest.skip("checks the message where there is no CUDA device")
    done = subprocess.run(
        [sys.executable, "-m", f"examples.{example}"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert (
        "This example needs a CUDA device (it captures CUDA graphs); run `make demo` on a CPU." in done.stderr
    )
    assert "Traceback" not in done.stderr
