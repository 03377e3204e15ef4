"""``--save``: every bench's result file says where, when and with what it was measured."""

import argparse
import json
import math

from services.bench import results
from services.bench.stats import percentile, ratio
from services.cli import build_parser


def test_saved_result_names_machine_versions_commit_and_keeps_the_result(tmp_path):
    args = argparse.Namespace(save=str(tmp_path))
    path = results.save("demo", {"ratio": 1.5, "rows": [1, 2]}, args)
    doc = json.loads(path.read_text())
    assert path.name.startswith("demo-") and path.suffix == ".json"
    assert doc["bench"] == "demo" and doc["result"] == {"ratio": 1.5, "rows": [1, 2]}
    assert doc["machine"]["cpus"] >= 1 and doc["machine"]["cpu_model"]
    assert "python" in doc["versions"] and "torch" in doc["versions"]
    assert doc["date"].endswith("+00:00")
    assert doc["commit"] is None or len(doc["commit"].split("-")[0]) == 12


def test_without_save_nothing_is_written(tmp_path):
    assert results.save("demo", {}, argparse.Namespace(save=None)) is None
    assert list(tmp_path.iterdir()) == []


def test_every_bench_command_takes_save():
    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._actions
                 if isinstance(a, argparse._SubParsersAction))
    for name, sub in bench.choices.items():
        ns = sub.parse_known_args(["--save"])[0]
        assert ns.save == str(results.DEFAULT_DIR), name


def test_percentile_interpolates_and_ratio_refuses_nonsense():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert math.isnan(percentile([], 50))
    assert ratio(3, 2) == 1.5 and ratio(1, 0) is None and ratio(None, 1) is None and ratio(math.nan, 1) is None


def test_a_bootstrap_interval_holds_the_mean_and_narrows_with_agreeing_values():
    from services.bench.stats import bootstrap_interval, mean

    spread = [0.10, 0.30, 0.15, 0.25, 0.20, 0.12]
    lo, hi = bootstrap_interval(spread)
    assert min(spread) <= lo < mean(spread) < hi <= max(spread)
    assert bootstrap_interval(spread) == (lo, hi)  # seeded: the same report twice
    tight = bootstrap_interval([0.20, 0.21, 0.19, 0.20, 0.21, 0.19])
    assert tight[1] - tight[0] < (hi - lo) / 5
    assert all(math.isnan(x) for x in bootstrap_interval([0.2]))  # one value: no spread to show
