"""docs/troubleshooting.md names only metrics the services export: a runbook that sends an operator to a
series that does not exist is worse than none."""

from __future__ import annotations

import re
from pathlib import Path

RUNBOOK = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"


def exported_series() -> set[str]:
    """Every series name the gateway's, router's and workers' metric modules can produce."""
    from prometheus_client import REGISTRY

    import services.gateway.http_metrics  # noqa: F401  (each defines its metrics on import)
    import services.gateway.metrics  # noqa: F401
    import services.telemetry  # noqa: F401

    names = set()
    for family in REGISTRY.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_count", "_sum"))
    return names


def test_every_metric_the_runbook_names_is_exported():
    named = set(re.findall(r"\bpdserve_[a-z0-9_]+", RUNBOOK.read_text()))
    assert len(named) > 15  # the runbook's five symptoms lean on the metrics
    assert sorted(named - exported_series()) == []


def test_a_misspelled_metric_would_be_caught():
    assert "pdserve_kv_block_used" not in exported_series()
    assert "pdserve_kv_blocks_used" in exported_series()
