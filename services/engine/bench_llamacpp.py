"""llama.cpp (through llama-cpp-python's low-level API) on the engine bench's workload.

llama.cpp at its best, as its own ``llama-server`` runs it: one context with ``max_seqs``
sequence slots, every step one ``llama_decode`` of a batch holding each running
sequence's next token plus the whole prompts of newly admitted sequences (continuous
batching), greedy picks from the logits of the rows that sample. The high-level
``Llama.generate`` runs one sequence at a time, which would leave llama.cpp's batching
unused. Batch-1 decode: one sequence, tokens/s after the first token, as pdserve's.

llama-cpp-python is optional (it compiles llama.cpp when installed: see BENCHMARKS.md). Every
measurement runs in a child process (``isolated``): a build that crashes (one compiled here
with its AMX kernels segfaulted in llama_decode) costs llama.cpp's columns, with the reason,
never the bench run.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCpp:
    """A loaded GGUF with one context of ``max_seqs`` sequence slots sharing ``n_ctx`` tokens."""

    def __init__(self, gguf_path: str, threads: int, max_seqs: int = 1, n_ctx: int = 1024, n_batch: int = 1024):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        lc.llama_log_set(_QUIET, ctypes.c_void_p())
        model_params = lc.llama_model_default_params()
        # a build with llama.cpp's AMX kernels crashes in ggml_backend_amx_mul_mat on this CPU
        # (ggml-org/llama.cpp#20824; 0.3.36 compiled with GGML_NATIVE on a Xeon with AMX): load
        # without the extra buffer types there (no AMX, no repacking). A build without AMX
        # (BENCHMARKS.md says how) keeps them: its repacked AVX-512 kernels are its best.
        model_params.use_extra_bufts = not built_with_amx()
        self.model = lc.llama_model_load_from_file(gguf_path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {gguf_path}")
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, min(n_batch, 512)
        params.n_seq_max, params.n_threads, params.n_threads_batch = max_seqs, threads, threads
        params.kv_unified = True  # the slots share one KV pool, as pdserve's requests share its blocks
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise RuntimeError("llama.cpp cannot create a context")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.max_seqs, self.n_batch = max_seqs, n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def clear(self, seq: int = -1) -> None:
        self.lc.llama_memory_seq_rm(self.lc.llama_get_memory(self.ctx), seq, -1, -1)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """One ``llama_decode`` of ``rows`` = (sequence, position, token, wants logits); returns
        the logits of the rows that want them, in order (views valid until the next decode)."""
        b = self.batch
        for i, (seq, pos, tok, want) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")
        out = []
        for i, (_, _, _, want) in enumerate(rows):
            if want:
                ptr = self.lc.llama_get_logits_ith(self.ctx, i)
                out.append(np.ctypeslib.as_array(ptr, shape=(self.vocab,)))
        return out

    def greedy(self, prompt: list[int], n: int, keep_logits: bool = False):
        """``n`` greedy tokens after ``prompt`` on sequence 0 (cleared first): the tokens, the
        logits row of each (copies) if asked, and the seconds from the first token to the last."""
        self.clear()
        tokens, logits = [], []
        rows = self.decode([(0, p, t, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        t0 = time.perf_counter()
        for step in range(n):
            row = rows[0]
            tokens.append(int(row.argmax()))
            if keep_logits:
                logits.append(row.copy())
            if step + 1 < n:
                rows = self.decode([(0, len(prompt) + step, tokens[-1], True)])
        return tokens, logits, time.perf_counter() - t0


def system_info() -> str:
    """llama.cpp's own line on what it was built with (``AVX512_VNNI = 1 | AMX_INT8 = 1 | ...``)."""
    import llama_cpp as lc

    lc.llama_backend_init()
    return lc.llama_print_system_info().decode().strip()


def built_with_amx() -> bool:
    return "AMX_INT8 = 1" in system_info()


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET(level, text, user_data):  # llama.cpp logs every load to stderr otherwise
    return None


def decode_b1(llm: LlamaCpp, prompt: list[int], n: int) -> float:
    """Batch-1 decode tokens/s after the first token (``n`` tokens timed)."""
    _, _, seconds = llm.greedy(prompt, n + 1)
    return n / seconds


def continuous_batching(llm: LlamaCpp, workload: list[tuple[list[int], int]]) -> float:
    """Output tokens/s over the whole workload, every request producing exactly its target."""
    waiting = list(enumerate(workload))
    free = list(range(llm.max_seqs))
    running: dict[int, list] = {}  # slot -> [request index, next position, last token, produced]
    produced_total = 0
    llm.clear()
    t = time.perf_counter()
    while waiting or running:
        rows = [(slot, pos, tok, True) for slot, (_, pos, tok, _) in running.items()]
        owners = list(running)
        budget = llm.n_batch - len(rows)
        while waiting and free and len(waiting[0][1][0]) <= budget:
            index, (prompt, _) = waiting.pop(0)
            slot = free.pop()
            rows += [(slot, p, tok, p == len(prompt) - 1) for p, tok in enumerate(prompt)]
            running[slot] = [index, len(prompt), None, 0]
            owners.append(slot)
            budget -= len(prompt)
        logits = llm.decode(rows)
        for slot, row in zip(owners, logits, strict=True):
            state = running[slot]
            state[2] = int(row.argmax())
            if state[3]:  # a decode row: its token went in at state[1]
                state[1] += 1
            state[3] += 1
            produced_total += 1
            if state[3] == workload[state[0]][1]:
                del running[slot]
                llm.clear(slot)
                free.append(slot)
    dt = time.perf_counter() - t
    assert produced_total == sum(o for _, o in workload), "llama.cpp produced a different number of tokens"
    return produced_total / dt


# ---- one measurement per child process --------------------------------------
def measure_decode_b1(gguf_path: str, threads: int, prompt: list[int], n: int) -> float:
    llm = LlamaCpp(gguf_path, threads, max_seqs=1, n_ctx=1024)
    decode_b1(llm, prompt, 8)  # warm-up
    tok_s = decode_b1(llm, prompt, n)
    llm.close()
    return tok_s


def measure_batched(gguf_path: str, threads: int, seqs: int, n_batch: int,
                    workload: list[tuple[list[int], int]]) -> float:
    longest = max(len(p) + o for p, o in workload)
    llm = LlamaCpp(gguf_path, threads, max_seqs=seqs, n_ctx=seqs * longest, n_batch=n_batch)
    continuous_batching(llm, [(p[:32], 4) for p, _ in workload[:2]])  # warm-up
    tok_s = continuous_batching(llm, workload)
    llm.close()
    return tok_s


def greedy_reference(gguf_path: str, threads: int, prompts: dict[str, list[int]], n: int) -> dict:
    """Request id -> (``n`` greedy tokens, the logits row of each) for every prompt, one at a time."""
    llm = LlamaCpp(gguf_path, threads, max_seqs=1, n_ctx=512)
    try:
        return {rid: llm.greedy(ids, n, keep_logits=True)[:2] for rid, ids in prompts.items()}
    finally:
        llm.close()


def isolated(fn, *args):
    """``fn(*args)`` in a fresh (spawned) child process: ``(value, None)``, or ``(None, why)``
    when it raised or its process died (a crash inside llama.cpp takes only the child)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(fn, *args).result(), None
        except BrokenProcessPool:
            return None, "its process died (a crash inside llama-cpp-python; see BENCHMARKS.md for a build that runs)"
        except Exception as exc:  # noqa: BLE001 - an optional baseline's failure is reported, not raised
            return None, f"{type(exc).__name__}: {exc}"
