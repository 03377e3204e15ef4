"""deploy/k8s: every overlay renders, every object validates against the Kubernetes schemas (strict:
unknown fields are errors) and the KEDA ScaledObjects against KEDA's CRD models; what the issue asks
of each object holds; the dashboard and rule ConfigMaps are the compose files, byte for byte.

Static only: no cluster runs here (a kind cluster needs its node image from a registry)."""

from __future__ import annotations

import copy
import json

import pytest

from tests.deploy.deploy_files import DASHBOARDS, DEPLOY, OVERLAYS, rendered

KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")  # the oldest with everything used here (native gRPC probes GA: 1.27)


def _by_kind(objs, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def _validate(obj: dict, version: str) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay, version):
    objs = rendered(overlay)
    builtin = [o for o in objs if not o["apiVersion"].startswith("keda.sh/")]
    assert len(builtin) >= 20
    for obj in builtin:
        _validate(obj, version)


def test_validation_catches_a_broken_object():
    import kubernetes_validate

    deployment = copy.deepcopy(_by_kind(rendered("cpu"), "Deployment")["decode"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}  # misspelt: strict refuses
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment, KUBERNETES_VERSIONS[-1])


def _keda_roundtrip(obj: dict) -> dict:
    """The object through KEDA's CRD models (cloudcoil-models-keda, generated from KEDA's CRDs): types
    are checked, and a field the CRD lacks is dropped, so the round trip differs from the input."""
    from cloudcoil.models.keda.v1alpha1 import ScaledObject

    return ScaledObject.model_validate(obj).model_dump(mode="json", by_alias=True, exclude_unset=True)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_scaled_objects_validate_against_kedas_crd(overlay):
    scaled = _by_kind(rendered(overlay), "ScaledObject")
    assert set(scaled) == {"prefill", "decode", "gateway"}
    for obj in scaled.values():
        assert _keda_roundtrip(obj) == obj
    broken = copy.deepcopy(scaled["decode"])
    broken["spec"]["minReplicas"] = 1  # HPA's name, not KEDA's
    assert _keda_roundtrip(broken) != broken


def test_autoscalers_watch_what_limits_each_role():
    scaled = _by_kind(rendered("cpu"), "ScaledObject")
    prefill = scaled["prefill"]["spec"]
    assert prefill["minReplicaCount"] == 0  # scales to zero and back on the queue
    assert {t["metadata"]["stream"] for t in prefill["triggers"]} == \
        {"pd:{q}:req:interactive", "pd:{q}:req:standard", "pd:{q}:req:batch"}
    for trigger in prefill["triggers"]:
        assert trigger["type"] == "redis-streams" and trigger["metadata"]["consumerGroup"] == "routers"
        assert {"lagCount", "activationLagCount"} <= set(trigger["metadata"])
    decode = scaled["decode"]["spec"]
    assert decode["minReplicaCount"] >= 1 and all(t["type"] == "prometheus" for t in decode["triggers"])
    queries = " ".join(t["metadata"]["query"] for t in decode["triggers"])
    assert "pdserve_kv_blocks_used" in queries and "pdserve_num_running" in queries
    assert "pdserve_http_requests_total" in scaled["gateway"]["spec"]["triggers"][0]["metadata"]["query"]
    for obj in scaled.values():  # no flapping: scale-in is stabilized
        down = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= 300


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_pods_probe_drain_and_run_locked_down(overlay):
    objs = rendered(overlay)
    deployments = _by_kind(objs, "Deployment")
    assert {"prefill", "decode", "router", "gateway"} <= set(deployments)
    for name in ("prefill", "decode", "router", "gateway"):
        pod = deployments[name]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
        assert pod["serviceAccountName"] == "pdserve" and pod["automountServiceAccountToken"] is False
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
        assert pod["terminationGracePeriodSeconds"] > 30  # longer than the 30 s drain
        kind = "httpGet" if name == "gateway" else "grpc"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert kind in container[probe], (name, probe)
        assert container["args"] == [name]
    for name in ("router", "gateway"):  # behind a Service: wait for endpoint removal before stopping
        assert "preStop" in deployments[name]["spec"]["template"]["spec"]["containers"][0]["lifecycle"]
    services = _by_kind(objs, "Service")
    for name in ("prefill-metrics", "decode-metrics", "redis"):
        assert services[name]["spec"]["clusterIP"] == "None"  # addressed pod by pod
    assert set(_by_kind(objs, "PodDisruptionBudget")) == {"prefill", "decode", "router", "gateway"}
    (sa,) = [o for o in objs if o["kind"] == "ServiceAccount"]
    assert sa["automountServiceAccountToken"] is False
    assert not [o for o in objs if o["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]


def test_redis_statefulset_persists_like_compose():
    redis = _by_kind(rendered("cpu"), "StatefulSet")["redis"]
    args = " ".join(redis["spec"]["template"]["spec"]["containers"][0]["args"])
    for setting in ("--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction"):
        assert setting in args
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]


def test_gpu_overlay_requests_gpus_on_gpu_nodes_with_the_cuda_image():
    deployments = _by_kind(rendered("gpu"), "Deployment")
    for name in ("prefill", "decode"):
        pod = deployments[name]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["image"] == "pdserve:cuda"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert {"name": "PDSERVE_DEVICE", "value": "cuda"} in container["env"]
    assert deployments["gateway"]["spec"]["template"]["spec"]["containers"][0]["image"] == "pdserve:cuda"
    assert _by_kind(rendered("cpu"), "Deployment")["decode"]["spec"]["template"]["spec"]["containers"][0]["image"] \
        == "pdserve:cpu"
    # pods share no namespaces: TCP (measured 2x UCX between containers); on GPUs UCX moves CUDA memory itself
    transport = {o: next(cm for cm in rendered(o) if cm["kind"] == "ConfigMap" and cm["metadata"]["name"]
                         .startswith("pdserve-config-"))["data"]["PDSERVE_TRANSPORT"] for o in ("cpu", "gpu")}
    assert transport == {"cpu": "tcp", "gpu": "ucx"}


def test_dashboard_and_rules_configmaps_are_the_compose_files():
    configmaps = {name.rsplit("-", 1)[0]: cm for name, cm in _by_kind(rendered("cpu"), "ConfigMap").items()}
    dashboard = configmaps["pdserve-grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["pdserve.json"] == DASHBOARDS[0].read_text()
    json.loads(dashboard["data"]["pdserve.json"])
    prometheus = configmaps["prometheus-config"]["data"]
    assert prometheus["alerts.yml"] == (DEPLOY / "prometheus" / "alerts.yml").read_text()
    assert prometheus["prometheus.yml"] == (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    volumes = _by_kind(rendered("cpu"), "Deployment")["prometheus"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": _full_name("prometheus-config")}} in volumes


def _full_name(prefix: str) -> str:
    (name,) = [n for n in _by_kind(rendered("cpu"), "ConfigMap") if n.startswith(prefix + "-")]
    return name
