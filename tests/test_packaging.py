"""The wheels as a user gets them: the dispatch wheel alone without torch; the three with a CPU torch.

The wheel is built from this checkout with the dev venv's pinned `build` and
`hatchling` (no build isolation, so no network), the way `make dist` builds it:
an sdist first, then the wheel from that sdist.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from zipfile import ZipFile

import pytest

REPO = Path(__file__).resolve().parents[1]
DISPATCH = REPO / "packages" / "dispatch"

# Runs in the new venv with `-I` (no PYTHONPATH, no script directory, no user
# site), so the only cudagraph_dispatch it can find is the installed wheel's.
_PROBE = """
import importlib.metadata, json, pathlib, sys
import cudagraph_dispatch
from cudagraph_dispatch import CaptureSizes, CUDAGraphDispatcher, CUDAGraphMode, DispatchConfig

try:
    import torch  # noqa: F401
    torch_importable = True
except ModuleNotFoundError:
    torch_importable = False

config = DispatchConfig(CUDAGraphMode.FULL_AND_PIECEWISE, CaptureSizes.default(16), max_num_seqs=16)
dispatcher = CUDAGraphDispatcher(config)
decode = dispatcher.dispatch(3, uniform_decode=True)
mixed = dispatcher.dispatch(3)
package = pathlib.Path(cudagraph_dispatch.__file__).parent
print(json.dumps({
    "prefix": sys.prefix,
    "package": str(package),
    "py_typed": (package / "py.typed").is_file(),
    "version": cudagraph_dispatch.__version__,
    "dist_version": importlib.metadata.version("cudagraph-dispatch"),
    "torch_importable": torch_importable,
    "decode": [decode.mode.name, decode.descriptor.num_tokens, decode.descriptor.num_reqs,
               decode.descriptor.uniform],
    "mixed": [mixed.mode.name, mixed.descriptor.num_tokens, mixed.descriptor.num_reqs,
              mixed.descriptor.uniform],
}))
"""


def _hermetic_env() -> dict[str, str]:
    """This environment without PYTHONPATH and without any pip configuration or index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _run(args: list[str], cwd: Path, env: Mapping[str, str]) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _build_wheel(package: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh sdist and wheel of ``package`` in a new temporary folder; the wheel's path."""
    missing = [name for name in ("build", "hatchling") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed here (the dev dependency group has them)")
    out = tmp_path_factory.mktemp("dist")
    _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(package)],
        cwd=out,
        env=_hermetic_env(),
    )
    wheels = sorted(out.glob("*.whl"))
    sdists = sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1, wheels
    assert len(sdists) == 1, sdists
    return wheels[0]


@pytest.fixture(scope="module")
def dispatch_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh sdist and wheel of packages/dispatch; the wheel's path."""
    wheel = _build_wheel(DISPATCH, tmp_path_factory)
    assert wheel.name == f"cudagraph_dispatch-{_source_version()}-py3-none-any.whl"
    return wheel


def _source_version() -> str:
    for line in (DISPATCH / "src" / "cudagraph_dispatch" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__ = "):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise AssertionError("no __version__ in cudagraph_dispatch/__init__.py")


def test_wheel_installs_and_dispatches_without_torch(dispatch_wheel: Path, tmp_path: Path) -> None:
    """A venv holding only the wheel imports it, has no torch, and dispatches a batch."""
    env = _hermetic_env()
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path, env=env)
    python = venv / "bin" / "python"
    # The dev venv's pip installs into the new venv's interpreter: the wheel and nothing else.
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(dispatch_wheel)],
        cwd=tmp_path,
        env=env,
    )
    result = json.loads(_run([str(python), "-I", "-c", _PROBE], cwd=tmp_path, env=env).splitlines()[-1])

    assert Path(result["package"]).is_relative_to(Path(result["prefix"]))
    assert Path(result["prefix"]).resolve() == venv.resolve()
    assert result["py_typed"] is True
    assert result["version"] == result["dist_version"] == _source_version()
    assert result["torch_importable"] is False
    # Sizes 1, 2, 4, 8, 16: three tokens pad to 4, a FULL uniform-decode graph or the PIECEWISE one.
    assert result["decode"] == ["FULL", 4, 4, True]
    assert result["mixed"] == ["PIECEWISE", 4, None, False]


