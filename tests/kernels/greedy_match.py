"""Greedy tokens of two engines compared the way their dtype allows.

fp32: the same tokens and nearly the same logits. bf16: a different kernel
rounds differently, so a token may differ only where the reference's top two
logits are within a few bf16 rounding steps; the rest of that request is then
not compared (from there on the two runs condition on different tokens).
"""

from __future__ import annotations

import math

import torch


def assert_same_greedy(got: dict, ref: dict, ref_logits: dict, got_logits: dict, dtype: str) -> None:
    """``got``/``ref``: request id -> generated tokens; ``*_logits``: request id -> the logits
    row each token was sampled from (as tests.engine.recording.Recorder collects them)."""
    for rid, ref_tokens in ref.items():
        assert len(got[rid]) == len(ref_tokens), rid
        for i, (g, r) in enumerate(zip(got[rid], ref_tokens, strict=True)):
            if dtype == "float32":
                torch.testing.assert_close(got_logits[rid][i], ref_logits[rid][i], rtol=1e-3, atol=1e-3)
                assert g == r, f"{rid}: token {i} is {g}, reference {r}"
                continue
            if g != r:
                top1, top2 = ref_logits[rid][i].float().topk(2).values.tolist()
                assert top1 - top2 <= 8 * _bf16_ulp(top1), (
                    f"{rid}: token {i} is {g}, reference {r}, whose lead of {top1 - top2:.3f} is no bf16 near-tie")
                break


def _bf16_ulp(x: float) -> float:
    """Spacing of bf16 numbers around x (8 significant bits): the logits' own rounding step."""
    return torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(max(abs(x), 1e-3)))
