"""Rank processes for tests and benchmarks that need several: spawned by hand, each under a hard timeout.

``torchrun``'s rendezvous hung on the GPU machines we test on, and
``destroy_process_group`` hung after graphs with NCCL operations had been
captured. So each rank is a plain subprocess (``python -m <module> ...``)
told its rank through the environment, with ``MASTER_ADDR=127.0.0.1``,
``GLOO_SOCKET_IFNAME=lo`` and a free port; it writes its result as JSON
before any teardown and leaves with ``os._exit``; the parent kills every
rank at the deadline. A rank's result, not its exit code, decides a test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

#: What a rank reports: JSON values by name.
Result = dict[str, object]

_TAIL: Final = 3000  # characters of a rank's log quoted in a failure


class RanksFailedError(AssertionError):
    """A rank timed out, crashed or reported an error; the message quotes every rank's log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclasses.dataclass(frozen=True, slots=True)
class RankRun:
    """What the ranks of one spawn reported, by rank, and where their logs are."""

    results: tuple[Result, ...]
    logs: tuple[Path, ...]


def spawn_ranks(
    module: str,
    args: Sequence[str],
    *,
    world_size: int,
    timeout_s: float,
    workdir: Path,
    env: Mapping[str, str] | None = None,
) -> RankRun:
    """Run ``python -m module *args`` as ``world_size`` ranks; every rank's result, or ``RanksFailedError``.

    Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME=lo``, and must write its result
    to ``<workdir>/rank<r>.json`` (``rank_main`` does). Ranks still running
    at ``timeout_s`` are killed (the whole process group of each).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = dict(os.environ)
    base.update(env or {})
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        WORLD_SIZE=str(world_size),
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    for rank in range(world_size):
        log = workdir / f"rank{rank}.log"
        (workdir / f"rank{rank}.json").unlink(missing_ok=True)
        logs.append(log)
        with log.open("wb") as sink:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args, str(workdir)],
                    env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: killed whole at the deadline
                )
            )
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    results: list[Result] = []
    problems: list[str] = []
    if timed_out:
        problems.append(f"ranks still running after {timeout_s:.0f} s were killed")
    for rank in range(world_size):
        path = workdir / f"rank{rank}.json"
        if not path.exists():
            problems.append(f"rank {rank} wrote no result (exit code {procs[rank].returncode})")
            results.append({})
            continue
        result: Result = json.loads(path.read_text())
        if result.get("error"):
            problems.append(f"rank {rank} failed: {result['error']}")
        results.append(result)
    if problems:
        tails = "\n".join(
            f"--- rank {r} log (last {_TAIL} characters) ---\n{log.read_text(errors='replace')[-_TAIL:]}"
            for r, log in enumerate(logs)
        )
        raise RanksFailedError("; ".join(problems) + "\n" + tails)
    return RankRun(tuple(results), tuple(logs))


def rank_main(scenarios: Mapping[str, Callable[[Sequence[str]], Result]]) -> None:
    """A rank's ``__main__``: run the scenario named by ``argv[1]``, write its result, ``os._exit(0)``.

    ``argv`` is ``[prog, scenario, *args, workdir]``. The result is written
    before any teardown: process groups are never destroyed (their teardown
    hung after NCCL captures), the process just ends.
    """
    name, args, workdir = sys.argv[1], sys.argv[2:-1], Path(sys.argv[-1])
    rank = int(os.environ["RANK"])
    try:
        result = scenarios[name](args)
    except BaseException as error:
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        print(result["traceback"], file=sys.stderr, flush=True)
    (workdir / f"rank{rank}.json.tmp").write_text(json.dumps(result))
    (workdir / f"rank{rank}.json.tmp").rename(workdir / f"rank{rank}.json")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
