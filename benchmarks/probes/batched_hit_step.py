"""What one prefill step costs with several prefix hits in it, against the simulator's step model.

The simulator's stepped prefill worker (``services/sim/prefill_steps.py``) charges a step
of chunks ``n_i`` ending at context ``c_i`` ``base + per_token * sum(n_i) +
per_token_context * sum(n_i * c_i)``: one ``base`` per step, however many requests share
it. ``calibrate.py`` timed one request per step only. Under kv-aware routing a prefill
worker's steps are mostly several short prefix hits together (24 new tokens on a
1,024-token cached system prompt), so if a request in a step costs more than its tokens
(its block table, its cached KV gathered for attention, its sampling), the model runs
those steps too fast.

This times (process CPU seconds, one torch thread, the engine bench routing's workers run:
``max_num_batched_tokens`` 1,024, ``long_prefill_chunk`` 512) one step holding k hits
(k = 1, 2, 4, 8; each 16-32 new tokens after the same cached 1,024), and a step holding a
512-token chunk of a miss plus k hits, and prints each beside the model's figure from
the calibration file.

Usage: PYTHONPATH=. python benchmarks/probes/batched_hit_step.py [--repeats 5] [--json OUT]
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    from services.config import EngineConfig
    from services.engine.engine import Engine
    from services.engine.sampling_params import SamplingParams
    from services.sim.profiles import load_profile

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(max_num_batched_tokens=1024, long_prefill_chunk=512, max_num_seqs=128))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prof = load_profile("cpu")
    model = (lambda chunks: prof.prefill_base_s + prof.prefill_per_token_s * sum(n for n, _ in chunks)
             + prof.prefill_per_token_context_s * sum(n * c for n, c in chunks))

    def fresh(n):
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def run_out():
        while engine.has_unfinished():
            engine.step()

    rows = []
    with torch.inference_mode():
        engine.add_request("warm", fresh(256), params)
        run_out()
        prefix = fresh(1024)
        engine.add_request("seed", prefix + fresh(16), params)
        run_out()
        for miss in (False, True):
            for k in (1, 2, 4, 8):
                times, chunks = [], []
                for r in range(args.repeats):
                    tag = f"{int(miss)}.{k}.{r}"
                    chunks = []
                    if miss:  # its first 512-token chunk is in the step, ahead of the hits (it was running)
                        engine.add_request(f"m{tag}", fresh(1024), params)
                        chunks.append((512, 512))
                    for i in range(k):
                        n = rng.randint(16, 32)
                        engine.add_request(f"h{tag}.{i}", prefix + fresh(n), params)
                        chunks.append((n, 1024 + n))
                    t = time.process_time()
                    engine.step()  # the one step holding them all
                    times.append(time.process_time() - t)
                    run_out()
                measured = statistics.median(times)
                rows.append({"miss_chunk": miss, "hits": k, "measured_s": round(measured, 4),
                             "model_s": round(model(chunks), 4), "ratio": round(measured / model(chunks), 3),
                             "times_s": [round(x, 4) for x in times]})
                print(f"{'512-token miss chunk + ' if miss else ''}{k} hit(s): measured {measured * 1e3:6.1f} ms, "
                      f"model {model(chunks) * 1e3:6.1f} ms, ratio {measured / model(chunks):.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "engine": "max_num_batched_tokens 1024, "
                                               "long_prefill_chunk 512, 1 torch thread"}, indent=1) + "\n")


if __name__ == "__main__":
    main()
