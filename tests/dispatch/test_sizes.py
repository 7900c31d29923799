"""CaptureSizes: validation, padding to the smallest size that holds a batch, and the default list."""

from __future__ import annotations

import bisect
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cudagraph_dispatch import CaptureSizes
from cudagraph_dispatch._sizes import DENSE_PAD_LIMIT
from tests.dispatch.peak_memory import built_with_peak
from tests.strategies import MAX_CAPTURE_SIZE, capture_sizes, default_max_sizes, size_lists


def _naive_pad(sizes: list[int], n: int) -> int | None:
    """The spec, by a linear scan: the smallest size >= n, None above the largest."""
    for size in sorted(sizes):
        if size >= n:
            return size
    return None


def _spec_default(max_size: int) -> list[int]:
    """The default list (docs/design.md, "Keys"), written out: 1, 2, 4, every 8 below 256, every 16, max."""
    small = [s for s in (1, 2, 4) if s <= max_size]
    eights = [s for s in range(8, 256, 8) if s <= max_size]
    sixteens = [s for s in range(256, max_size + 1, 16)]
    return sorted({*small, *eights, *sixteens, max_size})


@given(size_lists)
def test_sizes_are_sorted_and_deduplicated(raw: list[int]) -> None:
    """Any order and repeats are accepted; .sizes is the ascending set and .max its last element."""
    sizes = CaptureSizes(raw)
    assert sizes.sizes == tuple(sorted(set(raw)))
    assert sizes.max == max(raw)


@given(
    size_lists,
    st.integers(min_value=0, max_value=DENSE_PAD_LIMIT + 64)
    | st.integers(min_value=0, max_value=MAX_CAPTURE_SIZE + 64),
)
def test_pad_agrees_with_a_linear_scan(raw: list[int], n: int) -> None:
    """pad (look-up, or bisection above DENSE_PAD_LIMIT) matches a scan: smallest size >= n, else None."""
    assert CaptureSizes(raw).pad(n) == _naive_pad(raw, n)


@pytest.mark.parametrize(
    "raw",
    [
        [1, DENSE_PAD_LIMIT - 1, DENSE_PAD_LIMIT, DENSE_PAD_LIMIT + 1, 2**20],
        [3, 2**20],
        [DENSE_PAD_LIMIT + 5],
        [5, DENSE_PAD_LIMIT],
        [7, 9],
    ],
)
def test_pad_on_both_sides_of_the_table_bound(raw: list[int]) -> None:
    """Up to DENSE_PAD_LIMIT pad looks up, above it bisects: both match a scan at every edge."""
    sizes = CaptureSizes(raw)
    bound = DENSE_PAD_LIMIT
    edges = {0, 1, 2, bound - 1, bound, bound + 1, 2**20 + 1} | {s + d for s in raw for d in (-1, 0, 1)}
    for n in sorted(edges):
        assert sizes.pad(n) == _naive_pad(raw, n), n


def test_memory_does_not_grow_with_the_largest_size() -> None:
    """Sizes [1, 2**20]: the padding table stops at DENSE_PAD_LIMIT instead of holding 2**20 entries."""
    sizes, peak = built_with_peak(lambda: CaptureSizes([1, 2**20]))
    assert peak < 256 * 1024, peak  # a table per count would be 8 MiB of pointers
    assert (sizes.pad(2), sizes.pad(2**20), sizes.pad(2**20 + 1)) == (2**20, 2**20, None)


@given(capture_sizes, st.data())
def test_pad_is_tight(sizes: CaptureSizes, data: st.DataObject) -> None:
    """A padded count holds the batch, is a captured size, and no smaller captured size would do."""
    n = data.draw(st.integers(min_value=1, max_value=sizes.max), label="n")
    padded = sizes.pad(n)
    assert padded is not None
    assert padded >= n
    assert padded in sizes.sizes
    assert all(s < n for s in sizes.sizes if s < padded)


