"""Non-owning aliases of CUDA tensors.

A graph's outputs and an eager break's arguments must keep their addresses,
but must not keep their memory alive: the shared pool hands freed blocks to
the next capture. An alias has the same storage pointer, size and strides,
and a storage that does not free the memory when the alias dies.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch.utils import _pytree as pytree

T = TypeVar("T")


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A non-owning alias of ``tensor`` (CUDA tensors only; others returned as is)."""
    if not tensor.is_cuda:
        return tensor
    storage = tensor.untyped_storage()
    alias_storage = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), tensor.device, storage.nbytes()
    )
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    alias.set_(alias_storage, tensor.storage_offset(), tensor.shape, tensor.stride())
    return alias


def _leaf(x: object) -> object:
    return weak_ref_tensor(x) if isinstance(x, torch.Tensor) else x


def weak_ref_tensors(obj: T) -> T:
    """``obj`` with every CUDA tensor in it (tuples, lists, dicts) replaced by an alias.

    ``obj`` holds a tensor at least (else ``ValueError`` naming ``obj``:
    there is nothing to alias); its other leaves, and tensors on other
    devices, come back as they are.
    """
    if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(obj)):
        raise ValueError(
            f"obj: expected a tensor or a pytree (tuple, list, dict) holding tensors, got {obj!r:.80}"
        )
    return weak_ref_tree(obj)


def weak_ref_tree(obj: T) -> T:
    """``weak_ref_tensors`` for our own callers: any pytree, tensors in it or not (an eager break's args)."""
    result: T = pytree.tree_map(_leaf, obj)
    return result


def contains_cuda_tensor(obj: object) -> bool:
    """True when ``obj`` (a pytree) holds a CUDA tensor."""
    return any(isinstance(x, torch.Tensor) and x.is_cuda for x in pytree.tree_leaves(obj))
