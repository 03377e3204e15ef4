"""Argument checks shared by the Triton kernel wrappers.

A kernel trusts every shape, dtype and stride it is handed: a wrong one reads
or writes the wrong memory instead of raising. The wrappers therefore check
them on the host with these helpers, which raise ``ValueError`` naming the
argument. Nothing here reads tensor *values* (that would synchronise with the
GPU on every call); value preconditions are documented on each wrapper.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def check_shape(name: str, t: torch.Tensor, expected: Iterable[int], layout: str) -> None:
    expected = tuple(expected)
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} {layout}, got {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must be one of {names}, got {str(t.dtype).removeprefix('torch.')}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{n}={str(d).removeprefix('torch.')}" for n, d in dtypes.items())
        raise ValueError(f"dtypes must match: {listed}")


def check_writable(name: str, t: torch.Tensor) -> None:
    """A tensor a kernel writes in place must not alias itself.

    An expanded view (stride 0 on a dimension longer than 1) maps several
    indices to one address, so parallel programs would race on it.
    """
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride(), strict=True)):
        if size > 1 and stride == 0:
            raise ValueError(f"{name} is written in place and must not be an expanded view (dim {dim} has stride 0)")
