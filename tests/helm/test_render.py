"""The chart, linted and rendered by the real Helm engine for the default values and every values
file in helm/dflash-serve/examples/: the objects it makes and the fields operators rely on."""

from __future__ import annotations

import json
import re
import shlex
import tomllib

import helm_python
import pytest
from google.protobuf import json_format

from dflash_serve.services.api.dflash.v1 import generation_pb2
from dflash_serve.services.app import GRPC_SERVICER_FUNCTIONS, SERVE_ENV
from dflash_serve.services.config import ROUTER_SETTINGS, ServeConfig
from tests.helm.chart import (
    CHART,
    NAMESPACE,
    REPO,
    chart_values,
    load_chart,
    project_requirements,
    render,
    scenario_values,
)


DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def containers(rendered):
    return {group: template["spec"]["containers"][0] for group, template in rendered.pod_templates().items()}


def env(container) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_lint_is_clean(values):
    report = helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not report["errors"] and not problems, report


def test_renders_a_rayservice_with_new_cluster_upgrades(rendered):
    service = rendered.rayservice
    assert service["apiVersion"] == "ray.io/v1"
    assert service["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    assert service["metadata"]["namespace"] == NAMESPACE


def test_ray_version_is_the_one_pyproject_pins(rendered):
    assert str(project_requirements()["ray"].specifier) == f"=={rendered.cluster['rayVersion']}"


def test_the_image_tag_defaults_to_the_projects_version():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    with load_chart() as chart:
        assert chart.metadata["appVersion"] == version
    image = render({}).pod_templates()["head"]["spec"]["containers"][0]["image"]
    assert image == f"dflash-serve:{version}"


def test_serve_config_runs_the_app_and_the_grpc_services_of_services_app(rendered, values):
    ports = chart_values(values)["ports"]
    serve = rendered.serve_config
    assert serve["grpc_options"]["grpc_servicer_functions"] == GRPC_SERVICER_FUNCTIONS
    assert serve["grpc_options"]["port"] == ports["grpc"]
    assert serve["http_options"]["port"] == ports["http"]
    assert rendered.app["import_path"] == "dflash_serve.services.app:app_from_config"


def test_every_ray_pod_runs_serve_with_the_settings_dflash_serve_starts_ray_with(rendered):
    """Serve reads them in each process at import: the head's controller and proxy and the
    workers' replicas all need them, as `dflash serve` gives them to the Ray it starts."""
    for group, container in containers(rendered).items():
        variables = env(container)
        assert {name: variables.get(name) for name in SERVE_ENV} == SERVE_ENV, group


def test_the_config_is_the_users_block_plus_the_ports_and_serves_ingress(rendered, values):
    """Serve's proxies are the chart's ingress: KubeRay's serve Service and readiness use them."""
    merged = chart_values(values)
    expected = {**merged["dflash"], "grpc_port": merged["ports"]["grpc"], "http_port": merged["ports"]["http"],
                "metrics_port": merged["ports"]["metrics"], "ingress": "serve"}
    if merged["apiKeys"]["secretName"]:
        expected["api_keys_file"] = "/etc/dflash-keys/keys"
    assert rendered.dflash_config == expected
    assert not set(ROUTER_SETTINGS) & set(rendered.app["args"])  # those go to the Router's user_config
    # Nothing is defaulted on the way: a key the user did not set is in neither place.
    assert render({}).dflash_config.keys() == {"engine", "grpc_port", "http_port", "metrics_port", "ingress"}


def test_the_config_is_a_valid_serve_config(rendered):
    config = ServeConfig.from_dict(rendered.dflash_config)  # strict: unknown keys and bad values raise
    assert config.engine.device == "cuda"


def test_no_pod_carries_the_config(rendered):
    """The config lives in serveConfigV2 alone: no ConfigMap, file or checksum annotation, so a
    config-only change is no pod template change."""
    assert not [o for o in rendered.objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-config")]
    for group, template in rendered.pod_templates().items():
        assert not [k for k in template["metadata"].get("annotations", {}) if k.startswith("checksum/")], group
        assert "DFLASH_CONFIG" not in env(template["spec"]["containers"][0]), group


def _code_version(rendered) -> str:
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    return get_app_code_version(ServeApplicationSchema.model_validate(rendered.app))


def test_a_router_setting_changes_serve_config_only_and_keeps_the_apps_code_version():
    """KubeRay applies a changed serveConfigV2 to the running cluster (the pod templates are
    unchanged); Serve restarts replicas only when the application's code version, a hash of its
    import path and args (Ray 2.60's get_app_code_version), changes."""
    base = render({})
    routers = render({"dflash": {"max_pending": 64, "default_max_tokens": 100}})
    engine = render({"dflash": {"engine": {"max_num_seqs": 8}}})
    for changed in (routers, engine):
        assert changed.cluster == base.cluster
        assert changed.serve_config != base.serve_config
    assert _code_version(routers) == _code_version(base)
    assert _code_version(engine) != _code_version(base)


def test_pinned_revisions_reach_the_server_and_a_new_pin_reloads_the_models():
    """engine.target_revision / drafter_revision pass through to the server's config; a changed pin
    changes the application's code version, so Serve restarts the replicas, which load that commit."""
    base = render({})
    pinned = render({"dflash": {"engine": {"target_revision": "abc123", "drafter_revision": "v2"}}})
    engine = pinned.dflash_config["engine"]
    assert (engine["target_revision"], engine["drafter_revision"]) == ("abc123", "v2")
    assert ServeConfig.from_dict(pinned.dflash_config).engine.drafter_revision == "v2"
    assert pinned.cluster == base.cluster
    assert _code_version(pinned) != _code_version(base)
    repinned = render({"dflash": {"engine": {"target_revision": "abc123", "drafter_revision": "v3"}}})
    assert _code_version(repinned) != _code_version(pinned)


@pytest.mark.parametrize("model", ["target", "drafter"])
def test_a_revision_for_a_model_folder_is_refused_at_install(model):
    """The server refuses it when the model loads; the chart says so before any pod starts."""
    engine = {model: f"/models/org/{model}", f"{model}_revision": "abc123"}
    with pytest.raises(helm_python.HelmRenderError, match=rf"dflash.engine.{model}_revision is set, but "
                                                          rf"dflash.engine.{model} /models/org/{model} is a folder"):
        render({"dflash": {"engine": engine}})


def test_the_router_overrides_are_what_build_app_derives_from_the_same_config():
    from dflash_serve.services.app import build_app

    rendered = render({"dflash": {"max_pending": 64, "default_max_tokens": 100, "stream_messages_per_s": 500,
                                  "router_replicas": 2, "router_max_replicas": 5}})
    router = build_app(ServeConfig.from_dict(rendered.dflash_config))._bound_deployment
    verifier = router.init_args[0]._bound_deployment
    overrides = rendered.deployment_overrides("Router")
    assert overrides["user_config"] == {"max_pending": 64, "default_max_tokens": 100,
                                        "stream_messages_per_s": 500} == router.user_config
    assert overrides["max_ongoing_requests"] == router.max_ongoing_requests
    built = router._deployment_config.autoscaling_config
    assert overrides["autoscaling_config"] == built.model_dump(include=set(overrides["autoscaling_config"]))
    assert rendered.deployment_overrides("Verifier") == {"name": "Verifier",
                                                         "max_ongoing_requests": verifier.max_ongoing_requests}
    # Without max_pending, the built values stand: nothing but the (empty) user_config is overridden.
    assert render({}).app["deployments"] == [{"name": "Router", "user_config": {}}]


def test_ports_are_named_for_kuberay_and_prometheus(rendered, values):
    ports = chart_values(values)["ports"]
    for group, container in containers(rendered).items():
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert named["serve"] == ports["http"], group
        assert named["serve-grpc"] == ports["grpc"], group
        assert named["metrics"] == ports["metrics"], group
        if group == "head":
            assert named["dashboard"] == ports["dashboard"]
    cluster = rendered.cluster
    for start_params in [cluster["headGroupSpec"]["rayStartParams"], rendered.worker_group["rayStartParams"]]:
        assert start_params["metrics-export-port"] == str(ports["metrics"])
    # The head runs no replicas: routers and verifiers land on the GPU workers.
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_gpu_workers_request_their_gpus_and_land_on_gpu_nodes(rendered, values):
    workers = chart_values(values)["gpuWorkers"]
    group = rendered.worker_group
    assert group["groupName"] == workers["groupName"]
    assert group["replicas"] == group["minReplicas"] == workers["replicas"]
    assert group["maxReplicas"] == max(workers["replicas"], workers["maxReplicas"])
    resources = group["template"]["spec"]["containers"][0]["resources"]
    for kind in ("requests", "limits"):
        assert resources[kind]["nvidia.com/gpu"] == str(workers.get("gpusPerPod") or 1)  # 1: the defaults' replica
        assert resources[kind]["cpu"] == workers["resources"][kind]["cpu"]
    spec = group["template"]["spec"]
    assert spec["tolerations"] == workers["tolerations"]
    assert spec.get("nodeSelector", {}) == workers["nodeSelector"]
    assert spec.get("runtimeClassName", "") == workers["runtimeClassName"]


def test_security_defaults(rendered):
    for group, template in rendered.pod_templates().items():
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] >= 10000
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        container = spec["containers"][0]
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["readOnlyRootFilesystem"] is True
        assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}, "Ray's session dir needs a writable /tmp"
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= container["resources"][kind].keys(), (group, kind)


