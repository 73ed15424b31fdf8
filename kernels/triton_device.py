"""Where a Triton kernel of the project can run: on CUDA tensors, or on CPU tensors when the
kernel was built under Triton's interpreter.

Triton reads `TRITON_INTERPRET` when a `@triton.jit` function is defined, i.e. when its module
(`kernels.triton_attention`, `kernels.triton_store_ops`) is imported, not when `triton` itself
is (transformers imports triton early): set `TRITON_INTERPRET=1` before importing those
modules to run them on CPU tensors.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def require_launchable(kernel, *tensors: torch.Tensor) -> None:
    """Check that `kernel` (a `@triton.jit` function) can run on `tensors`.

    Raises:
        ValueError: the tensors are not all on one device, or they are on a non-CUDA device
            while `kernel` was compiled for the GPU (no `TRITON_INTERPRET=1` at import).
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(
            f"Triton kernel inputs lie on several devices: {sorted(map(str, devices))}"
        )
    device = devices.pop()
    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise ValueError(
            f"Triton kernels run on CUDA tensors, got {device}: to run them on the CPU set "
            "TRITON_INTERPRET=1 before importing kernels.triton_attention / triton_store_ops"
        )
