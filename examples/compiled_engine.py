"""The "Compiled models" example of docs/compiled.md, whole.

``python -m examples.compiled_engine`` runs it.
"""

import argparse

import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager, compile_for_capture
from examples import DecoderConfig, ReferenceDecoder, static_inputs
from examples.compiled import compiled_cached_attention
from examples.inputs import make_step_inputs

parser = argparse.ArgumentParser(description="Compile and capture the reference decoder, then replay (CUDA).")
parser.parse_args()  # --help: it takes no options
if not torch.cuda.is_available():  # this example captures CUDA graphs; `make demo` has a CPU path
    raise SystemExit("This example needs a CUDA device (it captures CUDA graphs); run `make demo` on a CPU.")
decoder = DecoderConfig(num_layers=2)  # bf16, d=1024, a static KV cache written in place
# Attention: one opaque custom op for the compiler, an eager break at run time (examples/compiled.py).
model = ReferenceDecoder(decoder, device="cuda", attention=compiled_cached_attention)
inputs = static_inputs(decoder)
# Inductor without CUDA graphs of its own, the token dimension symbolic: one compile serves every size.
compiled = compile_for_capture(model, inputs)
config = DispatchConfig(CUDAGraphMode.FULL_AND_PIECEWISE, CaptureSizes.default(256), max_num_seqs=256)
manager = CUDAGraphManager(compiled, inputs, config, strict=True)
with torch.no_grad():
    print(manager.capture())  # compiles in the first warm-up (and once more for 1 token), then 70 graphs
    decode = make_step_inputs(decoder, 13, uniform_decode=True, device="cuda")
    hidden = manager.run_batch(decode, uniform_decode=True)  # the FULL graph of 16: compiled code, whole
    torch.testing.assert_close(hidden, compiled(**decode), rtol=5e-2, atol=5e-2)
    mixed = make_step_inputs(decoder, 40, uniform_decode=False, device="cuda")
    hidden = manager.run_batch(mixed)  # the PIECEWISE graph of 40: compiled segments, attention eager
    torch.testing.assert_close(hidden, compiled(**mixed), rtol=5e-2, atol=5e-2)
    print(manager.stats)
