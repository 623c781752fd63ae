"""`policy.replication` in the gateway config: defaults, and bad values named."""

from __future__ import annotations

import pytest

from quillcache.errors import ConfigError
from quillcache.gateway.config import load_config


def test_replication_is_off_by_default() -> None:
    rep = load_config().policy.replication
    assert rep.enabled is False and rep.low_wait_s <= rep.high_wait_s


@pytest.mark.parametrize(
    ("replication", "named"),
    [
        ({"min_rate": 0}, "policy.replication.min_rate"),
        ({"min_blocks": 0}, "policy.replication.min_blocks"),
        ({"high_wait_s": -1}, "policy.replication.high_wait_s"),
        ({"max_replicas": -1}, "policy.replication.max_replicas"),
        ({"low_wait_s": 0.5, "high_wait_s": 0.1}, "policy.replication: Value error, low_wait_s"),
        ({"enable": True}, "policy.replication.enable"),  # a typo is refused, not ignored
    ],
)
def test_bad_replication_settings_name_their_key(
    replication: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(policy={"replication": replication})
    assert named in str(info.value)
