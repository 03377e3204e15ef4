"""Which implementation ``select_ops`` picks, and that kernels.ops imports without triton."""

import inspect
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import kernels.ops as ops_module
from kernels.ops import CPU_OPS, TORCH_OPS, TRITON_OPS, select_ops

REPO = Path(__file__).resolve().parents[2]


def test_auto_off_cuda_is_the_cpu_set_and_torch_forces_the_references():
    assert select_ops("cpu") is CPU_OPS
    assert select_ops("cpu", "torch") is TORCH_OPS
    assert select_ops("cuda:0", "torch") is TORCH_OPS


def test_auto_is_triton_on_cuda_when_triton_imports(monkeypatch):
    monkeypatch.setattr(ops_module, "triton_available", lambda: True)
    assert select_ops("cuda") is TRITON_OPS
    assert select_ops("cuda:1", "auto") is TRITON_OPS
    monkeypatch.setattr(ops_module, "triton_available", lambda: False)
    assert select_ops("cuda") is TORCH_OPS


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(ops_module, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA device"):
        select_ops("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_ops("cpu", "triton") is TRITON_OPS


def test_forced_triton_without_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(ops_module, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="'triton' package"):
        select_ops("cuda", "triton")


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown kernel backend"):
        select_ops("cpu", "cutlass")


@pytest.mark.parametrize("ops", [TRITON_OPS, CPU_OPS], ids=["triton", "cpu"])
def test_kernel_ops_take_the_reference_signatures(ops):
    # The model calls whichever Ops it holds with the same arguments.
    for field in fields(TORCH_OPS):
        ref, kernel = getattr(TORCH_OPS, field.name), getattr(ops, field.name)
        if not callable(ref):
            continue
        assert list(inspect.signature(kernel).parameters) == list(inspect.signature(ref).parameters), field.name


def test_only_the_cpu_set_packs_bf16_linears():
    assert CPU_OPS.packs_linears and not TORCH_OPS.packs_linears and not TRITON_OPS.packs_linears


def test_imports_and_falls_back_without_triton():
    # A None entry in sys.modules makes ``import triton`` raise ImportError.
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "from kernels.ops import TORCH_OPS, select_ops\n"
        "assert select_ops('cuda') is TORCH_OPS\n"
        "try:\n"
        "    select_ops('cuda', 'triton')\n"
        "except ValueError as e:\n"
        "    print('error:', e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "needs the 'triton' package" in result.stdout
