"""A Ray head in its own process, with Ray's dashboard and its REST API, as KubeRay's head pod runs
one: the tests talk to it only as KubeRay and clients do (dashboard REST, gRPC), never as a driver.

Its processes are children of one Python process that started it with ray.init, so stopping that
process stops exactly this cluster (`ray stop` would stop every Ray on the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflash_serve.services.app import SERVE_ENV
from tests.integration.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
HEAD = """
import sys, ray
ray.init(num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=int(sys.argv[1]),
         object_store_memory=200 * 2**20, log_to_driver=False)
print("ready", flush=True)
sys.stdin.read()  # until the test closes it
ray.shutdown()
"""


@dataclass
class RayHead:
    dashboard: str
    headers: dict = field(default_factory=dict)

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 30) -> dict | None:
        data = None if body is None else json.dumps(body).encode()
        headers = {**self.headers, **({"Content-Type": "application/json"} if data else {})}
        req = urllib.request.Request(self.dashboard + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as reply:
                text = reply.read().decode()
        except urllib.error.HTTPError as err:
            raise AssertionError(f"{method} {path}: HTTP {err.code}: {err.read().decode()[:2000]}") from err
        return json.loads(text) if text.strip() else None

    def deploy(self, serve_config: dict) -> None:
        """What KubeRay does with a RayService's serveConfigV2."""
        self.request("PUT", "/api/serve/applications/", serve_config)

    def applications(self) -> dict:
        return self.request("GET", "/api/serve/applications/")["applications"]

    def wait_running(self, app: str, timeout: float = 240, since: float | None = None) -> dict:
        """The app's details once RUNNING (and, with `since`, deployed at or after that time);
        fails at once with Serve's message on DEPLOY_FAILED."""
        deadline = time.monotonic() + timeout
        details = {}
        while time.monotonic() < deadline:
            details = self.applications().get(app, {})
            fresh = since is None or details.get("last_deployed_time_s", 0) >= since
            if fresh and details.get("status") == "DEPLOY_FAILED":
                raise AssertionError(f"{app} failed to deploy: {details.get('message')}")
            if fresh and details.get("status") == "RUNNING":
                return details
            time.sleep(1)
        raise AssertionError(f"{app} not RUNNING after {timeout} s: {details.get('status')} {details.get('message')}")


@contextlib.contextmanager
def ray_head(auth_token: str | None = None):
    """auth_token: Ray's token authentication on, as KubeRay's authOptions (mode: token) turns it
    on: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN in every Ray process, the token on every REST call."""
    port = free_port()
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": auth_token} if auth_token else {"RAY_AUTH_MODE": "disabled"}
    head_env = {**os.environ, **SERVE_ENV, **auth, "RAY_USAGE_STATS_ENABLED": "0",  # SERVE_ENV: as the chart's pods
                # The replicas import the installed `dflash_serve` (this checkout's, through the
                # editable install or the README's shim on PYTHONPATH), as the image's workers do.
                "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
    head = None
    process = subprocess.Popen([sys.executable, "-c", HEAD, str(port)], cwd=REPO, env=head_env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.strip() == "ready", f"the Ray head did not start (exit code {process.poll()})"
        head = RayHead(f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {auth_token}"} if auth_token else {})
        _wait_for_the_rest_api(head)
        yield head
    finally:
        if head is not None:
            with contextlib.suppress(AssertionError, OSError):
                head.request("DELETE", "/api/serve/applications/", timeout=60)
        process.stdin.close()
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_for_the_rest_api(head: RayHead, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            head.request("GET", "/api/ray/version")
            return
        except (urllib.error.URLError, ConnectionError) as err:
            if time.monotonic() > deadline:
                raise AssertionError(f"Ray's dashboard did not answer in {timeout} s: {err}") from err
            time.sleep(0.5)
