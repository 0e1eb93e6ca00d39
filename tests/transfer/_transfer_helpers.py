"""Shared helpers for the transfer-layer tests (imported by the test modules;
the name is unique so it cannot collide with another directory's helpers)."""

from __future__ import annotations

from typing import Optional

import os

import torch

#: hypothesis examples of each GPU property test (device_check.sh lowers it
#: for the compute-sanitizer pass, where every launch is slow)
GPU_EXAMPLES = int(os.environ.get("HYBRIDKV_GPU_EXAMPLES", "40"))

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator,
                device: str = "cpu") -> torch.Tensor:
    """A tensor of random bit patterns (NaNs, infs, denormals included).

    Copies are bytewise, so the oracle must compare bits, not values.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape).to(device)


def kv_pair(layers: int, slots: int, heads: int, k_dim: int, v_dim: int, dtype: torch.dtype,
            gen: torch.Generator, pad_slots: int = 0,
            device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V buffers; ``pad_slots`` > 0 gives a strided layer dim."""
    k = random_bits((layers, slots + pad_slots, heads, k_dim), dtype, gen, device)
    v = random_bits((layers, slots + pad_slots, heads, v_dim), dtype, gen, device)
    return k[:, :slots], v[:, :slots]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of ``t`` on the CPU (for bitwise equality)."""
    return t.detach().to("cpu").contiguous().view(torch.uint8)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: Optional[str] = None) -> None:
    assert a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), what or "tensors differ bitwise"