@given(capture_sizes, st.integers(min_value=1, max_value=64))
def test_pad_above_the_largest_is_none(sizes: CaptureSizes, excess: int) -> None:
    """A batch above the largest size has no graph: pad says None rather than a wrong size."""
    assert sizes.pad(sizes.max + excess) is None
    assert sizes.pad(sizes.max) == sizes.max


@given(capture_sizes)
def test_every_size_pads_to_itself(sizes: CaptureSizes) -> None:
    """A batch of exactly a captured size is never padded further."""
    assert [sizes.pad(s) for s in sizes.sizes] == list(sizes.sizes)


def test_default_512_has_51_sizes() -> None:
    """The documented default: 1, 2, 4, 31 multiples of 8 below 256, 17 multiples of 16 from 256 to 512."""
    sizes = CaptureSizes.default(512)
    assert len(sizes.sizes) == 3 + 31 + 17 == 51
    assert sizes.sizes[:4] == (1, 2, 4, 8)
    assert sizes.sizes[-2:] == (496, 512)


@given(default_max_sizes)
def test_default_follows_the_formula(max_size: int) -> None:
    """default(n) is exactly the list of docs/design.md ("Keys"): it holds n and nothing above it."""
    sizes = CaptureSizes.default(max_size)
    assert list(sizes.sizes) == _spec_default(max_size)
    assert max_size in sizes.sizes
    assert sizes.max == max_size
    assert all(s <= max_size for s in sizes.sizes)


@pytest.mark.parametrize(
    ("raw", "field", "value"),
    [
        ([0], "capture_sizes[0]", "0"),
        ([1, 2, -8], "capture_sizes[2]", "-8"),
        ([1, 2.5], "capture_sizes[1]", "2.5"),
        (["4"], "capture_sizes[0]", "'4'"),
        ([8, True], "capture_sizes[1]", "True"),
        ([None], "capture_sizes[0]", "None"),
    ],
)
def test_bad_sizes_name_the_field_and_value(raw: list[object], field: str, value: str) -> None:
    """A size that is not a positive int (bool included) is a ValueError naming the entry and its value."""
    with pytest.raises(ValueError, match=f"{re.escape(field)}.*{re.escape(value)}"):
        CaptureSizes(raw)  # type: ignore[arg-type]  # deliberately wrong types


def test_empty_sizes_are_rejected() -> None:
    """A config with no size at all cannot capture anything: say so instead of failing later."""
    with pytest.raises(ValueError, match="capture_sizes"):
        CaptureSizes([])


@pytest.mark.parametrize("text", ["48", b"48"])
def test_a_string_is_not_a_list_of_sizes(text: str | bytes) -> None:
    """A string is iterable but is not a size list ("48" must not become sizes 4 and 8)."""
    with pytest.raises(ValueError, match="capture_sizes"):
        CaptureSizes(text)  # type: ignore[arg-type]  # deliberately wrong type


@pytest.mark.parametrize("max_size", [0, -1])
def test_default_rejects_non_positive_max(max_size: int) -> None:
    """default(max_size) needs max_size >= 1; the error names the argument and the value."""
    with pytest.raises(ValueError, match=f"max_size.*{max_size}"):
        CaptureSizes.default(max_size)


@given(capture_sizes)
def test_the_bucket_machinery_is_public_and_agrees_with_pad(sizes: CaptureSizes) -> None:
    """``bounds``, ``dense_buckets``, ``representatives()``: the dispatcher reads these, no private names."""
    assert sizes.bounds == (0, *sizes.sizes)
    reps = sizes.representatives()
    assert reps == (*sizes.bounds, sizes.max + 1)
    for bucket, count in enumerate(reps):
        assert bisect.bisect_left(sizes.bounds, count) == bucket
        if count < len(sizes.dense_buckets):
            assert sizes.dense_buckets[count] == bucket
    for n in range(min(len(sizes.dense_buckets), 300)):
        padded = sizes.pad(n)
        bucket = sizes.dense_buckets[n]
        assert padded == (
            sizes.bounds[bucket]
            if 0 < bucket <= len(sizes.sizes)
            else (sizes.sizes[0] if bucket == 0 else None)
        )
