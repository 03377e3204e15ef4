"""What the deployment checks share: where the files are, the external tools, rendering the
Kubernetes overlays, and every PromQL query the deployment runs (dashboard, alert rules, KEDA).

Issue 26 and later dashboards add their queries by adding files to ``DASHBOARDS`` / ``RULE_FILES``;
the metric-name check (test_stack_metrics.py) then covers them too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "compose.yaml"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
RULE_FILES = [DEPLOY / "prometheus" / "alerts.yml"]
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
OVERLAYS = {"cpu": DEPLOY / "k8s" / "overlays" / "cpu", "gpu": DEPLOY / "k8s" / "overlays" / "gpu"}
# Grafana's variables, replaced by what Grafana would put there before a query reaches Prometheus
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h"}


def tool(name: str) -> str:
    """The path of an external tool (scripts/install-deploy-tools.sh installs them). Missing: a loud skip,
    or a failure where PDSERVE_REQUIRE_DEPLOY_TOOLS is set (CI: a check that did not run is no pass)."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (run scripts/install-deploy-tools.sh); this deployment check did not run"
        if os.environ.get("PDSERVE_REQUIRE_DEPLOY_TOOLS"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def run(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=300)


@lru_cache(maxsize=None)
def rendered(overlay: str) -> tuple[dict, ...]:
    """``kubectl kustomize`` of an overlay, as a tuple of objects."""
    result = run(tool("kubectl"), "kustomize", str(OVERLAYS[overlay]))
    assert result.returncode == 0, f"kustomize failed for {overlay}:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


@dataclass(frozen=True)
class Query:
    source: str  # where it is, for the failure message
    expr: str  # as Prometheus receives it (Grafana variables replaced)


def dashboard_queries(path: Path) -> list[Query]:
    out = []
    for panel in json.loads(path.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            out.append(Query(f"{path.name}: panel {panel['title']!r} {target.get('refId')}", expr))
    return out


def rule_queries(path: Path) -> list[Query]:
    return [Query(f"{path.name}: {rule.get('alert') or rule.get('record')}", rule["expr"])
            for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def keda_queries(overlay: str = "cpu") -> list[Query]:
    return [Query(f"ScaledObject {obj['metadata']['name']} trigger {i}", trigger["metadata"]["query"])
            for obj in rendered(overlay) if obj["kind"] == "ScaledObject"
            for i, trigger in enumerate(obj["spec"]["triggers"]) if trigger["type"] == "prometheus"]


def all_queries() -> list[Query]:
    return ([q for d in DASHBOARDS for q in dashboard_queries(d)] + [q for f in RULE_FILES for q in rule_queries(f)]
            + keda_queries())


def metric_names(expr: str) -> set[str]:
    """Every metric a PromQL expression selects (parsed, not grepped). A selector without a literal
    metric name ({__name__=~...}) is refused: no check could tell what it reads."""
    import promql_parser

    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            if not node.name:
                raise ValueError(f"selector {node} has no metric name")
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def exposition_names(text: str) -> set[str]:
    """Every series name a /metrics page can produce: its samples, and for declared families without
    samples yet (a labelled counter nothing incremented) the names their type implies."""
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("_sum", "_count", "_created"), "gauge": ("",), "unknown": ("",), "info": ("_info",)}
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    return {n for n in names if _NAME.match(n)}
