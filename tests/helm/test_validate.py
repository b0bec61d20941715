"""The rendered objects checked against what would judge them in a cluster: Kubernetes' own schemas
for core kinds, KubeRay's CRD schemas and admission rules, Ray Serve's config schema, and the
application the config builds."""

from __future__ import annotations

import copy
import importlib
import math

import kubernetes_validate
import pytest
from ray.serve.schema import ServeDeploySchema

from dflash_serve.services.app import app_from_config, build_app
from dflash_serve.services.config import EngineConfig, ServeConfig
from tests.helm.chart import chart_values, render
from tests.helm.kube_schemas import KUBERAY_CRDS, crd_errors

# The chart's kubeVersion floor and the newest release kubernetes-validate knows.
KUBE_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
CORE_KINDS = {"ConfigMap", "Service", "PersistentVolumeClaim", "Pod", "PodDisruptionBudget", "NetworkPolicy", "Ingress"}
# Checked against their CRDs below (RayService) or field by field in test_render (monitors, Gateway API)
# and test_prometheus_rule.
CUSTOM_KINDS = {"RayService", "PodMonitor", "ServiceMonitor", "Gateway", "HTTPRoute", "GRPCRoute", "PrometheusRule"}

needs_crds = pytest.mark.skipif(
    not KUBERAY_CRDS.is_dir(),
    reason=f"KubeRay CRD schemas not found in {KUBERAY_CRDS} (../shared/k8s/ beside the repository): "
           "RayService and RayCluster schema validation skipped")


def test_core_kinds_are_valid_kubernetes_objects(rendered):
    kinds = {obj["kind"] for obj in rendered.objects}
    assert kinds <= CORE_KINDS | CUSTOM_KINDS, f"no validation for {kinds - CORE_KINDS - CUSTOM_KINDS}"
    objects = [obj for obj in rendered.objects if obj["kind"] in CORE_KINDS] + rendered.pods()
    for obj in objects:
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{obj['kind']} {obj['metadata']['name']} on Kubernetes {version}: "
                            f"{err.message} at {'.'.join(map(str, err.absolute_path))}")


@needs_crds
def test_rayservice_matches_kuberays_crd(rendered):
    assert crd_errors(rendered.rayservice) == []


@needs_crds
def test_its_cluster_spec_matches_kuberays_raycluster_crd(rendered):
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
               "metadata": {"name": rendered.rayservice["metadata"]["name"]}, "spec": rendered.cluster}
    assert crd_errors(cluster) == []


@needs_crds
def test_the_crd_check_catches_misspelt_and_mistyped_fields():
    service = copy.deepcopy(render({}).rayservice)
    cluster = service["spec"]["rayClusterConfig"]
    cluster["workerGroupSpecs"][0]["replica"] = 1
    cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "6379"
    errors = crd_errors(service)
    assert any("'replica' was unexpected" in e for e in errors), errors
    assert any(e.startswith("spec.rayClusterConfig.headGroupSpec.template.spec.containers.0.ports.0.containerPort")
               for e in errors), errors


