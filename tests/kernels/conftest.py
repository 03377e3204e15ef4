"""Kernel tests: natively on CUDA when present, else in triton's CPU interpreter.

``TRITON_INTERPRET=1`` is set here, at import, because pytest imports a
directory's conftest before its test modules, so it is in the environment
before anything under tests/kernels imports triton or launches a kernel.
(kernels/triton_jit.py also defers ``triton.jit`` to the first launch, so an
earlier ``import kernels`` by another test directory does not freeze the mode.)
On CUDA the variable is left alone: set it yourself to debug in the interpreter.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter computes bfloat16 wrongly, so bfloat16 runs on CUDA only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)
