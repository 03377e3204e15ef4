"""Probe: the closing path's search (services/engine/grammar_budget.py) from each bench schema's start.

    PYTHONPATH=. python benchmarks/probes/closing_path.py

For each of the 24 schemas of services/bench/structured_schemas.json, the search's path from the
empty output: its length in tokens, the time it took and the completion it spells. It showed the
search finds a completion for all 24 in 0.1-0.6 ms (up to 62 tokens: `order`), which is why the
window is 64 tokens and why searching every step of it cost +12.7% CPU per batch-8 step in
bench structured (BENCHMARKS.md) before the searches were spaced out.
"""

from __future__ import annotations

import time

from services.engine.grammar import GrammarCompiler
from services.engine.grammar_budget import ClosingPath
from services.engine.model_source import model_card
from services.engine.structured_bench import load_schemas
from services.engine.structured_output import StructuredOutput
from services.engine.tokenizer import Tokenizer


def main() -> None:
    card = model_card(None)
    tok = Tokenizer(card.tokenizer_dir)
    eos = [tok.eos_token_id] if getattr(tok, "eos_token_id", None) is not None else []
    compiler = GrammarCompiler(tok.backend.to_str(), card.vocab_size, eos)
    closing = ClosingPath(compiler.tokenizer, eos)
    for case in load_schemas():
        matcher = compiler.matcher(StructuredOutput.json_schema(case["schema"]))
        t0 = time.perf_counter()
        path = closing.search(matcher, 200)
        ms = (time.perf_counter() - t0) * 1e3
        text = compiler.tokenizer.decode_str(path) if path is not None else None
        print(f"{case['name']:14s} {len(path) if path is not None else '-':>4} tokens {ms:6.2f} ms  {text!r}")


if __name__ == "__main__":
    main()
