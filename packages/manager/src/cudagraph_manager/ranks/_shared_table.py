"""A table that the ranks of one host exchange through shared memory: no socket, no GPU.

Each exchange is one round: every rank writes its row and then the round's
sequence number into its own cell, then waits until every other cell shows
that number, and reads the rows. Two copies of the table alternate by the
round's parity. A row wider than the cells makes every rank map a wider
table first (the ranks exchange rows of one width, so they all grow in the
same round). Offered on x86-64 only (docs/design.md, "Ranks", says why this
is safe there and not elsewhere).
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Final

import torch
import torch.distributed as dist

#: Ints a row of the first table may hold (a step's row has 9); a wider row grows the table.
FIRST_WIDTH: Final = 16
_SEQ: Final = struct.Struct("<q")
_X86: Final = frozenset({"x86_64", "amd64", "x64"})
_SPINS_BEFORE_YIELD: Final = 2000


#: The longest text ``gather_texts`` carries, in UTF-8 bytes (longer ones are cut).
TEXT_BYTES: Final = 1024


def gather_texts(text: str, rank: int, world_size: int, group: dist.ProcessGroup) -> list[str]:
    """Every rank's ``text``, by rank: one all-reduce of a ``[world_size, TEXT_BYTES]`` int64 table.

    torch's object collectives (``all_gather_object``, ``broadcast_object_list``)
    need numpy, which neither this package nor a CPU torch wheel installs; a
    table of byte values that each rank fills in its own row does not.
    """
    data = text.encode()[:TEXT_BYTES]
    table = [0] * (world_size * TEXT_BYTES)  # [world_size, TEXT_BYTES], row-major
    table[rank * TEXT_BYTES : rank * TEXT_BYTES + len(data)] = data
    tensor = torch.tensor(table, dtype=torch.int64)
    dist.all_reduce(tensor, group=group)  # each entry is one rank's: the sum is the table
    flat: list[int] = tensor.tolist()
    rows = (bytes(flat[r * TEXT_BYTES : (r + 1) * TEXT_BYTES]).rstrip(b"\0") for r in range(world_size))
    return [row.decode(errors="replace") for row in rows]


def shared_memory_supported() -> str | None:
    """``None`` where the shared table is safe here, else why not."""
    machine = platform.machine().lower()
    if machine not in _X86:
        return f"the shared-memory exchange needs x86-64's store order; this is {machine or 'unknown'}"
    return None


def make_table_file(path: str, size: int) -> None:
    """Create ``path`` of ``size`` zero bytes, owner-only (0600) and new (``O_EXCL``).

    The ranks agree through this file: created with the process umask (often
    0644, 0666 under umask 0) another local user could write agreement rows
    into it before every rank has mapped it, and an existing file of that
    name (planted) would be opened instead of made.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask can only take bits away; make the mode exact
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _file_of_rank_0(size: int, rank: int, world_size: int, group: dist.ProcessGroup) -> tuple[str, str]:
    """The table file of ``size`` bytes that rank 0 makes, its path learnt by every rank (collective).

    Returns the path and rank 0's problem making it (``""`` when none).
    """
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(folder, f"cudagraph-ranks-{uuid.uuid4().hex}")
    problem = ""
    if rank == 0:
        try:
            make_table_file(path, size)
        except OSError as error:
            problem = f"rank 0 could not make {path}: {error}"
    path, problem = gather_texts(f"{path}\n{problem}", rank, world_size, group)[0].split("\n", 1)
    return path, problem


def _map_file(path: str, size: int, rank: int) -> tuple[mmap.mmap | None, str]:
    """The first ``size`` bytes of ``path`` mapped, and ``""``; or ``None`` and why not."""
    try:
        with open(path, "r+b") as f:
            return mmap.mmap(f.fileno(), size), ""
    except OSError as error:
        return None, f"rank {rank} could not map {path}: {error}"


class SharedTable:
    """One ``[world_size, width]`` int64 table per round, in a file mapped by every rank of one host.

    ``width`` starts at ``FIRST_WIDTH`` and grows to the widest row exchanged.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int, timeout_s: float) -> None:
        """Collective over ``group`` (gloo): rank 0 makes the file, every rank maps it, rank 0 unlinks it.

        Raises the same ``ValueError`` on every rank unless every rank shares
        this host and could map the file (another user's file, a /dev/shm of
        its own in a container: the ranks learn of each other's failure
        before any of them waits for the others).
        """
        hosts = gather_texts(platform.node(), rank, world_size, group)
        if len(set(hosts)) > 1:
            raise ValueError(f"backend: 'shm' needs every rank on one host; the ranks run on {hosts}")
        self._group: Final = group
        self._rank: Final = rank
        self._world_size: Final = world_size
        self._timeout_s: Final = timeout_s
        self._round = 0
        self._width = FIRST_WIDTH
        self._map = self._mapped(FIRST_WIDTH, "set up")

    def _mapped(self, width: int, what: str) -> mmap.mmap:
        """A new zeroed table of ``width`` ints a row, mapped by every rank (collective); else ValueError."""
        rank, world_size, group = self._rank, self._world_size, self._group
        size = 2 * world_size * _SEQ.size * (1 + width)
        path, problem = _file_of_rank_0(size, rank, world_size, group)
        mapped, problem = _map_file(path, size, rank) if not problem else (None, problem)
        problems = gather_texts(problem, rank, world_size, group)  # also: every rank has mapped it
        if rank == 0 and os.path.exists(path):
            os.unlink(path)  # the name can go, the mappings stay
        failed = [str(p) for p in problems if p]
        if failed or mapped is None:
            if mapped is not None:
                mapped.close()
            raise ValueError(f"backend: the shared-memory table could not be {what}: {'; '.join(failed)}")
        return mapped

    def _offset(self, parity: int, rank: int) -> int:
        return (parity * self._world_size + rank) * _SEQ.size * (1 + self._width)

    def exchange(self, row: Sequence[int]) -> list[tuple[int, ...]]:
        """Every rank's ``row`` (any width, the same on every rank), by rank; waits for the slowest rank.

        A row wider than the table maps a wider one first, on every rank in
        this round (a collective over the group). ``TimeoutError`` naming the
        missing ranks after ``timeout_s``.
        """
        width = len(row)
        if width > self._width:
            # Every rank finished reading the last round before it joins this: the old table is unread.
            grown = self._mapped(max(width, 2 * self._width), "grown")
            self._map.close()
            self._map, self._width = grown, max(width, 2 * self._width)
        self._round += 1
        parity = self._round & 1
        mine = self._offset(parity, self._rank)
        buffer = self._map
        # The row first, its sequence number last: a reader that sees the number sees the row.
        struct.pack_into(f"<{width}q", buffer, mine + _SEQ.size, *row)
        _SEQ.pack_into(buffer, mine, self._round)
        rows: list[tuple[int, ...]] = []
        deadline = 0.0
        for rank in range(self._world_size):
            offset = self._offset(parity, rank)
            spins = 0
            while _SEQ.unpack_from(buffer, offset)[0] != self._round:
                spins += 1
                if spins % _SPINS_BEFORE_YIELD == 0:
                    now = time.monotonic()
                    if not deadline:
                        deadline = now + self._timeout_s
                    elif now > deadline:
                        raise TimeoutError(
                            f"rank {rank} did not reach exchange {self._round} within "
                            f"{self._timeout_s:.0f} s (rank {self._rank} waited for it)"
                        )
                    time.sleep(0)  # let other threads of this process run
            rows.append(struct.unpack_from(f"<{width}q", buffer, offset + _SEQ.size))
        return rows
