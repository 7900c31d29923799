"""``row_gather``'s kernel in Triton: copy packed rows below a device total, return at once past it.

Imported only where Triton is installed (``row_gather.TRITON``) and the
tensors are on CUDA.
"""

from __future__ import annotations

from typing import Final

import torch
import triton
import triton.language as tl

#: Packed rows per program: the grid is ``ceil(N / ROWS)`` programs per plane (K, V).
_ROWS: Final = 16
#: Elements of a row copied per iteration (a power of two; a row of ``heads * head_dim``).
_MAX_COLS: Final = 512


@triton.jit  # type: ignore[untyped-decorator]  # Triton is untyped
def _gather_kernel(  # type: ignore[no-untyped-def]  # Triton's kernel arguments
    src,
    dst,
    slots,
    total,
    src_plane,
    src_row,
    dst_plane,
    row: tl.constexpr,
    rows_per_program: tl.constexpr,
    cols: tl.constexpr,
):
    first = tl.program_id(0) * rows_per_program
    plane = tl.program_id(1).to(tl.int64)  # 0: keys, 1: values
    end = tl.load(total)
    if first >= end:  # past the real total: no read, no write
        return
    rows = first + tl.arange(0, rows_per_program)
    live = rows < end
    slot = tl.load(slots + rows, mask=live, other=0)  # int64
    source = src + plane * src_plane + slot[:, None] * src_row
    target = dst + plane * dst_plane + rows.to(tl.int64)[:, None] * row
    for start in range(0, row, cols):
        column = start + tl.arange(0, cols)
        mask = live[:, None] & (column[None, :] < row)
        tl.store(target + column[None, :], tl.load(source + column[None, :], mask=mask), mask=mask)


def gather_rows_until(flat: torch.Tensor, slots: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``flat [2, S, heads, head_dim]`` at ``slots [N]``, rows below ``total [1]`` only.

    Each slot's row (``heads, head_dim``) is contiguous; the planes and slots
    may be strided (a cache whose slots hold every layer: ``KVCacheMemory``).
    """
    _, _, heads, head_dim = flat.shape
    if flat.stride(3) != 1 or flat.stride(2) != head_dim:
        raise ValueError(
            f"flat: each slot's heads and head_dim must be contiguous, got strides {flat.stride()}"
        )
    num_rows, row = slots.shape[0], heads * head_dim
    packed = torch.empty((2, num_rows, heads, head_dim), dtype=flat.dtype, device=flat.device)
    if num_rows == 0:
        return packed
    cols = min(_MAX_COLS, triton.next_power_of_2(row))
    grid = (triton.cdiv(num_rows, _ROWS), 2)
    _gather_kernel[grid](
        flat,
        packed,
        slots,
        total,
        flat.stride(0),
        flat.stride(1),
        num_rows * row,
        row=row,
        rows_per_program=_ROWS,
        cols=cols,
    )
    return packed
