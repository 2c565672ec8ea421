"""Tensor descriptors made on the device (Hopper's bulk tensor copy, TMA): the memory Triton needs for them.

Not a kernel module (it is not in ``KERNEL_MODULES``): every kernel that builds a descriptor in the kernel with
``tl.make_tensor_descriptor`` (the MoE weight tiles, the indexer's key tiles) needs Triton's global-memory allocator
set in the launching thread, and this is the one allocator they share.
"""

from __future__ import annotations

import torch
import triton


def descriptor_memory(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's global-memory allocator for the tensor descriptors the TMA kernels make on the device: on the
    current CUDA device at launch time, which is the device Triton launches on (a process that drives several GPUs,
    or a torch.distributed rank, gets its descriptors next to the kernel, never on the device of the first call).
    torch's caching allocator aligns to 512 bytes (Triton asks for 128 at most) and orders the reuse of the block
    on the current stream, the stream Triton launches on."""
    return torch.empty(size, dtype=torch.int8, device=torch.device("cuda", torch.cuda.current_device()))


def ensure_descriptor_allocator() -> None:
    """Install ``descriptor_memory`` as Triton's allocator unless one is set. Triton keeps it in a context
    variable (per thread), so each thread that launches gets it on its first TMA launch."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(descriptor_memory)