def models_volume(rendered):
    spec = rendered.worker_group["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "models"]
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "models"]
    return volume, mount, env(spec["containers"][0])


def test_model_storage_from_the_hub_cache_with_a_token_secret():
    rendered = render({"models": {"source": "hf", "hf": {"tokenSecret": {"name": "hf-token"}, "offline": True}}})
    volume, mount, variables = models_volume(rendered)
    claim = rendered.one("PersistentVolumeClaim")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert mount["readOnly"] is False and variables["HF_HOME"] == mount["mountPath"]
    assert variables["HF_HUB_OFFLINE"] == "1"
    # A new pod finds what an earlier one compiled and measured: Triton's kernels, round costs, tokenizer classes.
    assert variables["TRITON_CACHE_DIR"] == f"{mount['mountPath']}/.cache/triton"
    assert variables["DFLASH_CACHE"] == f"{mount['mountPath']}/.cache/dflash-serve"
    # The token is a file, never an environment variable.
    assert "HF_TOKEN" not in variables
    spec = rendered.worker_group["template"]["spec"]
    (secret,) = [v for v in spec["volumes"] if v["name"] == "hf-token"]
    assert secret["secret"] == {"secretName": "hf-token", "items": [{"key": "token", "path": "token"}]}
    (token_mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "hf-token"]
    assert variables["HF_TOKEN_PATH"] == f"{token_mount['mountPath']}/token"


