"""How far an engine's outputs under a LoRA adapter are from PEFT's merged model in HF transformers:
what ``pdserve bench lora`` reports beside the speed of each ``--lora-dtype`` (a quantized
adapter store changes the numbers; bf16 is the reference path).

Per prompt, the engine generates greedily (one request alone, its logits captured as the sampler
sees them) and PEFT's merged fp32 model generates greedily too; then PEFT's model reads the
engine's tokens (teacher forcing), so every position compares the same context:

- ``first_divergence``: the first generated position where the two greedy outputs differ (None:
  all equal);
- ``max_abs_logit_diff``: the largest |engine logit - PEFT logit| over every position and token;
- ``logprob_diff_max`` / ``_mean``: |engine - PEFT| log-probability of the engine's chosen token;
- ``adapter_shift_max_logit``: how far the adapter moves PEFT's logits from the base model's at
  the same positions, the scale the differences above are small against.
"""

from __future__ import annotations

import torch

from services.engine.sampling_params import SamplingParams


def peft_merged(model, directory):
    """``model``'s HF twin (fp32) with the PEFT adapter at ``directory`` loaded and merged."""
    from peft import PeftModel

    from services.engine.hf_baseline import hf_twin

    base = hf_twin(model).float()
    return PeftModel.from_pretrained(base, str(directory)).merge_and_unload().eval()


def engine_greedy(engine, prompt: list[int], lora: str | None, max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The engine's greedy tokens for ``prompt`` alone and the fp32 logits each was sampled from."""
    seen: list[torch.Tensor] = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda h: seen.append(compute(h)) or seen[-1]
    try:
        rid = f"acc-{len(prompt)}-{lora}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                       lora=lora))
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
    finally:
        engine.model.compute_logits = compute
    return tokens, torch.cat([s.float() for s in seen])[:len(tokens)]


def compare(engine, lora: str, hf, hf_base, prompts: list[list[int]], max_tokens: int) -> dict:
    """The figures above for ``lora`` served by ``engine`` against ``hf`` (PEFT merged), over ``prompts``."""
    first, max_logit, lp_max, lp_sum, lp_n, shift = [], 0.0, 0.0, 0.0, 0, 0.0
    for prompt in prompts:
        tokens, logits = engine_greedy(engine, prompt, lora, max_tokens)
        ids = torch.tensor([prompt + tokens[:-1]])
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                               attention_mask=torch.ones_like(torch.tensor([prompt])))[0, len(prompt):].tolist()
            ref = hf(ids).logits[0, len(prompt) - 1:].float()
            base = hf_base(ids).logits[0, len(prompt) - 1:].float()
        first.append(next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None))
        max_logit = max(max_logit, (logits - ref).abs().max().item())
        chosen = torch.tensor(tokens)[:, None]
        lp = (logits.log_softmax(-1).gather(1, chosen) - ref.log_softmax(-1).gather(1, chosen)).abs()
        lp_max, lp_sum, lp_n = max(lp_max, lp.max().item()), lp_sum + lp.sum().item(), lp_n + lp.numel()
        shift = max(shift, (ref - base).abs().max().item())
    return {"prompts": len(prompts), "tokens": max_tokens, "first_divergence": first,
            "all_equal": all(f is None for f in first), "max_abs_logit_diff": round(max_logit, 4),
            "logprob_diff_max": round(lp_max, 4), "logprob_diff_mean": round(lp_sum / lp_n, 5),
            "adapter_shift_max_logit": round(shift, 4)}
