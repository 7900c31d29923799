"""The engine's start-up: estimate the graphs, give the KV cache the rest, capture (GPU, a fresh process).

``python -m examples.kv_sizing reference --json`` profiles
an eager step, estimates every graph of the reference decoder's plan, fills
the device with a KV cache up to the estimate and a 512 MiB margin, captures
every graph and serves a decode step: no out-of-memory error, the step
replayed, and what is left is the margin plus the estimate's error, plus the
rounding: less than one KV row, and up to 2 MiB per layer of the minimal
caches the start-up freed (the allocator had rounded each layer's up).
"""

from __future__ import annotations

from typing import Final

import pytest

from tests.capture.test_lean_import_capture import fresh_json

pytestmark = pytest.mark.gpu

MIB: Final = 2**20
GRANULE: Final = 2 * MIB


def run_kv_sizing(model: str, *flags: str) -> dict[str, float]:
    """The example in a fresh process; its figures."""
    return fresh_json("-m", "examples.kv_sizing", model, "--order", "estimate", *flags, "--json")


def check_kv_sizing(figures: dict[str, float]) -> None:
    """No eager step, a KV cache of most of the device, and the leftover the estimate's error explains."""
    assert figures["eager_steps"] == 0  # strict: the decode step after the capture replayed
    assert figures["kv_bytes"] > 8 * 2**30, "the KV cache should take most of the device"
    error = figures["estimate_bytes"] - figures["device_bytes"]
    surplus = figures["left_bytes"] - figures["margin_bytes"]
    rounding = figures["unit_bytes"] + figures["num_layers"] * GRANULE
    if figures["kv_cap"] and figures["kv_units"] == figures["kv_cap"]:
        # The attention kernel's bound sized the cache (FlexAttention's 32-bit offsets), not the memory:
        # the estimate's error is still what it was, and the device keeps more than the margin.
        assert abs(error) < 32 * MIB, error
        assert surplus > 0, surplus
        return
    assert error - GRANULE <= surplus <= error + rounding + GRANULE, (surplus, error, rounding)
    assert surplus > -32 * MIB, "the estimate was more than 32 MiB under: the margin was eaten into"


def test_a_kv_cache_sized_by_the_estimate_leaves_the_margin_after_the_capture() -> None:
    figures = run_kv_sizing("reference")
    print(f"\n{figures}")
    check_kv_sizing(figures)


def test_a_paged_cache_sized_by_the_estimate_leaves_the_margin_after_the_capture() -> None:
    """The same start-up on the paged decoder with FlexAttention: the cache sized in pages."""
    figures = run_kv_sizing("reference", "--attention", "flex")
    print(f"\n{figures}")
    unit: object = figures["kv_unit"]  # the one string among the figures
    assert unit == "page"
    check_kv_sizing(figures)
