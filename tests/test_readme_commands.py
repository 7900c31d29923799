"""Every shell command the READMEs (and docs/) show is run by a test here, or says why it cannot be.

The READMEs' ``bash`` blocks are read as a user reads them, one command per
line (comments dropped); each must appear in ``COVERED`` with the test that
runs it as written, or the reason it cannot run on this project's machines.
A command added to a README without either fails here.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
#: The READMEs, and the reference the root README links to in docs/ (its commands are read the same way).
READMES: Final = (
    "README.md",
    *(f"packages/{p}/README.md" for p in ("dispatch", "capture", "manager")),
    *(f"docs/{name}.md" for name in ("development", "compiled", "several-gpus", "benchmarks")),
)

#: command -> "module::test" that runs it, or "not run: why".
COVERED: Final = {
    "make demo": "tests.manager.test_reference::test_make_demo_runs_as_written",
    "make test": "not run: it is this suite; CI's .ci/run runs it on a fresh clone",
    "pip install torch --index-url https://download.pytorch.org/whl/cpu": (
        "not run: download.pytorch.org is not reachable from this project's machines; "
        "tests.test_packaging::test_readme_installs_then_the_rank_example_over_gloo_and_shm installs the "
        "same pin from pip's configuration, or from TORCH_INDEX_URL"
    ),
    "pip install --find-links dist cudagraph-manager": (
        "tests.test_packaging::test_readme_installs_then_the_rank_example_over_gloo_and_shm"
    ),
    "make dist": "tests.test_packaging::test_readme_installs_then_the_rank_example_over_gloo_and_shm",
    "pip install --find-links dist cudagraph-dispatch": (
        "tests.test_packaging::test_wheel_installs_and_dispatches_without_torch"
    ),
    "pip install ./packages/dispatch ./packages/capture": (
        "tests.test_packaging::test_readme_installs_then_the_rank_example_over_gloo_and_shm"
    ),
    "pip install ./packages/dispatch ./packages/capture ./packages/manager": (
        "tests.test_packaging::test_readme_installs_then_the_rank_example_over_gloo_and_shm"
    ),
    "make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu": (
        "not run: download.pytorch.org is not reachable here; make setup without it runs in every CI run"
    ),
    "python -m examples.several_gpus": (
        "tests.manager.test_ranks::test_the_several_gpus_example_runs_on_two_gpus"
    ),
    "python -m examples.several_gpus --device cpu": (
        "tests.manager.test_ranks::test_the_several_gpus_example_runs_on_cpu"
    ),
}


def readme_commands() -> dict[str, str]:
    """Each command of the READMEs' shell blocks, with the README it is in."""
    found: dict[str, str] = {}
    for name in READMES:
        text = (ROOT / name).read_text()
        for block in re.findall(
            r"^ *```(?:bash|sh|shell)\n(.*?)^ *```", text, flags=re.DOTALL | re.MULTILINE
        ):
            for line in block.splitlines():
                command = line.split("#", 1)[0].strip()
                if command:
                    found[command] = name
    return found


def test_every_readme_command_is_run_by_a_test_or_says_why_not() -> None:
    commands = readme_commands()
    assert commands, "no shell blocks found: the parser is broken"
    missing = {command: where for command, where in commands.items() if command not in COVERED}
    assert not missing, f"README commands no test runs (add them to COVERED): {missing}"
    stale = set(COVERED) - set(commands)
    assert not stale, f"COVERED names commands no README shows any more: {stale}"


def test_the_tests_named_exist() -> None:
    for command, target in COVERED.items():
        if target.startswith("not run: "):
            continue
        module_name, _, function = target.partition("::")
        module = importlib.import_module(module_name)
        assert callable(getattr(module, function, None)), f"{command!r}: {target} does not exist"


def test_the_readme_builds_the_wheels_before_installing_from_them() -> None:
    """The newcomer's 12: ``--find-links dist`` was shown before ``make dist`` had been said."""
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert install.index("make dist") < install.index("--find-links dist")
