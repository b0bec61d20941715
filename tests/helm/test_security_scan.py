"""A security scan (checkov) of what the chart renders and of the Dockerfile.

checkov cannot see inside a RayService, so the pods KubeRay will create are scanned as the Pod
objects their templates describe (tests/helm/chart.py:Rendered.pods), beside every other rendered
object, for the default values and each example. Open-source checkov rates no severities, so
the bar is stricter than "no high findings": no failed check at all, except the few below, each
for a stated reason.

checkov's pins clash with ray's and torch's dependencies, so it lives in a virtual environment
of its own, which .ci/run and the README's setup command create at .venv/checkov.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from tests.helm.chart import EXAMPLES, REPO, render, scenario_values

CHECKOV = REPO / ".venv" / "checkov" / "bin" / "checkov"
ACCEPTED = {
    "CKV_K8S_8": "liveness probes: KubeRay injects its own into every Ray container (raylet and GCS health)",
    "CKV_K8S_9": "readiness probes: KubeRay injects its own, with the Serve proxy's health on workers",
    "CKV_K8S_15": "pull policy: images are pinned by version tag or digest (image.digest); set "
                  "image.pullPolicy=Always where the registry must authorize every pull",
    "CKV_K8S_43": "image digest: optional (image.digest); the default pins the chart's appVersion tag",
}


def checkov() -> str:
    found = str(CHECKOV) if CHECKOV.exists() else shutil.which("checkov")
    if not found:
        how = f"python3 -m venv {CHECKOV.parents[1]} && {CHECKOV.parent}/pip install checkov==3.3.30"
        if os.environ.get("CI"):
            pytest.fail(f"checkov is not installed; .ci/run must install it ({how})")
        pytest.skip(f"checkov not installed (its own venv: {how})")
    return found


def scan_inputs(folder) -> None:
    for scenario in ["default", *EXAMPLES]:
        rendered = render(scenario_values(scenario))
        objects = [obj for obj in rendered.objects if obj["kind"] != "RayService"] + rendered.pods()
        (folder / f"{scenario}.yaml").write_text(yaml.safe_dump_all(objects))
    shutil.copy(REPO / "Dockerfile", folder / "Dockerfile")


def test_checkov_finds_nothing_beyond_the_accepted_checks(tmp_path):
    binary = checkov()
    scan_inputs(tmp_path)
    result = subprocess.run(
        [binary, "--directory", str(tmp_path), "--framework", "kubernetes", "dockerfile", "--output", "json",
         "--skip-check", ",".join(ACCEPTED), "--compact", "--skip-download"],
        capture_output=True, text=True, timeout=300)
    assert result.stdout.strip(), result.stderr
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert {r["check_type"] for r in reports} == {"kubernetes", "dockerfile"}, "a framework scanned nothing"
    failed = [f"{c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})"
              for r in reports for c in r["results"]["failed_checks"]]
    assert not failed, "\n".join(failed)
    passed = {(c["check_id"], c["resource"]) for r in reports for c in r["results"]["passed_checks"]}
    # The pods were really looked at: non-root, no privilege escalation, resource limits, and a
    # NetworkPolicy that selects them.
    for check in ["CKV_K8S_20", "CKV_K8S_23", "CKV_K8S_11", "CKV_K8S_13", "CKV2_K8S_6"]:
        assert any(cid == check and res.startswith("Pod.") for cid, res in passed), check
