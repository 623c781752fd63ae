"""Redis URLs as the gateway takes them: refused with a message naming what is wrong
when the configuration is read (not a traceback when it connects), and never shown with
their password; credentials or a database the server refuses stop the start-up."""

from __future__ import annotations

import asyncio
import logging

import pytest

from quillcache.errors import ConfigError
from quillcache.gateway.config import GatewayConfig
from quillcache.state import RedisFleetState
from quillcache.state.urls import checked, redacted
from tests.state.server import RedisServer


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis://127.0.0.1:notaport/0", "Port could not be cast"),
        ("redis://127.0.0.1:99999/0", "Port out of range"),
        ("redis://[::1/0", "IPv6"),
        ("redis://127.0.0.1:6379/0?socket_timeout=abc", "socket_timeout"),
        ("redis://127.0.0.1:6379/0?foo=bar", "foo"),
        ("redis://127.0.0.1:6379/abc", "'abc' in the path is not a number"),
        ("http://127.0.0.1:6379", "redis://, rediss:// or unix://"),
        ("127.0.0.1:6379", "redis://, rediss:// or unix://"),
    ],
)
def test_a_malformed_state_url_is_a_config_error_naming_it(url: str, words: str) -> None:
    with pytest.raises(ValueError, match="state must be 'local' or a Redis URL") as refused:
        GatewayConfig.model_validate({"workers": [], "state": url})
    assert words in str(refused.value)


def test_good_urls_pass_and_the_scheme_is_case_insensitive() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://h:1/2", "unix:///tmp/r.sock?db=3"):
        assert checked(url) == url
    assert checked("REDIS://u:p@h:1/0") == "redis://u:p@h:1/0"
    cfg = GatewayConfig.model_validate({"workers": [], "state": "Redis://127.0.0.1:6379"})
    assert cfg.state == "redis://127.0.0.1:6379"


def test_passwords_are_never_shown() -> None:
    assert redacted("redis://default:s3cret@127.0.0.1:6379/0") == (
        "redis://default:***@127.0.0.1:6379/0"
    )
    assert redacted("redis://:s3cret@[::1]:7/0") == "redis://:***@[::1]:7/0"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    with pytest.raises(ValueError) as refused:
        checked("redis://default:s3cret@127.0.0.1:notaport/0")
    assert "s3cret" not in str(refused.value)


def _start(url: str) -> None:
    async def main() -> None:
        state = RedisFleetState(url, prefix="urls", budget_s=1.0)
        try:
            await state.start(background=False)
        finally:
            await state.close(leave=False)

    asyncio.run(asyncio.wait_for(main(), 20))


def test_credentials_or_a_database_the_server_refuses_stop_the_start(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong password or a database out of range is a configuration error, not an
    outage to retry forever; the message never shows the password."""
    base = redis_server.url.rsplit("/", 1)[0]  # redis://127.0.0.1:PORT
    with_password = base.replace("redis://", "redis://someone:s3cret@") + "/0"
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as refused:
        _start(with_password)
    assert "refuses this replica" in str(refused.value)
    assert "s3cret" not in str(refused.value) + caplog.text
    with pytest.raises(ConfigError, match="no such database"):
        _start(base + "/999")
    _start(base + "/1")  # a database that exists starts
