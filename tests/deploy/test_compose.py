"""compose.yaml: valid against the Compose specification, and the stack the issue asks for."""

from __future__ import annotations

import pytest
import yaml

from tests.deploy.deploy_files import COMPOSE, ROOT, run, tool


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_validates_against_the_compose_spec_schema(tmp_path):
    checker = tool("check-jsonschema")
    ok = run(checker, "--builtin-schema", "vendor.compose-spec", str(COMPOSE))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "compose.yaml"  # the check catches a mistake (a misspelt key)
    broken.write_text(COMPOSE.read_text().replace("stop_grace_period:", "stop_grace_periode:", 1))
    assert run(checker, "--builtin-schema", "vendor.compose-spec", str(broken)).returncode != 0


def test_docker_compose_1_29_reads_it_with_every_profile():
    result = run(tool("docker-compose"), "-f", str(COMPOSE), "--profile", "gpu", "--profile", "observability",
                 "config", "--services", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == {"redis", "prefill", "decode", "router", "gateway", "prefill-gpu",
                                          "decode-gpu", "otel-collector", "jaeger", "prometheus", "grafana"}


def _default(compose: dict) -> dict:
    return {name: s for name, s in compose["services"].items() if not s.get("profiles")}


def test_only_the_gateway_http_and_the_router_grpc_are_published(compose):
    published = {name: s["ports"] for name, s in _default(compose).items() if s.get("ports")}
    assert published == {"router": ["${PDSERVE_ROUTER_GRPC_PORT:-50051}:50051"],
                         "gateway": ["${PDSERVE_HTTP_PORT:-8000}:8000"]}
    # workers must scale: no fixed host ports, no container names
    for role in ("prefill", "decode"):
        assert "ports" not in compose["services"][role] and "container_name" not in compose["services"][role]


def test_redis_is_durable_and_never_evicts(compose):
    redis = compose["services"]["redis"]
    command = " ".join(redis["command"])
    for setting in ("--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction"):
        assert setting in command
    assert redis["volumes"] == ["redis-data:/data"] and "redis-data" in compose["volumes"]
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_services_wait_for_healthy_dependencies_restart_and_drain(compose):
    for name, service in _default(compose).items():
        assert service["restart"] == "unless-stopped", name
        assert "healthcheck" in service, name
        if name == "redis":
            continue
        assert service["depends_on"]["redis"] == {"condition": "service_healthy"}, name
        assert service["stop_grace_period"] == "45s", name
        assert service["image"] == "${PDSERVE_IMAGE:-pdserve:cpu}", name
    assert compose["services"]["gateway"]["depends_on"]["router"] == {"condition": "service_healthy"}


def test_gpu_profile_reserves_nvidia_gpus_for_the_cuda_image(compose):
    for name in ("prefill-gpu", "decode-gpu"):
        service = compose["services"][name]
        assert service["profiles"] == ["gpu"] and service["build"]["args"]["VARIANT"] == "cuda"
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert service["environment"]["PDSERVE_DEVICE"] == "cuda"


def test_observability_profile_mounts_the_shared_dashboard_rules_and_collector_config(compose):
    services = compose["services"]
    assert {n for n, s in services.items() if s.get("profiles") == ["observability"]} == \
        {"otel-collector", "jaeger", "prometheus", "grafana"}
    mounts = [v.split(":")[0] for n in ("prometheus", "grafana", "otel-collector") for v in services[n]["volumes"]]
    for path in ("./deploy/prometheus", "./deploy/grafana/dashboards", "./deploy/grafana/provisioning",
                 "./deploy/otel/collector.yaml"):
        assert path in mounts and (ROOT / path).exists(), path


def test_healthchecks_probe_each_services_own_health_endpoint(compose):
    services = compose["services"]
    for name in ("prefill", "decode", "router", "prefill-gpu", "decode-gpu"):
        port = services[name]["environment"]["PDSERVE_PORT"]
        assert services[name]["healthcheck"]["test"][1:5] == ["pdserve", "probe", "grpc", f"127.0.0.1:{port}"], name
    gateway = services["gateway"]
    assert gateway["healthcheck"]["test"][1:5] == \
        ["pdserve", "probe", "http", f"http://127.0.0.1:{gateway['environment']['PDSERVE_PORT']}/health/ready"]