def test_kuberays_admission_rules_hold(rendered):
    """What KubeRay's operator checks before it builds anything (ray-operator utils/validation.go)."""
    spec = rendered.rayservice["spec"]
    assert spec["upgradeStrategy"]["type"] in {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}
    cluster = spec["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        # Resources come from the containers' limits, never from both places.
        assert "resources" not in group
        assert group["template"]["spec"]["containers"], "each group needs its Ray container first"
    for group in cluster["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    # KubeRay makes the serve Service from the head container's `serve` port.
    head_ports = {p["name"] for p in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert "serve" in head_ports


def unknown_keys(given, parsed, path: str = "") -> list[str]:
    """Keys of the given config that the parsed model dropped: Ray's schema ignores unknown keys."""
    if isinstance(given, dict) and isinstance(parsed, dict):
        return [found for key, value in given.items()
                for found in (unknown_keys(value, parsed[key], f"{path}{key}.") if key in parsed else [path + key])]
    if isinstance(given, list) and isinstance(parsed, list):
        return [found for i, (g, p) in enumerate(zip(given, parsed, strict=True))
                for found in unknown_keys(g, p, f"{path}{i}.")]
    return []


def test_serve_config_matches_rays_schema_with_no_unknown_keys(rendered):
    config = rendered.serve_config
    parsed = ServeDeploySchema.model_validate(config)
    assert unknown_keys(config, parsed.model_dump(exclude_unset=True)) == []


def test_the_unknown_key_check_catches_what_rays_schema_lets_through():
    config = render({}).serve_config
    config["grpc_options"]["grpc_servicer_functionz"] = []
    config["applications"][0]["max_ongoing_requestz"] = 5
    parsed = ServeDeploySchema.model_validate(config)  # accepted by Ray
    assert unknown_keys(config, parsed.model_dump(exclude_unset=True)) == [
        "grpc_options.grpc_servicer_functionz", "applications.0.max_ongoing_requestz"]


def import_attr(path: str):
    module, _, attr = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), attr)


def test_everything_serve_imports_exists(rendered):
    """The controller imports the app and every proxy the servicer functions, from the image."""
    config = rendered.serve_config
    for path in [config["applications"][0]["import_path"], *config["grpc_options"]["grpc_servicer_functions"]]:
        assert callable(import_attr(path)), path


def cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def test_the_app_builds_from_the_rendered_config_and_fits_the_gpu_workers(rendered, values):
    router = app_from_config(rendered.app["args"])._bound_deployment  # Ray 2.60's Application (ray is pinned)
    verifier = router.init_args[0]._bound_deployment
    assert (router.name, verifier.name) == ("Router", "Verifier")

    bundles = verifier._replica_config.placement_group_bundles or [verifier.ray_actor_options]
    replica_gpus = sum(b.get("GPU", b.get("num_gpus", 0)) for b in bundles)
    replica_cpus = sum(b.get("CPU", b.get("num_cpus", 0)) for b in bundles)
    workers = chart_values(values)["gpuWorkers"]
    pod_gpus = int(rendered.worker_group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert 0 < replica_gpus <= pod_gpus, "a verifier replica and its drafter share one pod"
    per_pod = min(math.floor(pod_gpus / replica_gpus),
                  math.floor(cpus(workers["resources"]["limits"]["cpu"]) / replica_cpus))
    autoscaling = verifier._deployment_config.autoscaling_config
    low, high = ((autoscaling.min_replicas, autoscaling.max_replicas) if autoscaling
                 else (verifier.num_replicas, verifier.num_replicas))
    pods = max(workers["replicas"], workers["maxReplicas"])
    assert low <= per_pod * workers["replicas"] and high <= per_pod * pods, (
        f"{low}..{high} verifier replicas of {replica_gpus} GPU do not fit {workers['replicas']}..{pods} "
        f"pods of {pod_gpus} GPUs")


def test_replica_bounds_become_serve_autoscaling_aimed_at_a_full_batch(tmp_path, monkeypatch):
    config = ServeConfig(engine=EngineConfig(target="t", drafter="d", max_num_seqs=48), num_replicas=2,
                         max_replicas=6, router_replicas=2, router_max_replicas=3, max_pending=300)
    router = build_app(config)._bound_deployment
    verifier = router.init_args[0]._bound_deployment
    scaling = verifier._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (2, 2, 6)
    assert scaling.target_ongoing_requests == 48  # a replica's running batch is full
    scaling = router._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (2, 3, 150)
    fixed = build_app(ServeConfig(engine=EngineConfig(target="t", drafter="d"), num_replicas=3))._bound_deployment
    assert fixed._deployment_config.autoscaling_config is None and fixed.num_replicas == 1
    assert fixed.init_args[0]._bound_deployment.num_replicas == 3
    with pytest.raises(ValueError, match="max_replicas=2 is below num_replicas=3"):
        ServeConfig(engine=EngineConfig(target="t", drafter="d"), num_replicas=3, max_replicas=2)
