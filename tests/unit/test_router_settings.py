"""The routers' own settings (config.ROUTER_SETTINGS), applied in place through Serve's user_config."""

from __future__ import annotations

import pytest

from dflash_serve.services.app import build_app
from dflash_serve.services.config import ROUTER_SETTINGS, EngineConfig, ServeConfig

CONFIG = ServeConfig(engine=EngineConfig(target="t", drafter="d"), max_pending=40, default_max_tokens=50)


def test_the_router_gets_its_settings_as_user_config():
    router = build_app(CONFIG)._bound_deployment  # Ray 2.60's Application (ray is pinned)
    assert router.user_config == {"max_pending": 40, "default_max_tokens": 50, "stream_messages_per_s": 1000.0} \
        == CONFIG.router_settings()
    assert set(ROUTER_SETTINGS) == set(router.user_config)


def test_a_partial_user_config_keeps_the_rest_of_the_config():
    assert CONFIG.with_router_settings({"max_pending": 7, "stream_messages_per_s": 250}).router_settings() == {
        "max_pending": 7, "default_max_tokens": 50, "stream_messages_per_s": 250}
    assert CONFIG.with_router_settings({}) == CONFIG


@pytest.mark.parametrize(("settings", "says"), [
    ({"max_num_seqs": 4}, "unknown key(s) max_num_seqs; only max_pending, default_max_tokens, stream_messages_per_s "
                          "apply in place"),
    ({"stream_messages_per_s": "fast"}, "stream_messages_per_s must be a number, got 'fast'"),
    ({"stream_messages_per_s": -1}, "greater than or equal to 0"),
    ({"max_pending": "64"}, "max_pending must be an integer, got '64'"),
    ({"default_max_tokens": True}, "default_max_tokens must be an integer"),
    ({"max_pending": 0}, "must be positive"),
])
def test_a_bad_user_config_is_refused_saying_what_to_fix(settings, says):
    with pytest.raises(ValueError, match=rf"{says.replace('(', '.').replace(')', '.')}"):
        CONFIG.with_router_settings(settings)
