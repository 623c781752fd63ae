"""Hot prefixes' copies (`policy.hot`): tenant-scoped, cut at the anchor, bounded.

The keys are the gateway's own (`identity.content_keys` in the namespace each owner's
salt derives), so a copy can be checked the way an engine would see it: its tokens,
hashed in its owner's namespace, end in the copy's key.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.errors import ConfigError
from quillcache.identity import content_keys, namespace
from quillcache.policy.heat import anchor_depths
from quillcache.policy.hot import HotPrefixes, Owner

BS = 4
OWNERS = [
    Owner("acme", "salt-acme", "m"),
    Owner("other", "salt-other", "m"),
    Owner("acme", "salt-acme", "m2"),
]


def keys_of(tokens: list[int], owner: Owner) -> np.ndarray:
    ns = namespace(owner.model, "tok", "", owner.salt or "", BS)
    return np.asarray(content_keys(tokens, BS, ns), dtype=np.uint64)


prompts = st.lists(
    st.tuples(
        st.integers(0, len(OWNERS) - 1),  # owner
        st.integers(0, 2),  # which shared stem
        st.integers(0, 6),  # stem blocks
        st.lists(st.integers(0, 50), max_size=3 * BS),  # own tail
        st.floats(0, 0.5),  # time step
    ),
    max_size=60,
)
STEMS = [[i * 7 + s for i in range(6 * BS)] for s in range(3)]


@settings(max_examples=200, deadline=None)
@given(prompts, st.integers(0, 40), st.floats(0.05, 3.0))
def test_copies_are_their_owners_prefixes_and_bounded(
    requests: list[tuple[int, int, int, list[int], float]], max_tokens: int, min_rate: float
) -> None:
    hot = HotPrefixes(block_size=BS, min_rate=min_rate, half_life_s=1.0, max_tokens=max_tokens)
    seen: dict[int, set[tuple[Owner, tuple[int, ...]]]] = {}  # anchor key -> (owner, prefix)
    now = 0.0
    for who, stem, blocks, tail, dt in requests:
        now += dt
        owner = OWNERS[who]
        tokens = STEMS[stem][: blocks * BS] + tail
        keys = keys_of(tokens, owner)
        for d in anchor_depths(len(keys)):
            for n in range(d, len(keys) + 1):
                seen.setdefault(int(keys[d - 1]), set()).add((owner, tuple(tokens[: n * BS])))
        hot.observe(keys, tokens, owner, now)
        assert hot.tokens <= max_tokens
        hot.hot(now)
        kept = [copy for k in seen if (copy := hot.copy_of(k)) is not None]
        assert hot.tokens == sum(len(tokens) for _, tokens in kept)
        for c in hot.hot(now):
            # the copy is a prefix some request of its owner had through this anchor ...
            assert (c.owner, tuple(c.token_ids)) in seen[c.prefix.key]
            # ... and in that owner's namespace those tokens hash to exactly the anchor's
            # key and the copy's keys: sent with that salt, the replica fills the
            # namespace its owner reads
            copied = keys_of(c.token_ids, c.owner)
            assert int(copied[c.prefix.blocks - 1]) == c.prefix.key
            assert copied.tolist() == c.keys.tolist()
            assert c.prefix.rate >= min_rate
            assert c.prefix.blocks <= len(c.keys) < 2 * c.prefix.blocks


def test_only_hot_prefixes_are_copied_and_each_tenant_gets_its_own() -> None:
    hot = HotPrefixes(block_size=BS, min_rate=1.0, half_life_s=10.0)
    stem = STEMS[0][: 4 * BS]
    acme, other = OWNERS[0], OWNERS[1]
    for i in range(3):  # 3 requests in no time: rate 3 / tau < 1
        hot.observe(keys_of([*stem, i], acme), [*stem, i], acme, 0.0)
    assert len(hot) == 0 and hot.hot(0.0) == []
    for i in range(40):
        hot.observe(keys_of([*stem, i], acme), [*stem, i], acme, 0.0)
    (c,) = hot.hot(0.0)  # the 4-block anchor: the shallower ones are covered by it
    assert c.owner == acme and c.token_ids == stem and c.prefix.blocks == 4
    # a 6-block shared prompt is hot at its 4-block anchor; the copy is cut back to the
    # 6 blocks the anchor's requests share
    six = STEMS[2][: 6 * BS]
    for i in range(40):
        hot.observe(keys_of(six + [i] * BS, acme), six + [i] * BS, acme, 0.0)
    (c6,) = [c for c in hot.hot(0.0) if c.token_ids[:BS] == six[:BS]]
    assert c6.prefix.blocks == 4 and c6.token_ids == six
    # the same text from another tenant is another namespace: its own heat, its own copy
    for i in range(40):
        hot.observe(keys_of([*stem, i], other), [*stem, i], other, 0.0)
    owners = {c.owner.tenant: c for c in hot.hot(0.0)}
    assert set(owners) == {"acme", "other"}
    assert owners["acme"].prefix.key != owners["other"].prefix.key
    # a shared namespace (same key, another owner) keeps the first owner's copy
    intruder = Owner("intruder", "salt-acme", "m")
    hot.observe(keys_of(stem, acme), stem, intruder, 0.0)
    assert {c.owner.tenant for c in hot.hot(0.0)} == {"acme", "other"}


def test_copies_go_with_their_anchor_and_cool_down() -> None:
    hot = HotPrefixes(block_size=BS, min_rate=1.0, half_life_s=1.0, max_anchors=4)
    stem, acme = STEMS[1][: 2 * BS], OWNERS[0]
    for _ in range(10):
        hot.observe(keys_of(stem, acme), stem, acme, 0.0)
    assert [c.prefix.blocks for c in hot.hot(0.0)] == [2]
    assert hot.hot(30.0) == []  # cooled down below min_rate
    for s in range(8):  # other anchors push it out of the tracker: its copy goes too
        tokens = [100 + s] * BS
        hot.observe(keys_of(tokens, acme), tokens, acme, 31.0)
    hot.hot(31.0)
    assert all(c.token_ids != stem for c in hot.hot(31.0)) and hot.tokens <= 4 * BS


def test_bad_settings_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="min_rate"):
        HotPrefixes(block_size=BS, min_rate=0.0)
    with pytest.raises(ConfigError, match="block_size"):
        HotPrefixes(block_size=0, min_rate=1.0)