def test_model_storage_from_an_existing_claim():
    rendered = render({"models": {"source": "pvc", "pvc": {"existingClaim": "llm-weights"}}})
    volume, mount, variables = models_volume(rendered)
    assert volume["persistentVolumeClaim"]["claimName"] == "llm-weights"
    assert mount["readOnly"] is True and "HF_HOME" not in variables
    assert "TRITON_CACHE_DIR" not in variables and "DFLASH_CACHE" not in variables  # read-only: HOME's caches
    assert not rendered.all("PersistentVolumeClaim")


def test_model_storage_from_a_host_path():
    rendered = render({"models": {"source": "hostPath", "hostPath": {"path": "/mnt/models"}}})
    volume, mount, _ = models_volume(rendered)
    assert volume["hostPath"] == {"path": "/mnt/models", "type": "Directory"}
    assert mount["readOnly"] is True
    assert not rendered.all("PersistentVolumeClaim")


def test_one_dashboard_config_map_per_dashboard_for_the_grafana_sidecar(rendered, values):
    dashboards = sorted((CHART / "dashboards").glob("*.json"))
    maps = [m for m in rendered.all("ConfigMap") if "-dashboard-" in m["metadata"]["name"]]
    assert len(maps) == len(dashboards) == 3
    namespace = chart_values(values)["grafanaDashboards"]["namespace"] or NAMESPACE
    for config_map, path in zip(sorted(maps, key=lambda m: m["metadata"]["name"]), dashboards, strict=True):
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["namespace"] == namespace
        assert json.loads(config_map["data"][path.name]) == json.loads(path.read_text())


