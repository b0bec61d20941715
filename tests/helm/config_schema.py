"""The `dflash` block of the chart's values.schema.json: ServeConfig's own JSON schema.

    .venv/bin/python -m tests.helm.config_schema     # rewrite it after changing services/config.py

The chart passes that block through to the server as its config file, so its keys, types, ranges
and descriptions are ServeConfig's and EngineConfig's (pydantic's `model_json_schema`); the schema
lets `helm install` reject a typo at once instead of the application failing later inside the
cluster. Defaults are left out: the chart's values.yaml sets some of its own (engine.device: cuda),
and the server's stay in services/config.py. tests/helm/test_values_schema.py fails when the
committed schema is stale.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_serve.services.config import ServeConfig

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "helm" / "dflash-serve" / "values.schema.json"
# Set by the chart from its `ports` values, so that the pods' config names the ports they listen on.
CHART_OWNED = {"grpc_port": "ports.grpc", "http_port": "ports.http", "metrics_port": "ports.metrics"}
# Pydantic's annotations for code generators; a values file has no use for them.
DROPPED = {"title", "default"}


def _inline(node, definitions: dict):
    """`node` without DROPPED keywords and with every $ref replaced by the definition it names:
    the block sits inside the chart's schema, where pydantic's root-relative "#/$defs/..." would
    not resolve."""
    if isinstance(node, list):
        return [_inline(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:  # the field's own keywords (its description) over the definition's
        node = {**definitions[node["$ref"].removeprefix("#/$defs/")],
                **{key: value for key, value in node.items() if key != "$ref"}}
    inlined = {}
    for key, value in node.items():
        if key == "properties":  # field names, not keywords
            inlined[key] = {name: _inline(field, definitions) for name, field in value.items()}
        elif key not in DROPPED:
            inlined[key] = _inline(value, definitions)
    return inlined


def dflash_schema() -> dict:
    schema = ServeConfig.model_json_schema()
    definitions = schema.pop("$defs", {})
    block = _inline(schema, definitions)
    for key in CHART_OWNED:
        del block["properties"][key]
    block["required"] = [key for key in block.get("required", []) if key not in CHART_OWNED]
    owned = ", ".join(f"{key} from {value}" for key, value in CHART_OWNED.items())
    block["description"] = (f"services/config.py:ServeConfig, passed through as the server's config file; "
                            f"the chart sets {owned}")
    return block


def write() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    schema["properties"]["dflash"] = dflash_schema()
    SCHEMA_PATH.write_text(json.dumps(schema, indent=2) + "\n")


if __name__ == "__main__":
    write()
    print(f"wrote the dflash block of {SCHEMA_PATH}")
