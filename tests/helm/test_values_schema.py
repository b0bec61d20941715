"""values.schema.json: bad values fail `helm install` with a message that names the key and says
what is wrong; the `dflash` block is services/config.py's schema, so the two never disagree."""

from __future__ import annotations

import json

import helm_python
import pytest

from dflash_serve.services.config import ServeConfig
from tests.helm.chart import render
from tests.helm.config_schema import SCHEMA_PATH, dflash_schema

# (values, what the message must say: where, and what is wrong)
BAD_VALUES = [
    ({"dflash": {"engine": {"max_num_seq": 8}}}, ["/dflash/engine", "'max_num_seq' not allowed"]),
    ({"dflash": {"topology": "pipeline"}}, ["/dflash/topology", "'split', 'colocated'"]),
    ({"dflash": {"num_replicas": "two"}}, ["/dflash/num_replicas", "want integer"]),
    ({"dflash": {"drafter_placement": "own"}}, ["/dflash/drafter_placement", "'shared', 'own_gpu'"]),
    ({"dflash": {"grpc_port": 9001}}, ["/dflash", "'grpc_port' not allowed"]),
    ({"dflash": {"engine": {"drafter_revision": 20251125}}}, ["/dflash/engine/drafter_revision", "got number, want string"]),
    ({"gpuWorkers": {"gpusPerPod": 0}}, ["/gpuWorkers/gpusPerPod", "minimum"]),
    ({"gpuWorker": {"replicas": 2}}, ["'gpuWorker' not allowed"]),
    ({"models": {"source": "s3"}}, ["/models/source", "'hf', 'pvc', 'hostPath'"]),
    ({"models": {"source": "hostPath"}}, ["/models/hostPath/path", "does not match pattern '^/'"]),
    ({"image": {"pullPolicy": "Sometimes"}}, ["/image/pullPolicy", "'Always', 'IfNotPresent', 'Never'"]),
    ({"securityContext": {"allowPrivilegeEscalation": True}},
     ["/securityContext/allowPrivilegeEscalation", "must be false"]),
    ({"head": {"resources": {"limits": {"cpu": "lots", "memory": "8Gi"}}}}, ["/head/resources/limits/cpu", "'lots'"]),
    ({"ports": {"grpc": 70000}}, ["/ports/grpc", "maximum"]),
    ({"models": {"download": {"enabled": True, "repos": [{"repo": "Qwen/Qwen3-8B"}]}}},
     ["/models/download/repos/0", "missing property 'revision'"]),
    ({"models": {"download": {"repos": [{"repo": "qwen3", "revision": "main"}]}}},
     ["/models/download/repos/0/repo", "does not match pattern"]),
    ({"rayAuth": {"enabled": "yes"}}, ["/rayAuth/enabled", "want boolean"]),
    ({"prometheusRule": {"alerts": {"kvCacheUsage": {"above": 95}}}},
     ["/prometheusRule/alerts/kvCacheUsage/above", "maximum"]),
    ({"prometheusRule": {"interval": "30 seconds"}}, ["/prometheusRule/interval", "does not match pattern"]),
]


@pytest.mark.parametrize(("values", "says"), BAD_VALUES, ids=[json.dumps(v) for v, _ in BAD_VALUES])
def test_bad_values_are_rejected_with_a_readable_message(values, says):
    with pytest.raises(helm_python.HelmValuesError) as raised:
        render(values)
    message = str(raised.value)
    for words in says:
        assert words in message, message


@pytest.mark.parametrize(("values", "says"), [case for case in BAD_VALUES if "dflash" in case[0]
                                              and "grpc_port" not in case[0]["dflash"]])
def test_the_server_rejects_what_the_chart_rejects(values, says):
    """The same bad config, given to the server directly, fails there too."""
    config = render({}).dflash_config
    for key, value in values["dflash"].items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    with pytest.raises((ValueError, TypeError)):
        ServeConfig.from_dict(config)


def test_the_dflash_block_schema_is_generated_from_services_config():
    committed = json.loads(SCHEMA_PATH.read_text())["properties"]["dflash"]
    assert committed == dflash_schema(), (
        "services/config.py changed: regenerate the chart's schema with "
        "`.venv/bin/python -m tests.helm.config_schema`")


def test_unset_config_keys_keep_the_servers_defaults():
    """Helm's null removes a default from values.yaml; the server's own default then applies."""
    rendered = render({"dflash": {"topology": "colocated", "engine": {"drafter": None}}})
    config = rendered.dflash_config
    assert "drafter" not in config["engine"]
    assert ServeConfig.from_dict(config).engine.drafter is None
