"""What a capture cost the device, as its report says: allocator plus driver, the device's loss (GPU).

The report's ``device_bytes`` is the drop of the device's free memory
(``cudaMemGetInfo``) over ``capture()``; it must match the drop the test
measures around the call, and split into torch's allocator (``reserved_bytes``)
and the driver's share outside it (the graphs' executables), which is not 0
for dozens of graphs of an 8-layer decoder.
"""

from __future__ import annotations

from typing import Final

import pytest
import torch

from cudagraph_dispatch import CaptureSizes, CUDAGraphMode, DispatchConfig
from cudagraph_manager import CUDAGraphManager
from cudagraph_manager._memory._device import reserved_bytes
from examples.config import DecoderConfig
from examples.reference import ReferenceDecoder, static_inputs

pytestmark = pytest.mark.gpu

#: cudaMemGetInfo moves in steps of 2 MiB.
GRANULE: Final = 2 * 2**20


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE], ids=lambda m: m.name)
def test_the_report_accounts_for_what_the_device_lost(mode: CUDAGraphMode) -> None:
    decoder = DecoderConfig()  # 8 layers, d=1024, bf16
    model = ReferenceDecoder(decoder, device="cuda")
    config = DispatchConfig(mode, CaptureSizes.default(128), max_num_seqs=decoder.max_num_seqs)
    manager = CUDAGraphManager(model.forward, static_inputs(decoder), config)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    report = manager.capture(progress=False)
    torch.cuda.synchronize()
    lost = free_before - torch.cuda.mem_get_info()[0]
    assert report.num_graphs == manager.num_captured >= 19  # default(128): 19 sizes
    assert abs(report.device_bytes - lost) <= GRANULE, (report.device_bytes, lost)
    assert report.device_bytes == report.reserved_bytes + report.outside_allocator_bytes
    assert report.outside_allocator_bytes > 0, "dozens of graph executables cost the driver nothing?"
    # The per-graph shares add up to at most the total (the total also holds the warm-ups' blocks).
    recorded = sum(g.pool_bytes + g.driver_bytes for g in report.graphs)
    assert 0 < recorded <= report.device_bytes + GRANULE * report.num_graphs
    print(f"{mode.name}: {report.num_graphs} graphs; {report}".splitlines()[0])  # for the log


def test_reserved_bytes_is_torchs_figure_read_without_flattening() -> None:
    """``_memory.reserved_bytes`` reads torch's nested statistics: the same number as ``memory_reserved``."""
    device = torch.device("cuda")
    held = [torch.empty(n * 2**20, dtype=torch.uint8, device=device) for n in (1, 3, 24)]
    assert reserved_bytes(device) == torch.cuda.memory_reserved(device) > 0
    del held
    torch.cuda.empty_cache()
    assert reserved_bytes(device) == torch.cuda.memory_reserved(device)
