"""How this package's Triton kernels are compiled and launched.

Triton is optional: the engine's CPU path uses the torch references, and
``import kernels.ops`` must work where triton is not installed. So triton is
imported here, guarded, and nowhere else.

Compilation is deferred to the first launch. ``triton.jit`` decides when it
decorates a function whether the kernel is compiled for the GPU or run by the
CPU interpreter (``TRITON_INTERPRET=1``). Decorating at import would freeze that
choice at whatever the environment was when the first module in the process
imported ``kernels`` (with pytest, often a test directory other than the
kernel tests). Kernel modules therefore hold plain functions marked with
``lazy_jit``, which reference ``tl`` as a module global: both the compiler and
the interpreter resolve ``tl`` through the kernel function's globals.

What must hold in a kernel module: it imports ``tl`` from here (``None`` without
triton) and keeps ``from __future__ import annotations``, so that its
``tl.constexpr`` annotations stay strings and the module imports without
triton; kernels call no other kernel (a callee would need ``triton.jit`` at
import).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch references still work; the wrappers say what is missing
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    """True when ``triton.jit`` would now build interpreter kernels (``TRITON_INTERPRET``).

    Asks triton itself, so "1", "true", "on" read exactly as triton reads them.
    """
    return triton is not None and bool(triton.knobs.runtime.interpret)


class LazyKernel:
    """A kernel function that becomes ``triton.jit(fn)`` on its first launch."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._jitted = None

    def __getitem__(self, grid):
        if self._jitted is None:
            if triton is None:
                raise RuntimeError(
                    f"{self.fn.__name__} needs triton, which is not installed; "
                    "install triton or use the torch kernel backend"
                )
            self._jitted = triton.jit(self.fn)
        return self._jitted[grid]


def lazy_jit(fn: Callable) -> LazyKernel:
    return LazyKernel(fn)


def next_pow2(n: int) -> int:
    """Triton tile sizes must be powers of two; masks cover the padding."""
    return 1 << max(0, int(n) - 1).bit_length()


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the tensors can be handed to a Triton kernel here.

    Checks: triton is installed, all tensors share one device, that device is
    CUDA or the interpreter is on, and no bfloat16 under the interpreter (it
    computes bfloat16 wrongly: dots return garbage, casts truncate).
    """
    if triton is None:
        raise ValueError("the triton kernels need the 'triton' package; install it or use the torch backend")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    device = devices.pop()
    if interpreting():
        if any(t.dtype == torch.bfloat16 for t in tensors):
            raise ValueError(
                "bfloat16 is not supported under TRITON_INTERPRET=1 (the interpreter's bfloat16 "
                "arithmetic is wrong); test bfloat16 on CUDA"
            )
        return
    if device.type != "cuda":
        raise ValueError(
            f"triton kernels need CUDA tensors, got {device}; on CPU use the torch backend "
            "(or TRITON_INTERPRET=1 for tests)"
        )
