"""The demo's command line: its arguments, checked, and the decoder configuration they make.

``parse_args`` returns the namespace ``demo.main`` runs: the path (``cpu_path``:
``--cpu`` or no CUDA device), defaults by path, and ``model_config``. An
argument that makes no valid run is a usage error, not a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Final

import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode

from .config import DecoderConfig
from .paged import BACKENDS

DTYPES: Final = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: Tokens above the largest capture size for the last step (it runs eagerly).
OVERFLOW: Final = 8
#: ``--attention``: the paged backends, or ``rows``: the reference decoder's cache of one row per request.
ATTENTIONS: Final = (*BACKENDS, "rows")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m examples.demo",
        description="Capture the reference decoder's graphs, replay them, check and time them against eager.",
    )
    parser.add_argument("--max-size", type=int, default=256, help="largest capture size (default 256)")
    parser.add_argument("--steps", type=int, default=24, help="steps in the loop (default 24)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (GPU 8, CPU 2)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (GPU 1024, CPU 128)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (GPU 16, CPU 4)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="KV cache positions per request")
    parser.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default=None,
        help="flex: FlexAttention over a paged KV cache (GPU default); gather: each request's pages "
        "gathered, then SDPA (CPU default); rows: the reference decoder's cache of one row per request",
    )
    parser.add_argument("--page-size", type=int, default=None, help="tokens per KV page (GPU 128, CPU 16)")
    parser.add_argument("--mode", choices=[m.name for m in CUDAGraphMode], default="FULL_AND_PIECEWISE")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="model dtype (GPU bfloat16, CPU float32)"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed calls per step (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=None, help="max relative error (default by dtype)")
    parser.add_argument("--cpu", action="store_true", help="take the CPU path even where CUDA is available")
    return _checked(parser, parser.parse_args(argv))


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` checked and completed (defaults by path, the model's config); errors through ``parser``."""
    for name, low in (("max_size", 1), ("steps", 1), ("iters", 1), ("warmup", 0), ("page_size", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if args.tolerance is not None and not args.tolerance > 0:
        parser.error(f"--tolerance must be > 0, got {args.tolerance}")
    args.cpu_path = args.cpu or not torch.cuda.is_available()
    if args.attention is None:
        args.attention = "gather" if args.cpu_path else "flex"
    if args.page_size is None:
        args.page_size = 16 if args.cpu_path else 128
    try:
        CaptureSizes.default(args.max_size)
    except ValueError as error:
        parser.error(f"--max-size: {error}")
    try:  # a model the other arguments cannot make is an argument error, not a traceback
        args.model_config = _config(args, cpu=args.cpu_path)
    except ValueError as error:
        parser.error(f"these arguments make no valid decoder: {error}")
    config: DecoderConfig = args.model_config
    last = args.max_size + OVERFLOW  # the last step's tokens, above the largest size
    if config.max_num_seqs * config.max_seq_len < last:
        parser.error(
            f"--max-seq-len: the last step has {last} tokens, and {config.max_num_seqs} requests of "
            f"{config.max_seq_len} positions hold {config.max_num_seqs * config.max_seq_len}; "
            f"pass at least {-(-last // config.max_num_seqs)}"
        )
    return args


def _config(args: argparse.Namespace, *, cpu: bool) -> DecoderConfig:
    base = DecoderConfig.small() if cpu else DecoderConfig()
    if args.dtype is not None:  # honoured on both paths (a CPU runs bfloat16 too, slowly)
        base = dataclasses.replace(base, dtype=DTYPES[args.dtype])
    hidden = base.hidden_size if args.hidden is None else args.hidden
    ffn = -(-(hidden * 11 // 4) // 32) * 32  # ~2.75 x hidden, a multiple of 32 (2816 for d=1024)
    return dataclasses.replace(
        base,
        num_layers=base.num_layers if args.layers is None else args.layers,
        hidden_size=hidden,
        num_heads=base.num_heads if args.heads is None else args.heads,
        intermediate_size=base.intermediate_size if args.hidden is None else ffn,
        max_seq_len=base.max_seq_len if args.max_seq_len is None else args.max_seq_len,
        max_num_seqs=args.max_size,
    )
