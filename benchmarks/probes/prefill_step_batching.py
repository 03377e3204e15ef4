"""Is a prefill's fixed cost paid per engine step or per prompt?

The simulator's measured GPU profiles fit ``base + per_token * n + per_token_context * n * ctx`` to
prefills timed one request per step (services/sim/calibrate.py). On the lent H100 the base was ~27 ms
(pdserve's prefill forward runs eagerly: host-bound kernel launches), so whether k short prompts in one
step cost one base or k bases decides a prefill worker's capacity for short (cached-prefix) prompts.
This times one engine step that prefills k fresh prompts of n tokens together (k = 1, 2, 4, 8), the
engine configured as the calibration configures it, and prints each step's time beside k x the
single prompt's. JSON lines on stdout; a summary on stderr.

    python benchmarks/probes/prefill_step_batching.py                       # CPU, the default model
    python benchmarks/probes/prefill_step_batching.py --device cuda --model dummy:llama-3.1-8b
"""

import argparse
import json
import random
import statistics
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None)
    p.add_argument("--sizes", default="16,256", help="prompt lengths, comma-separated")
    p.add_argument("--ks", default="1,2,4,8", help="prompts per step, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    import torch

    from services.engine.sampling_params import SamplingParams
    from services.sim.calibrate import GRIDS, calibration_engine

    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    step_tokens = GRIDS[kind][2]
    clock = time.perf_counter if kind == "cuda" else time.process_time
    torch.set_num_threads(1)
    started = time.perf_counter()
    engine = calibration_engine(args.model, args.device)
    print(f"[probe] engine start {time.perf_counter() - started:.1f} s ({engine.model_name}, {args.device})",
          file=sys.stderr, flush=True)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    once = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    serial = 0

    def step_of(k: int, n: int) -> float:
        """One engine step prefilling k fresh prompts of n tokens (their first token sampled in it)."""
        nonlocal serial
        ids = []
        for _ in range(k):
            serial += 1
            ids.append(f"r{serial}")
            engine.add_request(ids[-1], [rng.randrange(100, vocab - 100) for _ in range(n)], once)
        t = clock()
        engine.step()
        took = clock() - t
        if engine.has_unfinished():
            raise SystemExit(f"{k} prompts of {n} tokens did not finish in one step (step budget {step_tokens})")
        return took

    with torch.inference_mode():
        step_of(1, 256)  # warm-up
        for n in (int(x) for x in args.sizes.split(",")):
            single = None
            for k in (int(x) for x in args.ks.split(",")):
                times = [step_of(k, n) for _ in range(args.repeats)]
                median = statistics.median(times)
                single = single if single is not None else median
                row = {"prompt_tokens": n, "prompts_per_step": k, "step_s_median": median, "step_s": times,
                       "k_times_single_s": k * single, "step_over_k_single": median / (k * single)}
                print(json.dumps(row), flush=True)
                print(f"[probe] {k} x {n} tokens in one step: {median * 1e3:7.1f} ms "
                      f"(k x one prompt's step: {k * single * 1e3:7.1f} ms, ratio {median / (k * single):.2f})",
                      file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
