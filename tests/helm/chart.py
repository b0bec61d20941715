"""The chart rendered offline by the real Helm engine (helm-python-sdk bundles Helm's Go SDK), as
`helm install` would render it, with the same values-schema check."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import helm_python
import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "dflash-serve"
RELEASE = "dflash-serve"
NAMESPACE = "llm"
# The values files the README offers, besides the defaults.
EXAMPLES = {path.stem: path for path in sorted((CHART / "examples").glob("*.yaml"))}


def project_requirements() -> dict[str, Requirement]:
    """pyproject.toml's runtime dependencies by package name."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {req.name: req for req in map(Requirement, dependencies)}


def scenario_values(name: str) -> dict:
    return {} if name == "default" else yaml.safe_load(EXAMPLES[name].read_text())


@dataclass
class Rendered:
    objects: list[dict]
    notes: str

    def all(self, kind: str) -> list[dict]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict:
        found = [obj for obj in self.all(kind) if obj["metadata"]["name"].endswith(name_suffix)]
        names = [obj["metadata"]["name"] for obj in found]
        assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {names}"
        return found[0]

    @property
    def rayservice(self) -> dict:
        return self.one("RayService")

    @property
    def cluster(self) -> dict:
        return self.rayservice["spec"]["rayClusterConfig"]

    @property
    def worker_group(self) -> dict:
        (group,) = self.cluster["workerGroupSpecs"]
        return group

    def pod_templates(self) -> dict[str, dict]:
        """Group name ("head" or the worker group's) -> the pod template KubeRay builds pods from."""
        templates = {"head": self.cluster["headGroupSpec"]["template"]}
        templates.update({g["groupName"]: g["template"] for g in self.cluster["workerGroupSpecs"]})
        return templates

    def pods(self) -> list[dict]:
        """The pod templates as Pod objects, for checkers that know core kinds only."""
        name, namespace = self.rayservice["metadata"]["name"], self.rayservice["metadata"]["namespace"]
        return [{"apiVersion": "v1", "kind": "Pod",
                 "metadata": {**template["metadata"], "name": f"{name}-{group}", "namespace": namespace},
                 "spec": template["spec"]} for group, template in self.pod_templates().items()]

    @property
    def serve_config(self) -> dict:
        return yaml.safe_load(self.rayservice["spec"]["serveConfigV2"])

    @property
    def app(self) -> dict:
        (app,) = self.serve_config["applications"]
        return app

    def deployment_overrides(self, name: str) -> dict:
        (found,) = [d for d in self.app.get("deployments", []) if d["name"] == name]
        return found

    @property
    def dflash_config(self) -> dict:
        """The server's config as the chart hands it over: the application's args plus the
        routers' settings in the Router's user_config."""
        return {**self.app["args"], **self.deployment_overrides("Router").get("user_config", {})}


def load_chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def chart_values(values: dict) -> dict:
    """The values a release gets: the chart's defaults coalesced with the user's."""
    with load_chart() as chart:
        return chart.merge_values(values)


def render(values: dict | None = None, release: str = RELEASE) -> Rendered:
    """Raises helm_python.HelmValuesError for values the schema rejects, HelmRenderError for a
    template's own refusal."""
    with load_chart() as chart:
        manifests = chart.render(values or {}, name=release, namespace=NAMESPACE, is_install=True)
    objects, notes = [], ""
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            notes = text
        else:
            objects.extend(obj for obj in yaml.safe_load_all(text) if obj)
    return Rendered(objects, notes)
