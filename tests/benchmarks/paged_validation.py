r"""The paged decoder's step with and without its checks of the batch, in one process (a GPU).

Usage: ``python -m tests.benchmarks.paged_validation [--attention gather]``.

Four managers serve the same 8-layer paged decoder (the same weights and
caches, FULL_AND_PIECEWISE), their backends differing only in
``validate``: ``"eager"`` (the default: eager steps checked, a graph path's
not), ``"device"`` (a graph path's checks recorded on the device, no
synchronization), ``"host"`` (the old checks: one synchronization on every
path) and ``False`` (no check). Rounds of steps
alternate between them (``interleave``), so the host's drift cancels; each
round runs ``STEPS`` steps and synchronizes once (host and device time
together). Prints the median microseconds per step of each, on uniform
decode batches (FULL graphs) and a mixed batch (PIECEWISE), and the ratios
to no check (the median of the per-round ratios) with their spread.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Final

import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, ManagerOptions
from cudagraph_manager.attention import AttentionOptions
from examples.config import DecoderConfig
from examples.inputs import make_paged_inputs
from examples.paged import FlexPagedAttention, GatherPagedAttention, PagedDecoder, PagedLayout
from examples.paged import paged_static_inputs as static_inputs
from examples.paged.batch import Validate
from tests.benchmarks.support import interleave

ROUNDS: Final = 30
STEPS: Final = 20
MODES: Final[dict[str, Validate]] = {"eager": "eager", "device": "device", "host": "host", "none": False}
#: (name, tokens, uniform): decodes of 1, 16 and 64 requests (FULL), one mixed batch (PIECEWISE).
BATCHES: Final = (
    ("decode_1", 1, True),
    ("decode_16", 16, True),
    ("decode_64", 64, True),
    ("mixed_96", 96, False),
)


def _models(attention: str) -> dict[str, PagedDecoder]:
    """One decoder per validation mode: the first's weights and caches, shared."""
    config = DecoderConfig(num_layers=8, max_num_seqs=64, max_seq_len=512)
    layout = PagedLayout.for_config(config, page_size=64)
    torch.manual_seed(0)
    base = PagedDecoder(config, layout=layout, backend=attention, device="cuda")
    tokens, reqs = config.max_num_seqs * layout.max_seq_len, config.max_num_seqs
    models = {}
    for name, validate in MODES.items():
        backend: FlexPagedAttention | GatherPagedAttention = (
            FlexPagedAttention(layout, max_tokens=tokens, max_reqs=reqs, device="cuda", validate=validate)
            if attention == "flex"
            else GatherPagedAttention(
                layout, config.dtype, max_tokens=tokens, max_reqs=reqs, device="cuda", validate=validate
            )
        )
        models[name] = base.with_backend(backend)
    return models


def _manager(model: PagedDecoder) -> CUDAGraphManager[torch.Tensor]:
    config = DispatchConfig(M_FAP, CaptureSizes.default(128), max_num_seqs=64)
    attention = AttentionOptions(metadata_builder=model.backend)
    manager = CUDAGraphManager(
        model, static_inputs(model.layout), config, options=ManagerOptions(attention=attention)
    )
    manager.capture(progress=False)
    return manager


M_FAP: Final = CUDAGraphMode.FULL_AND_PIECEWISE


def _step(
    manager: CUDAGraphManager[torch.Tensor], inputs: dict[str, torch.Tensor], uniform: bool
) -> Callable[[], object]:
    return lambda: manager.run_batch(inputs, uniform_decode=uniform)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--attention", choices=("gather", "flex"), default="gather")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    models = _models(args.attention)
    managers = {name: _manager(model) for name, model in models.items()}
    config, layout = next(iter(models.values())).config, next(iter(models.values())).layout
    generator = torch.Generator().manual_seed(1)
    print(f"paged step, {args.attention}, {torch.cuda.get_device_name()}: us per step (median of {ROUNDS})")
    with torch.inference_mode():
        for label, tokens, uniform in BATCHES:
            inputs = make_paged_inputs(
                config, layout, tokens, uniform_decode=uniform, generator=generator, device="cuda"
            )
            steps = {name: _step(manager, inputs, uniform) for name, manager in managers.items()}
            timed = interleave(steps, rounds=ROUNDS, calls_per_round=STEPS)
            for model in models.values():
                model.check_steps()  # the inputs are valid: nothing recorded
            median = {name: timed.median(name) * 1e6 for name in steps}
            ratios = ", ".join(
                f"{name}/none {timed.ratio(name, 'none'):.3f} [{timed.spread(name, 'none')}]"
                for name in ("eager", "device", "host")
            )
            row = "  ".join(f"{name} {value:8.1f}" for name, value in median.items())
            print(f"{label:>10}: {row}  ({ratios})")


if __name__ == "__main__":
    main()