def test_dashboards_can_be_turned_off():
    maps = render({"grafanaDashboards": {"enabled": False}}).all("ConfigMap")
    assert maps == []


def pod_labels(rendered) -> list[dict]:
    return [t["metadata"]["labels"] for t in rendered.pod_templates().values()]


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_no_monitor_unless_asked():
    assert not render({}).all("PodMonitor") and not render({}).all("ServiceMonitor")


def test_pod_monitor_scrapes_every_pods_metrics_port():
    monitor_values = {"enabled": True, "kind": "PodMonitor", "labels": {"release": "prometheus"}}
    rendered = render({"metrics": {"monitor": monitor_values}})
    monitor = rendered.one("PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert all(selects(monitor["spec"]["selector"]["matchLabels"], labels) for labels in pod_labels(rendered))
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    cluster_label = {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"], "targetLabel": "ray_io_cluster"}
    assert cluster_label in endpoint["relabelings"]


def test_service_monitor_goes_through_a_headless_service_over_every_pod():
    rendered = render({"metrics": {"monitor": {"enabled": True, "kind": "ServiceMonitor"}}})
    monitor, service = rendered.one("ServiceMonitor"), rendered.one("Service", "-metrics")
    assert service["spec"]["clusterIP"] == "None"
    assert all(selects(service["spec"]["selector"], labels) for labels in pod_labels(rendered))
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


def test_release_names_become_rayservice_names_kuberay_accepts():
    for release in ["dflash-serve", "prod", "a-very-long-release-name-for-the-speculative-llm-server"]:
        name = render({}, release=release).rayservice["metadata"]["name"]
        assert len(name) <= 47 and DNS_1035.match(name), name


def test_a_target_model_is_required():
    with pytest.raises(helm_python.HelmRenderError, match="dflash.engine.target: name the target model"):
        render({"dflash": {"engine": {"target": ""}}})


def test_notes_give_a_working_grpc_client_example(rendered, values):
    ports = chart_values(values)["ports"]
    name = rendered.rayservice["metadata"]["name"]
    notes = rendered.notes
    assert f"port-forward svc/{name}-serve-svc {ports['grpc']}:{ports['grpc']}" in notes
    (grpcurl,) = [line.strip() for line in notes.splitlines() if line.strip().startswith("grpcurl")]
    args = shlex.split(grpcurl)
    request = json_format.Parse(args[args.index("-d") + 1], generation_pb2.GenerateRequest())
    assert request.prompt and request.sampling.max_tokens > 0
    assert args[-2] == f"127.0.0.1:{ports['grpc']}"
    service, method = args[-1].split("/")
    descriptor = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert service == descriptor.full_name and method in descriptor.methods_by_name
    (client,) = [line.strip() for line in notes.splitlines() if line.strip().startswith("dflash client")]
    assert f"--address 127.0.0.1:{ports['grpc']}" in client


def test_the_head_pod_is_kept_out_of_the_serve_service(rendered):
    """Ray runs a Serve proxy on the head too: in the Service, it would take (and pin) gRPC clients."""
    assert rendered.rayservice["spec"]["excludeHeadPodFromServeSvc"] is True


def test_gpu_workers_autoscale_only_when_max_replicas_is_above_replicas():
    fixed = render({}).cluster
    assert fixed["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in fixed
    group = fixed["workerGroupSpecs"][0]
    assert group["minReplicas"] == group["maxReplicas"] == group["replicas"] == 1
    scaling = render({"gpuWorkers": {"replicas": 2, "maxReplicas": 5, "idleTimeoutSeconds": 120},
                      "models": {"pvc": {"accessModes": ["ReadWriteMany"]}}}).cluster
    assert scaling["enableInTreeAutoscaling"] is True
    assert scaling["autoscalerOptions"]["idleTimeoutSeconds"] == 120
    assert scaling["autoscalerOptions"]["securityContext"]["allowPrivilegeEscalation"] is False
    group = scaling["workerGroupSpecs"][0]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 5)


def test_a_disruption_budget_keeps_drains_to_one_gpu_pod_at_a_time(rendered, values):
    budget = rendered.one("PodDisruptionBudget", "-gpu-workers")
    assert budget["spec"]["maxUnavailable"] == 1
    worker_labels = rendered.pod_templates()[chart_values(values)["gpuWorkers"]["groupName"]]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= worker_labels.items()
    assert budget["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "gpu-worker"
    off = render({"gpuWorkers": {"podDisruptionBudget": {"enabled": False, "maxUnavailable": 1}}})
    assert not [o for o in off.objects if o["kind"] == "PodDisruptionBudget"]


def test_a_read_write_once_model_volume_on_several_gpu_pods_is_refused_saying_what_to_use():
    for workers in ({"replicas": 2}, {"replicas": 1, "maxReplicas": 3}):
        with pytest.raises(helm_python.HelmRenderError, match="ReadWriteOnce, but up to [23] GPU worker pods"):
            render({"gpuWorkers": workers})
    render({"gpuWorkers": {"replicas": 2}, "models": {"pvc": {"accessModes": ["ReadWriteMany"]}}})
    render({"gpuWorkers": {"replicas": 2}, "models": {"source": "hostPath", "hostPath": {"path": "/mnt/models"}}})


@pytest.mark.parametrize(("verifier_gpus", "gpus_per_pod", "refused"), [
    (None, 1, r"take 2 GPUs of one pod \(verifier_num_gpus plus a whole one for the drafter, on one node\), but "
              "gpuWorkers.gpusPerPod is 1: set it to at least 2"),
    (0.5, 1, "take 1.5 GPUs of one pod .* set it to at least 2"),
    (2.0, 2, "take 3 GPUs of one pod .* set it to at least 3"),
    (None, 2, None),
    (0.5, 2, None),
])
def test_own_gpu_needs_a_pod_with_the_verifiers_gpus_and_one_more(verifier_gpus, gpus_per_pod, refused):
    """The placement group of a verifier and its own-GPU drafter is STRICT_PACK: Ray would wait
    forever for a pod that cannot hold it, so the chart refuses it at install."""
    dflash = {"drafter_placement": "own_gpu"}
    if verifier_gpus is not None:
        dflash["verifier_num_gpus"] = verifier_gpus
    values = {"dflash": dflash, "gpuWorkers": {"gpusPerPod": gpus_per_pod}}
    if refused:
        with pytest.raises(helm_python.HelmRenderError, match=f"dflash.drafter_placement is own_gpu: .*{refused}"):
            render(values)
        return
    rendered = render(values)
    config = ServeConfig.from_dict(rendered.dflash_config)
    assert config.drafter_placement == "own_gpu" and rendered.app["args"]["drafter_placement"] == "own_gpu"
    resources = rendered.worker_group["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == str(gpus_per_pod)


@pytest.mark.parametrize(("dflash", "gpus_per_pod", "refused"), [
    ({}, 1, r"dflash.engine.tensor_parallel_size is 2: a verifier replica's ranks take 2 GPUs of one pod \(a whole "
            r"one each, on one node\), but gpuWorkers.gpusPerPod is 1: set it to at least 2"),
    ({}, 2, None),
    ({"drafter_placement": "own_gpu"}, 2, r"dflash.drafter_placement is own_gpu: .* take 3 GPUs of one pod "
                                          r"\(verifier_num_gpus × engine.tensor_parallel_size 2 plus a whole one .* "
                                          "at least 3"),
    ({"drafter_placement": "own_gpu"}, 3, None),
])
def test_a_tensor_parallel_replica_needs_a_pod_with_a_gpu_per_rank(dflash, gpus_per_pod, refused):
    """The replica's ranks are processes on its GPUs, which Ray gives from one pod: a pod too small
    would leave the replica pending forever, so the chart refuses it at install."""
    values = {"dflash": {**dflash, "engine": {"tensor_parallel_size": 2}}, "gpuWorkers": {"gpusPerPod": gpus_per_pod}}
    if refused:
        with pytest.raises(helm_python.HelmRenderError, match=refused):
            render(values)
        return
    rendered = render(values)
    assert ServeConfig.from_dict(rendered.dflash_config).engine.tensor_parallel_size == 2
    assert rendered.app["args"]["engine"]["tensor_parallel_size"] == 2


@pytest.mark.parametrize(("dflash", "pod_gpus"), [
    ({}, 1),
    ({"verifier_num_gpus": 0.5}, 1),
    ({"drafter_placement": "own_gpu"}, 2),
    ({"drafter_placement": "own_gpu", "verifier_num_gpus": 0.5}, 2),
    ({"engine": {"tensor_parallel_size": 2}}, 2),
    ({"engine": {"tensor_parallel_size": 4}, "drafter_placement": "own_gpu"}, 5),
])
def test_unset_gpus_per_pod_is_one_verifier_replicas_gpus(dflash, pod_gpus):
    """gpuWorkers.gpusPerPod left unset: each pod holds one verifier replica, its tensor-parallel
    ranks and its own-GPU drafter, sized from the replica's settings."""
    rendered = render({"dflash": dflash})
    resources = rendered.worker_group["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == str(pod_gpus)


def test_shared_placement_needs_no_second_gpu():
    render({"dflash": {"drafter_placement": "shared"}, "gpuWorkers": {"gpusPerPod": 1}})


def test_operator_pod_settings_reach_both_ray_pods():
    values = {"pods": {
        "labels": {"team": "llm"}, "annotations": {"example.com/owner": "platform"},
        "priorityClassName": "llm-serving", "serviceAccountName": "dflash",
        "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        "extraVolumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
        "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True}],
        "scratch": {"tmpSizeLimit": "30Gi", "homeSizeLimit": "5Gi"}},
        "gpuWorkers": {"topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "gpu-worker"}}}]}}
    rendered = render(values)
    for group, template in rendered.pod_templates().items():
        meta, spec = template["metadata"], template["spec"]
        assert meta["labels"]["team"] == "llm" and meta["annotations"]["example.com/owner"] == "platform"
        assert spec["priorityClassName"] == "llm-serving" and spec["serviceAccountName"] == "dflash"
        assert spec["automountServiceAccountToken"] is False
        container = spec["containers"][0]
        assert {"name": "NCCL_DEBUG", "value": "WARN"} in container["env"]
        assert {"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True} in container["volumeMounts"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["certs"]["secret"] == {"secretName": "ca"}
        assert volumes["tmp"]["emptyDir"]["sizeLimit"] == "30Gi" and volumes["home"]["emptyDir"]["sizeLimit"] == "5Gi"
        assert ("topologySpreadConstraints" in spec) == (group != "head")


def test_scratch_space_is_bounded_and_requested_by_default(rendered):
    for template in rendered.pod_templates().values():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["tmp"]["emptyDir"]["sizeLimit"] and volumes["home"]["emptyDir"]["sizeLimit"]
        assert template["spec"]["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "30Gi"


def test_the_network_policy_opens_ray_to_its_own_pods_and_the_operator_only(rendered, values):
    policy = rendered.one("NetworkPolicy", "")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for template in rendered.pod_templates().values():
        assert selector.items() <= template["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    own, operator, clients, scrapers = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": selector}}]}  # every port, own pods only
    assert operator["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}
    ports = chart_values(values)["ports"]
    assert {p["port"] for p in clients["ports"]} == {ports["grpc"], ports["http"]}
    assert [p["port"] for p in scrapers["ports"]] == [ports["metrics"]]
    assert scrapers["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    off = render({"networkPolicy": {"enabled": False}})
    assert not [o for o in off.objects if o["kind"] == "NetworkPolicy"]


def test_gcs_fault_tolerance_uses_the_external_redis_and_its_secret():
    assert "gcsFaultToleranceOptions" not in render({}).cluster
    options = render({"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis.db.svc:6379",
                                            "passwordSecret": {"name": "redis", "key": "pw"}}}).cluster["gcsFaultToleranceOptions"]
    assert options == {"redisAddress": "redis.db.svc:6379",
                       "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis", "key": "pw"}}}}
    with pytest.raises(helm_python.HelmRenderError, match="gcsFaultTolerance.redisAddress"):
        render({"gcsFaultTolerance": {"enabled": True}})


def test_api_keys_come_from_the_secret_mounted_where_the_config_points():
    rendered = render({"apiKeys": {"secretName": "dflash-api-keys", "key": "api-keys.txt"}})
    config = rendered.dflash_config
    assert config["api_keys_file"] == "/etc/dflash-keys/keys"
    ServeConfig.from_dict(config)  # the server takes it
    for group, template in rendered.pod_templates().items():
        spec = template["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "api-keys"]
        assert volume["secret"] == {"secretName": "dflash-api-keys", "defaultMode": 0o440,
                                    "items": [{"key": "api-keys.txt", "path": "keys"}]}
        (container,) = [c for c in spec["containers"] if c["name"].startswith("ray-")]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "api-keys"]
        assert mount == {"name": "api-keys", "mountPath": "/etc/dflash-keys", "readOnly": True}, group
    default = render({})
    assert "api_keys_file" not in default.dflash_config
    assert not [v for t in default.pod_templates().values() for v in t["spec"]["volumes"] if v["name"] == "api-keys"]


EXPOSE = {"httpHost": "api.example.com", "grpcHost": "grpc.example.com", "tlsSecretName": "dflash-tls"}


def test_ingresses_end_tls_in_front_of_both_protocols():
    rendered = render({"expose": {**EXPOSE, "ingress": {"enabled": True, "className": "nginx"}}})
    service = f"{rendered.rayservice['metadata']['name']}-serve-svc"
    for kind, host, port in (("http", "api.example.com", 8000), ("grpc", "grpc.example.com", 9000)):
        ingress = rendered.one("Ingress", f"-{kind}")
        spec = ingress["spec"]
        assert spec["ingressClassName"] == "nginx"
        assert spec["tls"] == [{"hosts": [host], "secretName": "dflash-tls"}]
        (rule,) = spec["rules"]
        assert rule["host"] == host
        assert rule["http"]["paths"][0]["backend"]["service"] == {"name": service, "port": {"number": port}}
        grpc_backend = ingress["metadata"].get("annotations", {}).get("nginx.ingress.kubernetes.io/backend-protocol")
        assert grpc_backend == ("GRPC" if kind == "grpc" else None)
    assert not render({}).all("Ingress")


def test_gateway_routes_send_http_and_grpc_to_the_serve_service():
    rendered = render({"expose": {**EXPOSE, "gateway": {"enabled": True, "gatewayClassName": "eg"}}})
    name = rendered.rayservice["metadata"]["name"]
    gateway = rendered.one("Gateway")
    assert gateway["apiVersion"] == "gateway.networking.k8s.io/v1" and gateway["spec"]["gatewayClassName"] == "eg"
    listeners = {listener["name"]: listener for listener in gateway["spec"]["listeners"]}
    assert {k: (v["hostname"], v["protocol"], v["port"]) for k, v in listeners.items()} == {
        "http": ("api.example.com", "HTTPS", 443), "grpc": ("grpc.example.com", "HTTPS", 443)}
    for listener in listeners.values():
        assert listener["tls"] == {"mode": "Terminate", "certificateRefs": [{"kind": "Secret", "name": "dflash-tls"}]}
    for kind, route_kind, host, port in (("http", "HTTPRoute", "api.example.com", 8000),
                                         ("grpc", "GRPCRoute", "grpc.example.com", 9000)):
        route = rendered.one(route_kind)
        assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
        assert route["spec"] == {"parentRefs": [{"name": name, "sectionName": kind}], "hostnames": [host],
                                 "rules": [{"backendRefs": [{"name": f"{name}-serve-svc", "port": port}]}]}
    refs = [{"name": "public", "namespace": "gateways", "sectionName": "https"}]
    existing = render({"expose": {"grpcHost": "grpc.example.com", "gateway": {"enabled": True, "parentRefs": refs}}})
    assert not existing.all("Gateway") and not existing.all("HTTPRoute")
    assert existing.one("GRPCRoute")["spec"]["parentRefs"] == refs


@pytest.mark.parametrize("expose, message", [
    ({"gateway": {"enabled": True}, "grpcHost": "g.example.com"}, "gatewayClassName"),
    ({"gateway": {"enabled": True, "gatewayClassName": "eg"}, "grpcHost": "g.example.com"}, "tlsSecretName"),
    ({"ingress": {"enabled": True}, "httpHost": "a.example.com"}, "tlsSecretName"),
    ({"ingress": {"enabled": True}, "tlsSecretName": "t"}, "expose"),
])
def test_incomplete_expose_values_are_refused(expose, message):
    """By the values schema, or by the template where the rule spans two keys' meanings."""
    with pytest.raises((helm_python.HelmRenderError, helm_python.HelmValuesError), match=message):
        render({"expose": expose})


def test_ray_token_auth_renders_kuberays_auth_options_with_the_token_secret():
    assert "authOptions" not in render({}).cluster
    assert render({"rayAuth": {"enabled": True}}).cluster["authOptions"] == {"mode": "token"}  # KubeRay's Secret
    cluster = render({"rayAuth": {"enabled": True, "secretName": "ray-token"}}).cluster
    assert cluster["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    # examples/multi-replica.yaml sets it: test_validate checks it against KubeRay's CRDs there.
    assert scenario_values("multi-replica")["rayAuth"]["enabled"]


DOWNLOAD = {"models": {"source": "pvc", "hf": {"tokenSecret": {"name": "hf-token", "key": "token"}},
                       "download": {"enabled": True, "repos": [{"repo": "Qwen/Qwen3-8B", "revision": "0a1b2c"},
                                                               {"repo": "z-lab/Qwen3-8B-DFlash-b16", "revision": "v1"}]}}}


def test_the_model_download_runs_once_per_gpu_pod_before_ray_into_the_models_volume():
    assert "initContainers" not in render({}).worker_group["template"]["spec"]
    # examples/split-2gpu.yaml sets it: kubernetes-validate and checkov see the init containers there.
    assert scenario_values("split-2gpu")["models"]["download"]["enabled"]
    rendered = render(DOWNLOAD)
    spec = rendered.worker_group["template"]["spec"]
    assert "initContainers" not in rendered.cluster["headGroupSpec"]["template"]["spec"]  # no model there
    fetch = spec["initContainers"]
    assert [c["name"] for c in fetch] == ["fetch-model-0", "fetch-model-1"]
    assert fetch[0]["command"] == ["hf", "download", "Qwen/Qwen3-8B", "--revision", "0a1b2c",
                                   "--local-dir", "/models/Qwen/Qwen3-8B"]
    ray_container = spec["containers"][0]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for container in fetch:
        assert container["image"] == ray_container["image"]
        assert container["securityContext"] == ray_container["securityContext"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["models"] == {"name": "models", "mountPath": "/models"}  # writable here only
        assert mounts["hf-token"]["readOnly"] and volumes["hf-token"]["secret"]["secretName"] == "hf-token"
        # The token as a file (HF_TOKEN_PATH), never as an environment variable.
        assert env(container)["HF_TOKEN_PATH"] == f"{mounts['hf-token']['mountPath']}/token"
        assert "HF_TOKEN" not in env(container)
    assert {m["name"]: m for m in ray_container["volumeMounts"]}["models"]["readOnly"] is True
    own_image = render({**DOWNLOAD, "models": {**DOWNLOAD["models"], "download": {
        **DOWNLOAD["models"]["download"], "image": "registry.example.com/hf-cli:1"}}})
    assert own_image.worker_group["template"]["spec"]["initContainers"][0]["image"] == "registry.example.com/hf-cli:1"


@pytest.mark.parametrize(("values", "says"), [
    ({"models": {"source": "hostPath", "hostPath": {"path": "/mnt/models"}, "download": {
        "enabled": True, "repos": [{"repo": "Qwen/Qwen3-8B", "revision": "main"}]}}}, "use models.source pvc or hf"),
    ({"models": {"download": {"enabled": True}}}, "list the models to fetch in models.download.repos"),
])
def test_a_download_with_nowhere_to_go_or_nothing_to_fetch_is_refused(values, says):
    with pytest.raises(helm_python.HelmRenderError, match=says):
        render(values)
