"""The 2-worker validation on bench routing runs that are not the calibration's reference (a held-out seed).

Builds a reference from the files given, as ``routing_reference`` does, without writing the
calibration file, and runs the validation (``validation.run_validation``) against it with the
committed cpu profile: kv-aware / round-robin ratios on both sides and each policy's figures,
and the cores the other tenants took during each real run.

Usage: PYTHONPATH=. python benchmarks/probes/validation_holdout.py routing-*.json
"""

import sys

from services.sim.profiles import load_profile
from services.sim.routing_reference import load_runs, reference
from services.sim.validation import run_validation

ref = reference(load_runs(sys.argv[1:]), 2)
out = run_validation(load_profile("cpu"), ref)
print(f"seeds {out['seeds']} ({ref['source']})")
for k, v in out["ratios_kv_over_rr"].items():
    print(k, "sim", v["sim"]["mean"], "real", v["real"]["mean"], "err", v["error"])
for p, f in out["per_policy"].items():
    print(p, {k: (x["sim"], x["real"], x["error"]) for k, x in f.items()})
for p, r in ref["repeats"][0]["policies"].items():
    print(p, "other_cores", r["other_cores"])
