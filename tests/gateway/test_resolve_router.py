"""The gateway's `router:` setting: a user's router class takes the options every
router takes (the default SLO), and bad options are a ConfigError naming the router."""

from __future__ import annotations

import pytest

from quillcache.errors import ConfigError
from quillcache.gateway.app import resolve_router
from quillcache.routing import SLO, Router, default_slo

SPEC = "tests.online.custom_router:HighestWorker"


def test_a_users_router_takes_a_default_slo() -> None:
    router = resolve_router(SPEC, {"ttft_slo_s": 0.5})
    assert isinstance(router, Router)
    assert default_slo(router) == SLO(ttft_s=0.5)


@pytest.mark.parametrize(
    ("options", "words"),
    [({"ttft_slo_s": -1}, "ttft_slo_s"), ({"no_such_option": 1}, "no_such_option")],
)
def test_bad_router_options_are_named(options: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        resolve_router(SPEC, options)


def test_an_unknown_class_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot import"):
        resolve_router("tests.online.custom_router:Nope", {})
