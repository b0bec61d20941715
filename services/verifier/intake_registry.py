"""Where routers find the verifiers' direct intakes: each verifier replica registers its engine
process's intake address in Ray's key-value store (the GCS), under its application and replica
name, and removes it when it shuts down; each router lists its application's. A replica killed
before its shutdown leaves its entry behind: the replica that adopts its engine deletes it, or
else the router that finds that address refusing connections (`forget`)."""

from __future__ import annotations

import json

from dflash_serve.services.verifier.output_stream import StreamAddress

NAMESPACE = "dflash-intake"


def _key(app: str, replica: str) -> str:
    return f"{app}/{replica}"


def register(app: str, replica: str, address: StreamAddress) -> None:
    """Also removes the entry of a replica that died and whose engine this one adopted (`adoption`)."""
    from ray.experimental.internal_kv import _internal_kv_put

    for name, known in registered(app).items():
        if name != replica and known == address:
            forget(app, name)
    value = json.dumps({"host": address.host, "port": address.port, "token": address.token.hex()})
    _internal_kv_put(_key(app, replica), value, namespace=NAMESPACE)


def forget(app: str, replica: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(_key(app, replica), namespace=NAMESPACE)


def registered(app: str) -> dict[str, StreamAddress]:
    """The application's engines by replica name."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    engines = {}
    for key in _internal_kv_list(_key(app, ""), namespace=NAMESPACE):
        value = _internal_kv_get(key, namespace=NAMESPACE)
        if value is None:  # removed since the listing
            continue
        entry = json.loads(value)
        name = key.decode().split("/", 1)[1]
        engines[name] = StreamAddress(entry["host"], entry["port"], bytes.fromhex(entry["token"]))
    return engines
