"""Probe: xgrammar against llguidance on this CPU, for choosing pdserve's grammar engine.

    PYTHONPATH=. python benchmarks/probes/grammar_engines.py [--save]

xgrammar is not a pdserve dependency (it requires torch and triton, and would let pip replace a
CPU torch): install it for the probe with ``pip install --no-deps xgrammar apache-tvm-ffi``.

Both engines get SmolLM2-135M-Instruct's tokenizer (49,152 tokens) and the 24 schemas of
``services/bench/structured_schemas.json``. Per engine it times:

- tokenizer set-up (once per process);
- cold compile of each schema (llguidance: grammar_from_json_schema + the LLMatcher that
  compiles it; xgrammar: GrammarCompiler.compile_json_schema with its cache cleared) and a
  cached one (llguidance: deep_copy of the compiled matcher, what pdserve keeps per schema;
  xgrammar: a compiler cache hit + a GrammarMatcher);
- the per-token mask (fill the bitmask for the next token, then accept one), at batch 1
  (one matcher) and batch 8 (eight matchers of different schemas filled by one call: llguidance's
  LLExecutor, xgrammar's BatchGrammarMatcher), over the same token sequences: a seeded random
  walk through each schema's grammar made with llguidance, replayed in xgrammar up to the first
  token it refuses (their JSON whitespace rules differ).

Also whether importing the engine imports torch: the gateway validates schemas and loads no torch.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SCHEMAS = Path(__file__).resolve().parents[2] / "services" / "bench" / "structured_schemas.json"
WALK_TOKENS = 48


def _tokenizer_json() -> str:
    from services.engine.model_source import resolve_model

    source = resolve_model(None)
    return (Path(source.tokenizer_dir) / "tokenizer.json").read_text(), source.config.vocab_size


def _imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _walks(llg, tok, schemas: list[dict]) -> list[list[int]]:
    """Per schema a seeded random walk of allowed tokens (ending early when the grammar ends)."""
    rng = random.Random(0)
    walks = []
    for s in schemas:
        m = llg.LLMatcher(tok, llg.LLMatcher.grammar_from_json_schema(s["schema"]))
        toks: list[int] = []
        for _ in range(WALK_TOKENS):
            bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
            allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
            allowed = [t for t in allowed.tolist() if t != tok.eos_token]
            if not allowed or m.is_stopped():
                break
            t = rng.choice(allowed)
            m.consume_token(t)
            toks.append(t)
        walks.append(toks)
    return walks


def probe_llguidance(tok_json: str, vocab: int, schemas: list[dict], walks: list[list[int]]) -> dict:
    import llguidance as llg
    import llguidance.numpy as llnp

    t0 = time.perf_counter()
    tok = llg.LLTokenizer(tok_json, n_vocab=vocab)
    setup = time.perf_counter() - t0
    cold, cached, compiled = [], [], []
    for s in schemas:
        t0 = time.perf_counter()
        m = llg.LLMatcher(tok, llg.LLMatcher.grammar_from_json_schema(s["schema"]))
        cold.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
        compiled.append(m)
        t0 = time.perf_counter()
        m.deep_copy()
        cached.append(time.perf_counter() - t0)
    mask = llnp.allocate_token_bitmask(8, vocab)
    b1 = []
    for m0, walk in zip(compiled, walks):
        m = m0.deep_copy()
        for t in walk:
            t0 = time.perf_counter()
            llnp.fill_next_token_bitmask(m, mask, 0)
            m.consume_token(t)
            b1.append(time.perf_counter() - t0)
    executor = llg.LLExecutor()
    b8 = []
    for start in range(0, len(schemas) - 7, 8):
        group = [(compiled[i].deep_copy(), walks[i]) for i in range(start, start + 8)]
        for step in range(min(len(w) for _, w in group)):
            t0 = time.perf_counter()
            llnp.fill_next_token_bitmask_par(executor, [(m, i) for i, (m, _) in enumerate(group)], mask)
            for m, w in group:
                m.consume_token(w[step])
            b8.append(time.perf_counter() - t0)
    return _summary("llguidance", setup, cold, cached, b1, b8, _imports_torch("llguidance"))


def probe_xgrammar(vocab: int, tokenizer_dir: str, schemas: list[dict], walks: list[list[int]]) -> dict:
    import torch
    import transformers
    import xgrammar as xgr

    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    setup = time.perf_counter() - t0
    cold, cached, compiled = [], [], []
    for s in schemas:
        compiler.clear_cache()
        text = json.dumps(s["schema"])
        t0 = time.perf_counter()
        g = compiler.compile_json_schema(text, any_whitespace=False)
        cold.append(time.perf_counter() - t0)
        compiled.append(g)
        t0 = time.perf_counter()
        xgr.GrammarMatcher(compiler.compile_json_schema(text, any_whitespace=False))
        cached.append(time.perf_counter() - t0)
    mask = xgr.allocate_token_bitmask(8, vocab)
    b1, replayed = [], 0
    for g, walk in zip(compiled, walks):
        m = xgr.GrammarMatcher(g)
        for t in walk:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            ok = m.accept_token(t)
            b1.append(time.perf_counter() - t0)
            if not ok:
                break
            replayed += 1
    batch = xgr.BatchGrammarMatcher(max_threads=2)
    b8 = []
    for start in range(0, len(schemas) - 7, 8):
        group = [(xgr.GrammarMatcher(compiled[i]), walks[i]) for i in range(start, start + 8)]
        for step in range(min(len(w) for _, w in group)):
            t0 = time.perf_counter()
            batch.batch_fill_next_token_bitmask([m for m, _ in group], mask)
            oks = [m.accept_token(w[step]) for m, w in group]
            b8.append(time.perf_counter() - t0)
            if not all(oks):
                break
    del torch
    out = _summary("xgrammar", setup, cold, cached, b1, b8, _imports_torch("xgrammar"))
    out["walk_tokens_replayed"] = replayed
    return out


def _summary(name, setup, cold, cached, b1, b8, torch_import) -> dict:
    ms = lambda xs: round(_median(xs) * 1e3, 4) if xs else None  # noqa: E731
    return {"engine": name, "tokenizer_setup_ms": round(setup * 1e3, 1),
            "compile_cold_ms_median": ms(cold), "compile_cold_ms_max": round(max(cold) * 1e3, 3),
            "compile_cold_ms_total": round(sum(cold) * 1e3, 1),
            "compile_cached_ms_median": ms(cached), "mask_ms_per_token_batch1_median": ms(b1),
            "mask_ms_per_step_batch8_median": ms(b8), "steps_batch1": len(b1), "steps_batch8": len(b8),
            "import_loads_torch": torch_import}


def main() -> None:
    import argparse

    import llguidance as llg

    from services.bench import results as result_files
    from services.engine.model_source import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result_files.add_save_argument(parser)
    args = parser.parse_args()
    schemas = json.loads(SCHEMAS.read_text())["schemas"]
    source = resolve_model(None)
    tok_json = (Path(source.tokenizer_dir) / "tokenizer.json").read_text()
    vocab = source.config.vocab_size
    walks = _walks(llg, llg.LLTokenizer(tok_json, n_vocab=vocab), schemas)
    result = {"schemas": len(schemas), "vocab": vocab, "walk_tokens": sum(map(len, walks)),
              "engines": [probe_llguidance(tok_json, vocab, schemas, walks),
                          probe_xgrammar(vocab, str(source.tokenizer_dir), schemas, walks)]}
    print(json.dumps(result, indent=2))
    result_files.save("grammar-engines", result, args)


if __name__ == "__main__":
    main()
