"""Device arguments, resolved once: a ``torch.device`` with an explicit index for CUDA."""

from __future__ import annotations

import torch


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """``device`` as a ``torch.device``; a CUDA device always carries its index.

    Args:
        device: a ``torch.device``, a device string, a CUDA index (an int),
            or ``None``: the current CUDA device, or the CPU where CUDA is
            unavailable. The CPU is ``cpu`` (``cpu:0`` too).

    Returns:
        The CUDA device with its index, or ``torch.device("cpu")``.

    Raises:
        ValueError: naming the value: a CUDA device that does not exist here
            (no CUDA at all, or an index past the last device), anything
            that is not a device, another CPU index, and a device that is
            neither CUDA nor the CPU (``meta`` holds no data to copy or
            compute on; others have no CUDA graphs and are not supported).
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    given: object = device  # checked at run time: callers may not be typed
    if isinstance(given, bool) or not isinstance(given, (torch.device, str, int)):
        raise ValueError(f"device: expected a torch.device, a device string or a CUDA index, got {device!r}")
    try:
        resolved = torch.device("cuda", given) if isinstance(given, int) else torch.device(given)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(
            f"device: expected a torch.device, a device string or a CUDA index, got {device!r}"
        ) from error
    if resolved.type == "cpu":
        if resolved.index not in (None, 0):  # torch keeps any index, but a CPU tensor's device is 'cpu'
            raise ValueError(f"device: the CPU is one device, 'cpu' (or 'cpu:0'), got {device!r}")
        return torch.device("cpu")  # 'cpu:0' too: what its tensors' device compares equal to
    if resolved.type != "cuda":
        raise ValueError(f"device: expected a CUDA device or the CPU, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} is a CUDA device, but CUDA is not available here")
    index: int | None = resolved.index  # None for plain "cuda" (torch's stubs say int)
    if index is None:
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device: {device!r} does not exist; this machine has {count} CUDA device(s)")
    return resolved


def cuda_index(device: torch.device | str | int | None) -> int:
    """The index of CUDA device ``device`` (``None``: the current one); ``ValueError`` for others."""
    if device is None:
        require_cuda("a CUDA graph pool or capture stream")
        return torch.cuda.current_device()
    resolved = resolve_device(device)
    if resolved.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device!r}")
    return resolved.index


def require_cuda(what: str) -> None:
    """Raise ``RuntimeError`` saying that ``what`` needs a CUDA device, where there is none."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs a CUDA device, and none is available here "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not compiled in'})"
        )