def test_wheel_description_is_the_readme(dispatch_wheel: Path) -> None:
    """The wheel's long description is packages/dispatch/README.md, as Markdown; it requires nothing."""
    with ZipFile(dispatch_wheel) as wheel:
        (metadata_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = wheel.read(metadata_name).decode()
    headers, _, body = metadata.partition("\n\n")
    header_lines = headers.splitlines()
    assert "Name: cudagraph-dispatch" in header_lines
    assert "Description-Content-Type: text/markdown" in header_lines
    assert not [line for line in header_lines if line.startswith("Requires-Dist:")]
    assert body.strip() == (DISPATCH / "README.md").read_text().strip()


def test_the_manager_wheel_holds_its_own_modules_only(tmp_path_factory: pytest.TempPathFactory) -> None:
    """No example, no demo: the manager's wheel is its package's modules, py.typed and its metadata.

    The examples live in the repository's top-level ``examples/`` (docs/design.md, "Layers").
    """
    wheel = _build_wheel(REPO / "packages" / "manager", tmp_path_factory)
    with ZipFile(wheel) as archive:
        names = archive.namelist()
    package = REPO / "packages" / "manager" / "src" / "cudagraph_manager"
    own = {
        f"cudagraph_manager/{path.relative_to(package).as_posix()}"
        for path in package.rglob("*")
        if path.suffix == ".py" or path.name == "py.typed"
    }
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info/"  # cudagraph_manager-0.1.0.dist-info/
    assert not [n for n in names if "examples" in n.split("/") or n.endswith("/demo.py")], names
    assert {n for n in names if not n.startswith(dist_info)} == own
    assert {"METADATA", "WHEEL", "RECORD"} <= {n.removeprefix(dist_info) for n in names}


# -- the README's install commands, with a CPU torch: the rank examples on one machine --

PACKAGES = ("dispatch", "capture", "manager")


def _torch_pin() -> str:
    """The dev group's ``torch==...`` line of pyproject.toml, as the Makefile reads it."""
    for line in (REPO / "pyproject.toml").read_text().splitlines():
        stripped = line.strip().strip(",").strip('"')
        if stripped.startswith("torch=="):
            return stripped
    raise AssertionError('no "torch==..." line in pyproject.toml')


def _pip(python: Path, args: list[str], cwd: Path, env: Mapping[str, str]) -> None:
    """``pip install ...`` as the README writes it, run by the dev venv's pip for ``python``'s venv.

    An install writes no ``.pyc`` (``--no-compile``): the venv is thrown away
    after one run, and compiling torch's modules took half of this test.
    """
    if args[0] == "install":
        args = ["install", "--no-compile", *args[1:]]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"pip {args}:\n{done.stderr[-4000:]}"


@pytest.mark.needs_index  # a GPU machine has no index: `make gpu-test` deselects it
def test_readme_installs_then_the_rank_example_over_gloo_and_shm(tmp_path: Path) -> None:
    """The README's "Install" commands in a new venv, then the TP example over gloo and shm, on the CPU.

    In order: torch first (the dev group's pin, from this machine's pip
    configuration, as ``make setup`` installs it: download.pytorch.org, which
    the README names, is not reachable from this project's machines; set
    ``TORCH_INDEX_URL`` to use an index), then from source ``pip install
    ./packages/dispatch ./packages/capture ./packages/manager``, then, after
    uninstalling those, ``make dist`` and ``pip install --find-links dist
    cudagraph-manager``. The installed wheels run the rank example over gloo
    and over shared memory, with no numpy in the venv.
    """
    if importlib.util.find_spec("build") is None:
        pytest.skip("build not installed here (the dev dependency group has it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    with removed_afterwards(tmp_path / "venv") as venv:  # ~880 MB with torch: not left for pytest to keep
        _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path, env=env)
        _install_and_run_the_rank_example(venv, tmp_path, env)


@contextlib.contextmanager
def removed_afterwards(folder: Path) -> Iterator[Path]:
    """``folder``, removed when the block ends, whether or not it raised.

    pytest keeps the temporary folders of the last three runs; a venv with
    torch in one of them would leave about 880 MB per run in the system's
    temporary folder (issue 39).
    """
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _install_and_run_the_rank_example(venv: Path, tmp_path: Path, env: Mapping[str, str]) -> None:
    """The README's installs into ``venv``, then the rank example over gloo and shm (see the test)."""
    python = venv / "bin" / "python"
    index = ["--index-url", env["TORCH_INDEX_URL"]] if env.get("TORCH_INDEX_URL") else []
    _pip(python, ["install", "-q", *index, _torch_pin()], cwd=REPO, env=env)
    _pip(
        python,
        ["install", "-q", "./packages/dispatch", "./packages/capture", "./packages/manager"],
        REPO,
        env,
    )
    where = "import cudagraph_manager; print(cudagraph_manager.__file__)"
    assert Path(_run([str(python), "-I", "-c", where], cwd=tmp_path, env=env).strip()).is_relative_to(venv)
    _pip(python, ["uninstall", "-q", "-y", *(f"cudagraph-{p}" for p in PACKAGES)], REPO, env)
    _run(["make", "dist"], cwd=REPO, env=env)
    _pip(python, ["install", "-q", "--find-links", "dist", "cudagraph-manager"], REPO, env)
    probe = (
        "import importlib.metadata as m, importlib.util as u, json; "
        "print(json.dumps([u.find_spec('numpy') is None, "
        "[m.version(f'cudagraph-{p}') for p in ('dispatch', 'capture', 'manager')]]))"
    )
    no_numpy, versions = json.loads(
        _run([str(python), "-I", "-c", probe], cwd=tmp_path, env=env).splitlines()[-1]
    )
    assert no_numpy is True
    assert versions == [_source_version()] * 3
    # From the repository root, as the examples run (they ship in no wheel); -E -s is -I but for
    # the root on the path, which holds examples/ and no package: those come from the wheels.
    # The two runs at once: each waits on its ranks' start-up more than it computes.
    example = [str(python), "-E", "-s", "-m", "examples.several_gpus", "--device", "cpu", "--steps", "8"]
    runs = {
        backend: subprocess.Popen(
            [*example, "--backend", backend],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for backend in ("gloo", "shm")
    }
    try:
        for backend, run in runs.items():
            stdout, stderr = run.communicate(timeout=240)
            out = stdout.decode()
            assert run.returncode == 0, f"{backend}: {stderr.decode()[-4000:]}"
            assert f"8 steps on 2 ranks agreeing over {backend}: 0 replayed, 8 eager" in out, out
            worst = float(out.rsplit("largest difference from the unsharded decoder: ", 1)[1].split()[0])
            assert worst < 1e-4, out
    finally:
        for run in runs.values():  # the other run, where one failed or timed out
            if run.poll() is None:
                run.kill()
                run.wait()


def test_a_folder_removed_afterwards_is_gone_after_an_error(tmp_path: Path) -> None:
    """The big venv's folder goes even when the test fails inside it (the failure still propagates)."""
    folder = tmp_path / "venv"

    def fail_inside() -> None:
        with removed_afterwards(folder) as inside:
            (inside / "lib").mkdir(parents=True)
            (inside / "lib" / "torch.so").write_bytes(b"x" * 1024)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    assert not folder.exists()
    with removed_afterwards(folder):  # never made: nothing to remove, no error
        pass
