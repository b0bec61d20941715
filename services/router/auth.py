"""API keys: read from a file, checked on every gRPC call and HTTP request but the health checks.

Keys are compared with `hmac.compare_digest` against every configured key (no early exit on the
first match), so the time a check takes says nothing about how much of a guess was right. Keys
never appear in a message, a log line or an exception.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

GRPC_METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
BEARER = "bearer "


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self._keys = tuple(key.encode() for key in keys)
        if not self._keys:
            raise ValueError("no API keys given: give at least one, or none of authentication")

    @classmethod
    def from_file(cls, path: str) -> ApiKeys:
        """One key a line; blank lines and surrounding whitespace are ignored."""
        try:
            with open(path) as f:
                keys = [line.strip() for line in f if line.strip()]
        except OSError as err:
            raise ValueError(f"api_keys_file {path!r} cannot be read ({err.strerror}): mount the keys there, "
                             "or leave api_keys_file empty to serve without authentication") from None
        if not keys:
            raise ValueError(f"api_keys_file {path!r} holds no key: write one key a line")
        if any(any(c.isspace() for c in key) for key in keys):
            raise ValueError(f"api_keys_file {path!r}: a key contains whitespace; write one key a line")
        return cls(keys)

    def allows(self, authorization: str | None) -> bool:
        """authorization: the `Authorization` header or metadata value, `Bearer KEY`."""
        if not authorization or authorization[:len(BEARER)].lower() != BEARER:
            return False
        presented = authorization[len(BEARER):].strip().encode()
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(presented, key)
        return matched


def grpc_authorization(metadata: Iterable[tuple[str, str]]) -> str | None:
    for key, value in metadata:
        if key == GRPC_METADATA_KEY:
            return value
    return None


UNAUTHENTICATED_MESSAGE = ("a valid API key is required: send it as `Authorization: Bearer KEY` "
                           "(gRPC: metadata `authorization: Bearer KEY`)")
