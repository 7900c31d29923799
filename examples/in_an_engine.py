"""The README's "In an engine" example, whole: ``python -m examples.in_an_engine``."""

import argparse

import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, StaticInput

parser = argparse.ArgumentParser(description="Capture a toy model, then replay a padded step (CUDA).")
parser.parse_args()  # --help: it takes no options
if not torch.cuda.is_available():  # this example captures CUDA graphs; `make demo` has a CPU path
    raise SystemExit("This example needs a CUDA device (it captures CUDA graphs); run `make demo` on a CPU.")
# Any callable taking the inputs as keyword arguments: here a toy token mixer.
embed = torch.nn.Embedding(1000, 256, device="cuda")
mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.SiLU(), torch.nn.Linear(1024, 256)).to("cuda")


def model(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x: torch.Tensor = embed(input_ids) + torch.sin(positions[:, None].float())  # [num_tokens, 256]
    mixed: torch.Tensor = mlp(x)
    return x + mixed


config = DispatchConfig(CUDAGraphMode.FULL_AND_PIECEWISE, CaptureSizes.default(256), max_num_seqs=256)
manager = CUDAGraphManager(
    model,
    {"input_ids": StaticInput(dtype=torch.int64), "positions": StaticInput(dtype=torch.int64)},
    config,
    strict=True,  # raise instead of silently running a step eagerly
)
with torch.no_grad():
    print(manager.capture())  # every planned size, largest first, one pool; a report table
    ids = torch.randint(0, 1000, (13,), device="cuda")  # a decode step of 13 requests
    pos = torch.randint(0, 4096, (13,), device="cuda")
    hidden = manager.run(input_ids=ids, positions=pos, uniform_decode=True)  # padded to 16, replayed, cut
    # Outputs alias graph memory: they stay valid until the next run (clone what you keep).
    assert hidden.shape == (13, 256)
    torch.testing.assert_close(hidden, model(ids, pos), rtol=1e-3, atol=1e-3)
    print(manager.stats)
