"""The `dflash` block of the chart's values.schema.json, generated from services/config.py.

    .venv/bin/python -m tests.helm.config_schema     # rewrite it after changing ServeConfig

The chart passes that block through to the server as its config file, so its keys and types are
ServeConfig's and EngineConfig's; the schema lets `helm install` reject a typo at once instead of
the application failing later inside the cluster. Only keys and types are described: defaults
stay in services/config.py alone. tests/helm/test_values_schema.py fails when the committed
schema is stale.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path

from services.config import SPECULATION_MODES, TARGET_IMPLS, TOPOLOGIES, ServeConfig

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "helm" / "dflash-serve" / "values.schema.json"
# Set by the chart from its `ports` values, so that the pods' config names the ports they listen on.
CHART_OWNED = {"grpc_port": "ports.grpc", "http_port": "ports.http", "metrics_port": "ports.metrics"}
ENUMS = {"topology": list(TOPOLOGIES), "target_impl": list(TARGET_IMPLS), "speculation": list(SPECULATION_MODES)}
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def _field_schema(name: str, hint) -> dict:
    if name in ENUMS:
        return {"enum": ENUMS[name]}
    if typing.get_origin(hint) is dict:  # integer keys (batch sizes): JSON object keys are strings
        key, value = typing.get_args(hint)
        return {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": {"type": JSON_TYPES[value]}}
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    names = [JSON_TYPES[m] for m in members]
    return {"type": names[0] if len(names) == 1 else names}


def _object_schema(kind: type, skip: dict) -> dict:
    hints = typing.get_type_hints(kind)
    properties = {}
    for field in dataclasses.fields(kind):
        if field.name in skip:
            continue
        hint = hints[field.name]
        properties[field.name] = (_object_schema(hint, {}) if dataclasses.is_dataclass(hint)
                                  else _field_schema(field.name, hint))
    return {"type": "object", "additionalProperties": False, "properties": properties}


def dflash_schema() -> dict:
    owned = ", ".join(f"{key} from {value}" for key, value in CHART_OWNED.items())
    description = f"services/config.py:ServeConfig, passed through as the server's config file; the chart sets {owned}"
    return {"description": description, **_object_schema(ServeConfig, CHART_OWNED)}


def write() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    schema["properties"]["dflash"] = dflash_schema()
    SCHEMA_PATH.write_text(json.dumps(schema, indent=2) + "\n")


if __name__ == "__main__":
    write()
    print(f"wrote the dflash block of {SCHEMA_PATH}")
