"""The dashboard, the alert rules and the KEDA triggers: every query parses, the dashboard is sound,
and promtool checks and unit-tests the rules."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.deploy.deploy_files import (DASHBOARDS, DEPLOY, RULE_FILES, RULE_TESTS, all_queries, dashboard_queries,
                                       metric_names, run, tool)


def test_every_query_parses_with_prometheus_own_parser(tmp_path):
    queries = all_queries()
    assert len(queries) > 30
    for q in queries:
        metric_names(q.expr)  # promql-parser: raises on a syntax error
    # promtool parses every expression of a rule file: the dashboard's and KEDA's as recording rules
    rules = {"groups": [{"name": "queries", "rules": [{"record": f"q_{i}", "expr": q.expr}
                                                      for i, q in enumerate(queries)]}]}
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run(tool("promtool"), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_query_is_caught(tmp_path):
    with pytest.raises(ValueError):
        metric_names("sum(rate(pdserve_ttft_seconds_bucket[1m])")  # unbalanced
    with pytest.raises(ValueError, match="no metric name"):
        metric_names('sum({__name__=~"pdserve_.*"})')
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "r", "expr": "sum(x"}]}]}))
    assert run(tool("promtool"), "check", "rules", str(path)).returncode != 0


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_loads_and_every_panel_has_a_datasource_and_a_query(path):
    dashboard = json.loads(path.read_text())  # merge-conflict markers or a stray comma fail here
    assert dashboard["uid"] and dashboard["title"]
    assert [v["name"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == panel["datasource"], panel["title"]
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]


def test_dashboard_covers_what_a_serving_team_watches():
    text = " ".join(q.expr for d in DASHBOARDS for q in dashboard_queries(d))
    for metric in ("pdserve_ttft_seconds_bucket", "pdserve_inter_token_latency_seconds_bucket",
                   "pdserve_generation_tokens_total", "pdserve_queue_depth", "pdserve_queue_lag",
                   "pdserve_dead_letters_total", "pdserve_kv_blocks_used", "pdserve_prefix_cache_hits_total",
                   "pdserve_kv_transfer_seconds_bucket", "pdserve_kv_transfer_bytes_total",
                   "pdserve_http_requests_total"):
        assert metric in text, metric


def test_promtool_checks_and_unit_tests_the_alert_rules():
    promtool = tool("promtool")
    for path in RULE_FILES:
        checked = run(promtool, "check", "rules", str(path))
        assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run(promtool, "test", "rules", str(RULE_TESTS), cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    config = run(promtool, "check", "config", "--syntax-only", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr


def test_the_rule_tests_fail_when_a_threshold_drifts(tmp_path):
    (tmp_path / "alerts.yml").write_text(RULE_FILES[0].read_text().replace("[5m]))) > 2", "[5m]))) > 10"))
    (tmp_path / "alerts_test.yml").write_text(RULE_TESTS.read_text())
    result = run(tool("promtool"), "test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert result.returncode != 0 and "PdserveTTFTHigh" in result.stdout + result.stderr
