"""The small tier's confidence signal, measured: the first tokens' log-probabilities of the real default
model (SmolLM2-135M-Instruct, greedy, through the engine) on a fixed set of chat prompts.

``python -m services.sim.cascade_confidence`` writes ``cascade_confidence.json`` beside this module;
``pdserve bench cascade`` reads it to know what share of requests a threshold escalates
(services/sim/cascade.py). The prompts mix what a small model answers well (capitals, arithmetic,
short definitions) with what it does not (multi-step reasoning, code, other languages, obscure
facts), so the signal has a spread to measure; the mix is a choice, said where the figures are.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

CONFIDENCE_FILE = Path(__file__).with_name("cascade_confidence.json")
TOKENS = 16  # first tokens kept per prompt: the cascade's --cascade-tokens up to this can be replayed

_EASY = ["What is the capital of {0}?", "What is {1} plus {2}?", "Define the word '{3}' in one sentence.",
         "Name a colour of the {4}."]
_HARD = ["Prove that the square root of {2} is irrational, step by step.",
         "Write a Rust function that parses {5} and returns an error for bad input.",
         "Translate into Finnish: 'The {4} in the {6} was older than the {3}.'",
         "Who was the mayor of {7} in 1847, and what did they build?",
         "If a train leaves at {1}:15 going {2}0 km/h and another at {2}:40 going {1}5 km/h, when do they meet?"]
_FILL = [("France", 3, 7, "river", "sky", "JSON", "library", "Tartu"),
         ("Japan", 12, 5, "bridge", "sea", "ISO dates", "garden", "Ghent"),
         ("Kenya", 41, 8, "ledger", "forest", "IPv6 addresses", "tower", "Lviv"),
         ("Peru", 6, 9, "harbour", "desert", "semantic versions", "museum", "Bergen")]


def prompts() -> list[tuple[str, str]]:
    """(kind, prompt) pairs: 16 easy, 20 hard."""
    return [(kind, t.format(*fill)) for fill in _FILL for kind, ts in (("easy", _EASY), ("hard", _HARD)) for t in ts]


def measure(tokens: int = TOKENS) -> dict:
    """Greedy answers' first ``tokens`` log-probabilities per prompt (bf16, ``pdserve up``'s default)."""
    from services.config import EngineConfig
    from services.engine.engine import Engine
    from services.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(dtype="bfloat16", kv_cache_bytes=64 << 20))
    rows = []
    started = time.perf_counter()
    for i, (kind, text) in enumerate(prompts()):
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        engine.add_request(str(i), ids, SamplingParams(max_tokens=tokens, temperature=0, logprobs=0))
        logprobs: list[float] = []
        while engine.has_unfinished():
            for out in engine.step():
                logprobs += [lp.logprob for lp in out.logprobs or () if lp is not None]
        rows.append({"kind": kind, "prompt": text, "logprobs": [round(x, 5) for x in logprobs]})
        print(f"[cascade confidence] {i + 1}/{len(prompts())} {kind}: mean {sum(logprobs) / max(1, len(logprobs)):.3f}",
              flush=True)
    return {"model": engine.model_name, "dtype": "bfloat16", "tokens": tokens, "wall_s": round(time.perf_counter() - started, 1),
            "prompts": rows}


def load(path: Path = CONFIDENCE_FILE) -> dict:
    return json.loads(path.read_text())


if __name__ == "__main__":
    result = measure()
    CONFIDENCE_FILE.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(result['prompts'])} prompts in {result['wall_s']} s -> {CONFIDENCE_FILE}")
