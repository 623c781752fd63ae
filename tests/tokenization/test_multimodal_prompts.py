"""A chat body with images through `MultimodalPrompts`: its tokens and items, the causes
it falls back to text for (counted), and the client errors it refuses with."""

from __future__ import annotations

import base64
import io
import sys
from typing import Any

import pytest
from PIL import Image

from quillcache.tokenization.local import ByteTokenizer
from quillcache.tokenization.media_fetch import MediaError
from quillcache.tokenization.multimodal import (
    BUILTIN_IMAGE_TOKEN_ID,
    MultimodalConfig,
    MultimodalPrompts,
    MultimodalUnavailable,
    image_hash,
    open_image,
)


def url(size: tuple[int, int] = (33, 16), mode: str = "RGB") -> str:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}], **extra}


def image(u: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": u}, **extra}


def test_tokens_and_items() -> None:
    mm = MultimodalPrompts(MultimodalConfig(hash_algorithm="sha256"))
    prompt = mm.prompt_now(
        ByteTokenizer(),
        body({"type": "text", "text": "ab"}, image(url()), image(url((8, 8)), uuid="u-1")),
        "m",
    )
    head = len(b"<|user|>ab")
    assert [(it.offset, it.length) for it in prompt.items] == [(head, 3 * 1), (head + 3, 1)]
    assert prompt.items[1].identifier == "u-1"  # the client's uuid, as vLLM uses it
    assert prompt.tokens[head : head + 4] == [BUILTIN_IMAGE_TOKEN_ID] * 4
    text = bytes(t for t in prompt.tokens if t != BUILTIN_IMAGE_TOKEN_ID).decode()
    assert text == ByteTokenizer().apply_chat_template([{"role": "user", "content": "ab"}], True)
    assert mm.stats.keyed == 1 and mm.stats.items == 2


def test_the_configured_model_id_is_the_one_hashed() -> None:
    """vLLM hashes an image with its --model (a path, /v1/models `root`), which a served
    name (`--served-model-name`, what the gateway's worker knows) does not tell: seen
    against real vLLM (tests/online/test_real_vllm_vlm.py)."""
    u = url((40, 30))
    data = base64.b64decode(u.split(",", 1)[1])
    expected = image_hash("sha256", "/models/qwen2-vl", data, open_image(data).converted)
    for model_id, configured in (("served-name", "/models/qwen2-vl"), ("/models/qwen2-vl", None)):
        mm = MultimodalPrompts(MultimodalConfig(hash_algorithm="sha256", model_id=configured))
        (item,) = mm.prompt_now(ByteTokenizer(), body(image(u)), model_id).items
        assert item.identifier == expected
    unset = MultimodalPrompts(MultimodalConfig(hash_algorithm="sha256"))
    (item,) = unset.prompt_now(ByteTokenizer(), body(image(u)), "served-name").items
    assert item.identifier != expected  # the served name is another model id


@pytest.mark.parametrize(
    ("request_body", "reason"),
    [
        (body(image(url()), mm_processor_kwargs={"x": 1}), "kwargs"),
        (body({"type": "image_url", "uuid": "only"}), "uuid_only"),
        (body({"type": "input_audio", "input_audio": {}}), "unsupported_part"),
    ],
)
def test_fallbacks_name_their_cause(request_body: dict[str, Any], reason: str) -> None:
    mm = MultimodalPrompts(MultimodalConfig(hash_algorithm="sha256"))
    with pytest.raises(MultimodalUnavailable) as exc:
        mm.prompt_now(ByteTokenizer(), request_body, "m")
    assert exc.value.reason == reason
    mm.fallback(exc.value)
    assert mm.stats.fallbacks == {reason: 1}


def test_a_missing_blake3_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "blake3", None)  # `import blake3` raises ImportError
    with pytest.raises(MultimodalUnavailable, match="blake3"):
        MultimodalPrompts().prompt_now(ByteTokenizer(), body(image(url())), "m")


@pytest.mark.parametrize(
    ("parts", "cause"),
    [
        ([{"type": "text", "text": "see <|image|>"}, image(url())], "placeholder"),
        ([image(url((4000, 4000)))], "max_image_pixels"),
        ([{"type": "image_url", "image_url": {"url": 7}}], "must be a string"),
        ([{"type": "image_url"}], "needs 'image_url.url'"),
        ([image(url((2, 2)))] * 3, "multimodal.max_images"),
    ],
)
def test_client_errors(parts: list[dict[str, Any]], cause: str) -> None:
    mm = MultimodalPrompts(
        MultimodalConfig(hash_algorithm="sha256", max_image_pixels=1_000_000, max_images=2)
    )
    with pytest.raises(MediaError, match=cause):
        mm.prompt_now(ByteTokenizer(), body(*parts), "m")
    assert mm.stats.refused == 1


def test_qwen2_vl_style_placeholder_text_and_smart_resize_count() -> None:
    """Each image becomes `placeholder_text` (vision start, the pad, vision end): the
    text around the pad is prompt text, only the pad is expanded, to the smart_resize
    count (a 300 x 200 image at patch 14, merge 2: 11 x 7 cells)."""
    mm = MultimodalPrompts(
        MultimodalConfig(
            hash_algorithm="sha256",
            placeholder="<P>",
            placeholder_text="[vs]<P>[ve]",
            image_tokens="smart_resize",
            patch_size=14,
            merge_size=2,
        )
    )
    prompt = mm.prompt_now(ByteTokenizer(), body(image(url((300, 200)))), "m")
    (item,) = prompt.items
    assert item.length == round(200 / 28) * round(300 / 28) == 77
    before = bytes(prompt.tokens[: item.offset]).decode()
    after = bytes(prompt.tokens[item.offset + item.length :]).decode()
    assert before.endswith("[vs]") and after.startswith("[ve]")
    assert set(prompt.tokens[item.offset : item.offset + item.length]) == {BUILTIN_IMAGE_TOKEN_ID}


def test_a_strip_the_processor_refuses_is_a_client_error() -> None:
    mm = MultimodalPrompts(MultimodalConfig(hash_algorithm="sha256", image_tokens="smart_resize"))
    with pytest.raises(MediaError, match="aspect ratio"):
        mm.prompt_now(ByteTokenizer(), body(image(url((1, 300)))), "m")
    assert mm.stats.refused == 1


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"placeholder_text": "no pad here"}, "placeholder_text"),
        ({"placeholder_text": "<|image|><|image|>"}, "placeholder_text"),
        ({"tokens_per_image": 4, "image_tokens": "smart_resize"}, "tokens_per_image"),
        ({"resize_min_pixels": 10_000, "resize_max_pixels": 100}, "resize_min_pixels"),
    ],
)
def test_inconsistent_settings_are_refused(settings: dict[str, Any], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        MultimodalConfig(**settings)
