"""A ViT-like encoder over packed items, captured in FULL graphs keyed by token budget (issue 42).

- ``model``: ``EncoderConfig``, ``ViTEncoder`` (patch embedding, transformer
  blocks, non-causal attention within each item: ``varlen_attn`` or a
  block-diagonal mask), reading its offsets through the attention seam.
- ``runner``: ``EncoderRunner`` (the encoder, a ``PackedMetadataBuilder``,
  the ``CUDAGraphManager`` of ``TokenBudgets.config()``, and a manager of no
  graphs whose eager steps are the baseline and the oracle): pack, run, cut
  per item.
- the benchmark ``python -m tests.benchmarks.encoder_throughput`` (GPU)
  captures the budgets, encodes random mixes and times them against eager;
  ``tests/manager/test_encoder.py`` checks each item against the item run alone.

    budgets = TokenBudgets.default(8192, max_items=8)
    runner = EncoderRunner(EncoderConfig(), budgets)
    runner.manager.capture()
    outputs = runner.encode(items)  # one [patches, hidden] per item
"""

from .model import EncoderConfig as EncoderConfig
from .model import ViTEncoder as ViTEncoder
from .runner import EncoderRunner as EncoderRunner
from .runner import encoder_static_inputs as encoder_static_inputs
from .runner import random_items as random_items

__all__ = ["EncoderConfig", "EncoderRunner", "ViTEncoder", "encoder_static_inputs", "random_items"]
