"""KubeRay's CRDs as strict JSON Schemas, for validating rendered objects offline.

The CRDs' OpenAPI schemas come from the shared folder beside the repository (../shared/k8s/), not
from a copy in it. The API server prunes or refuses (with fieldValidation=Strict, kubectl's
default) fields a schema does not list; plain JSON Schema would accept them, so every object
schema that lists its properties is closed here, as the API server treats it. CEL rules
(x-kubernetes-validations) are not evaluated.
"""

from __future__ import annotations

import functools

import jsonschema
import yaml

from tests.helm.chart import REPO

KUBERAY_CRDS = REPO.parent / "shared" / "k8s"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}


def _closed(node: dict) -> dict:
    node = dict(node)
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    if "properties" in node:
        node["properties"] = {k: _closed(v) for k, v in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _closed(node["additionalProperties"])
    if "items" in node:
        node["items"] = _closed(node["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            node[key] = [_closed(n) for n in node[key]]
    return node


@functools.cache
def crd_validator(kind: str, version: str = "v1") -> jsonschema.Draft7Validator:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((KUBERAY_CRDS / CRD_FILES[kind]).read_text(), Loader=loader)
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(_closed(served["schema"]["openAPIV3Schema"]))


def crd_errors(obj: dict) -> list[str]:
    """Every violation of the object's CRD schema, as `path: message`."""
    errors = crd_validator(obj["kind"], obj["apiVersion"].split("/")[1]).iter_errors(obj)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
