"""Chat prompts with images: their token ids and the multimodal items vLLM hashes into blocks.

vLLM (0.32) keys a block that overlaps an image with `("mm", identifier, offset)` extra
keys (`_gen_mm_extra_hash_keys` in `vllm/v1/core/kv_cache_utils.py`): the item's
identifier and where it starts relative to the block. QuillCache's content key folds
the same pairs into `mm_i` (docs/content-key.md), so the gateway must know, for each
`image_url` part of a chat request:

* the identifier: the client's `uuid` on the part when vLLM uses it as is (no
  `mm_processor_kwargs` / `media_io_kwargs` in the request), else vLLM's
  `MultiModalHasher.hash_kwargs(algorithm, model_id=<the engine's model>, image=...)`
  (`vllm/multimodal/processing/inputs.py` `get_mm_hashes`). vLLM loads an image URL as
  `MediaWithBytes` (`vllm/multimodal/media/image.py`), which hashes the *encoded* bytes
  as received, plus the RGB conversion settings when the image is not RGB
  (`vllm/multimodal/hasher.py`); `image_hash` reproduces that byte stream;
* its placeholder range: where in the prompt its tokens lie and how many there are.
  The count is the model processor's; the gateway knows three rules
  (`ImagePlaceholders`): a fixed count per image (LLaVA-1.5-style models), one token
  per `patch_size` x `patch_size` tile of the image (what the engine simulator models),
  or the Qwen2-VL family's `smart_resize` (the image resized to multiples of
  `patch_size * merge_size` within a pixel range, one token per merged patch).

A request whose items cannot be computed here (an optional dependency missing, an
engine that tokenizes, kwargs that change vLLM's hash, a part type other than
`image_url`) is routed on its text alone: it matches nothing, as before; the cause is
counted in `MultimodalPrompts.fallbacks` and logged once. An image that cannot be
loaded is the client's error (`MediaError`, a 400).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import io
import logging
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quillcache.errors import QuillCacheError
from quillcache.tokenization.local import ByteTokenizer, Message, Tokenizer
from quillcache.tokenization.media_fetch import (
    MediaError,
    MediaFetcher,
    MediaLimits,
)

log = logging.getLogger(__name__)

HashAlgorithm = Literal["blake3", "sha256", "sha512"]
#: vLLM's `--mm-hasher-algorithm` values; blake3 is its default.
HASH_ALGORITHMS: tuple[HashAlgorithm, ...] = ("blake3", "sha256", "sha512")
#: vLLM's VLLM_MAX_IMAGE_PIXELS default.
MAX_IMAGE_PIXELS = 178_956_970
#: The image token of the builtin (byte) tokenizer: past the 256 byte ids.
BUILTIN_IMAGE_TOKEN_ID = 256
#: The RGB conversion settings vLLM hashes with a non-RGB image (ImageMediaIO defaults).
_RGB_IO_CONFIG: dict[str, object] = {
    "image_mode": "RGB",
    "rgba_background_color": (255, 255, 255),
}

#: Per block: None, or its multimodal items as (identifier, offset in the block).
MmBlocks = list[list[tuple[str, int]] | None]


class MultimodalUnavailable(QuillCacheError):
    """The gateway cannot compute this request's items (not the client's fault)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class MultimodalConfig(BaseModel):
    """`multimodal:` in the gateway's config (docs/gateway.md, "Multimodal prompts")."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="compute multimodal keys at all")
    hash_algorithm: HashAlgorithm = Field(
        default="blake3", description="the engines' --mm-hasher-algorithm (vLLM's default)"
    )
    model_id: str | None = Field(
        default=None,
        min_length=1,
        description="the model vLLM hashes images with, overriding what the gateway "
        "reads (the serving worker's /v1/models `root`: its --model)",
    )
    fetch: bool = Field(default=False, description="fetch http(s) image URLs")
    max_image_bytes: int = Field(default=20 << 20, gt=0, description="per image, encoded")
    max_image_pixels: int = Field(default=MAX_IMAGE_PIXELS, gt=0)
    max_images: int = Field(default=16, gt=0, description="image parts per request")
    fetch_timeout_s: float = Field(default=5.0, gt=0, description="per image, DNS included")
    fetch_allow: list[str] = Field(
        default_factory=list,
        description="non-public addresses, networks or host names fetches may reach",
    )
    placeholder: str = Field(
        default="<|image|>", min_length=1, description="the image's text in the chat template"
    )
    image_token_id: int | None = Field(
        default=None, ge=0, description="the image token (None: the placeholder's one token)"
    )
    placeholder_text: str | None = Field(
        default=None,
        description="the text an image part becomes, containing the placeholder once "
        "(None: the placeholder alone); e.g. Qwen2-VL's vision start and end around it",
    )
    image_tokens: Literal["patches", "smart_resize"] = Field(
        default="patches",
        description="how many tokens an image takes: one per patch_size tile, or the "
        "Qwen2-VL family's smart_resize (ignored when tokens_per_image is set)",
    )
    tokens_per_image: int | None = Field(
        default=None, gt=0, description="a fixed count per image (None: image_tokens' rule)"
    )
    patch_size: int = Field(default=16, gt=0, description="pixels per side of a patch")
    merge_size: int = Field(
        default=2, gt=0, description="smart_resize: patches merged per side into one token"
    )
    resize_min_pixels: int = Field(
        default=56 * 56, gt=0, description="smart_resize: the processor's min_pixels"
    )
    resize_max_pixels: int = Field(
        default=28 * 28 * 1280, gt=0, description="smart_resize: the processor's max_pixels"
    )

    @model_validator(mode="after")
    def _consistent(self) -> MultimodalConfig:
        text = self.placeholder_text
        if text is not None and text.count(self.placeholder) != 1:
            raise ValueError(
                "multimodal.placeholder_text must contain multimodal.placeholder exactly once"
            )
        if self.tokens_per_image is not None and self.image_tokens != "patches":
            raise ValueError(
                "multimodal.tokens_per_image (a fixed count) and multimodal.image_tokens: "
                f"{self.image_tokens} are two counts for one image: set one of them"
            )
        if self.resize_min_pixels > self.resize_max_pixels:
            raise ValueError("multimodal.resize_min_pixels is above multimodal.resize_max_pixels")
        return self

    def limits(self) -> MediaLimits:
        return MediaLimits(
            fetch=self.fetch,
            max_bytes=self.max_image_bytes,
            timeout_s=self.fetch_timeout_s,
            allow=tuple(self.fetch_allow),
        )


# -- vLLM's hash of an image ---------------------------------------------------------

_TAG_NONE, _TAG_SEQUENCE, _TAG_MAPPING, _TAG_LEAF = b"\x00", b"\x01", b"\x02", b"\x03"


def _framed(chunk: bytes) -> bytes:
    return struct.pack("<Q", len(chunk)) + chunk


def _value(obj: object) -> bytes:
    """vLLM's tagged encoding of a value (`MultiModalHasher.iter_value_to_bytes`) for the
    types an image's hash input holds."""
    if obj is None:
        return _TAG_NONE
    if isinstance(obj, (list, tuple)):
        return _TAG_SEQUENCE + struct.pack("<Q", len(obj)) + b"".join(_value(v) for v in obj)
    if isinstance(obj, dict):
        head = _TAG_MAPPING + struct.pack("<Q", len(obj))
        return head + b"".join(_framed(str(k).encode()) + _value(v) for k, v in obj.items())
    if isinstance(obj, bytes):
        return _TAG_LEAF + _framed(obj)
    if isinstance(obj, str):
        return _TAG_LEAF + _framed(obj.encode())
    if isinstance(obj, int):  # numpy's default integer: int64
        return _TAG_LEAF + _framed(struct.pack("<q", obj))
    raise TypeError(f"no multimodal hash encoding for {type(obj).__name__}")


def image_hash_input(model_id: str, data: bytes, converted: bool) -> bytes:
    """The bytes vLLM's `hash_kwargs(model_id=..., image=MediaWithBytes)` digests: the
    keyword arguments in sorted order, the image as its encoded bytes (with the RGB
    conversion settings when vLLM converted it)."""
    image: object = {"io_config": _RGB_IO_CONFIG, "data": data} if converted else data
    item = _TAG_LEAF + _framed(b"image") + _value(image)  # serialize_item(MediaWithBytes)
    return _framed(b"image") + item + _framed(b"model_id") + _value(model_id)


def _hasher(algorithm: HashAlgorithm) -> Callable[[], Any]:
    if algorithm == "blake3":
        try:
            # imported by name: an optional dependency, without type information
            module = importlib.import_module("blake3")
        except ImportError:
            raise MultimodalUnavailable(
                "blake3_missing",
                "the engines hash images with blake3 (vLLM's default) and the blake3 "
                "package is not installed (pip install 'quillcache[multimodal]')",
            ) from None
        factory: Callable[[], Any] = module.blake3
        return factory
    return hashlib.sha256 if algorithm == "sha256" else hashlib.sha512


def image_hash(algorithm: HashAlgorithm, model_id: str, data: bytes, converted: bool) -> str:
    """vLLM's multimodal hash (hex) of an image URL's bytes for `model_id`."""
    h = _hasher(algorithm)()
    h.update(image_hash_input(model_id, data, converted))
    return str(h.hexdigest())


# -- images ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedImage:
    """An image as vLLM sees it: its encoded bytes, its size once EXIF-oriented, and
    whether vLLM converts it to RGB (which its hash then records)."""

    data: bytes
    width: int
    height: int
    converted: bool


def open_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> LoadedImage:
    """Decode `data` with Pillow as vLLM's ImageMediaIO does; `MediaError` when it is not
    an image or is too large."""
    try:
        from PIL import Image, ImageOps
    except ImportError:
        raise MultimodalUnavailable(
            "pillow_missing",
            "Pillow is not installed (pip install 'quillcache[multimodal]')",
        ) from None
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > max_pixels:
                raise MediaError(
                    f"image too large: {w}x{h} ({w * h} pixels), the limit is {max_pixels} "
                    "(multimodal.max_image_pixels)"
                )
            try:
                oriented = ImageOps.exif_transpose(img)
            except Exception:  # vLLM ignores broken EXIF data too
                oriented = img
            oriented.load()
            return LoadedImage(data, oriented.width, oriented.height, oriented.mode != "RGB")
    except MediaError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise MediaError(f"cannot decode the image: {exc}") from None


# -- placeholders and blocks -----------------------------------------------------------


@dataclass(frozen=True)
class MmItem:
    """One image of a prompt: its identifier and its placeholder range."""

    identifier: str
    offset: int
    length: int


def block_mm_keys(items: Sequence[MmItem], num_tokens: int, block_size: int) -> MmBlocks:
    """Each full block's (identifier, offset in the block) pairs, as vLLM's
    `_gen_mm_extra_hash_keys` lists them: every item whose range overlaps the block, in
    prompt order, its offset negative when it began in an earlier block."""
    ordered = sorted(items, key=lambda it: it.offset)
    out: MmBlocks = []
    for start in range(0, num_tokens - block_size + 1, block_size):
        end = start + block_size
        keys = [
            (it.identifier, it.offset - start)
            for it in ordered
            if it.offset < end and it.offset + it.length > start
        ]
        out.append(keys or None)
    return out


@dataclass(frozen=True)
class MmPrompt:
    """A chat prompt's token ids, image placeholders expanded, and its items."""

    tokens: list[int]
    items: list[MmItem]

    def blocks(self, block_size: int) -> MmBlocks:
        return block_mm_keys(self.items, len(self.tokens), block_size)


@dataclass(frozen=True)
class ImagePart:
    """An `image_url` part of a chat message: its URL and the client's `uuid`."""

    url: str | None
    uuid: str | None


#: Content part types vLLM reads as media; only image_url has a rule here.
_MEDIA_TYPES = frozenset(
    {
        "image_url",
        "input_image",
        "image_pil",
        "image_embeds",
        "audio_url",
        "input_audio",
        "audio_embeds",
        "video_url",
        "video_embeds",
    }
)


def _parts(messages: Iterable[Message]) -> Iterable[dict[str, Any]]:
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            yield from (p for p in content if isinstance(p, dict))


def has_media(body: dict[str, Any]) -> bool:
    """Whether a chat body has any media part (a cheap scan, no decoding)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    return any(p.get("type") in _MEDIA_TYPES for p in _parts(messages))


def image_parts(messages: Sequence[Message]) -> list[ImagePart]:
    """The image parts in prompt order; `MultimodalUnavailable` for media other than
    images, `MediaError` for a malformed image part."""
    out: list[ImagePart] = []
    for p in _parts(messages):
        kind = p.get("type")
        if kind not in _MEDIA_TYPES:
            continue
        if kind != "image_url":
            raise MultimodalUnavailable("unsupported_part", f"no multimodal keys for {kind!r}")
        spec = p.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        uuid = p.get("uuid")
        if url is not None and not isinstance(url, str):
            raise MediaError("an image_url part's 'url' must be a string")
        if url is None and uuid is None:
            raise MediaError("an image_url part needs 'image_url.url' (or a 'uuid')")
        out.append(ImagePart(url, None if uuid is None else str(uuid)))
    return out


@dataclass(frozen=True)
class ImagePlaceholders:
    """The model's placeholder rule: the image's text in the chat template, its token,
    and how many tokens an image takes."""

    placeholder: str = "<|image|>"
    token_id: int | None = None
    tokens_per_image: int | None = None
    patch_size: int = 16
    image_tokens: Literal["patches", "smart_resize"] = "patches"
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    text: str | None = None  # what an image part becomes (None: the placeholder)

    def count(self, image: LoadedImage) -> int:
        if self.tokens_per_image is not None:
            return self.tokens_per_image
        if self.image_tokens == "smart_resize":
            return smart_resize_tokens(
                image.width,
                image.height,
                self.patch_size * self.merge_size,
                self.min_pixels,
                self.max_pixels,
            )
        p = self.patch_size
        return max(1, math.ceil(image.width / p) * math.ceil(image.height / p))

    def token_of(self, tokenizer: Tokenizer) -> int:
        if self.token_id is not None:
            return self.token_id
        if isinstance(tokenizer, ByteTokenizer):
            return BUILTIN_IMAGE_TOKEN_ID
        ids = tokenizer.encode(self.placeholder)
        if len(ids) != 1:
            raise MultimodalUnavailable(
                "no_image_token",
                f"the placeholder {self.placeholder!r} is {len(ids)} tokens, not one: set "
                "multimodal.image_token_id",
            )
        return ids[0]


def smart_resize_tokens(
    width: int, height: int, factor: int, min_pixels: int, max_pixels: int
) -> int:
    """An image's token count under the Qwen2-VL family's rule (its HF image processor's
    `smart_resize`, as vLLM calls it): both sides rounded to a multiple of `factor`
    (patch size x merge size) keeping the aspect ratio, scaled down when above
    `max_pixels` and up when below `min_pixels`; one token per `factor` x `factor` cell.
    An aspect ratio above 200 is refused there, so it is a `MediaError` here."""
    if max(width, height) > 200 * min(width, height):
        raise MediaError(
            f"image aspect ratio {max(width, height) / min(width, height):.0f} is above "
            "200, which the model's processor refuses"
        )
    h = round(height / factor) * factor  # Python's round, as the processor's
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return (h // factor) * (w // factor)


def render(
    tokenizer: Tokenizer,
    messages: Sequence[Message],
    counts: Sequence[int],
    rule: ImagePlaceholders,
) -> tuple[list[int], list[tuple[int, int]]]:
    """The chat prompt's token ids with image i expanded to `counts[i]` image tokens, and
    each image's (offset, length). Each image part becomes the placeholder text in its
    message; the rendered text is tokenized between placeholders."""
    ph = rule.placeholder
    flat: list[Message] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            text = []
            for p in content:
                if not isinstance(p, dict):
                    continue
                if p.get("type") == "text":
                    piece = str(p.get("text", ""))
                    if ph in piece:
                        raise MediaError(f"message text may not contain the placeholder {ph!r}")
                    text.append(piece)
                elif p.get("type") == "image_url":
                    text.append(rule.text or ph)
            m = {**m, "content": "".join(text)}
        elif isinstance(content, str) and ph in content:
            raise MediaError(f"message text may not contain the placeholder {ph!r}")
        flat.append(m)
    segments = tokenizer.apply_chat_template(flat, True).split(ph)
    if len(segments) != len(counts) + 1:
        raise MultimodalUnavailable(
            "template",
            f"the chat template rendered {len(segments) - 1} image placeholders for "
            f"{len(counts)} images",
        )
    token = rule.token_of(tokenizer)
    tokens: list[int] = tokenizer.encode(segments[0])
    ranges: list[tuple[int, int]] = []
    for n, seg in zip(counts, segments[1:], strict=True):
        ranges.append((len(tokens), n))
        tokens.extend([token] * n)
        tokens.extend(tokenizer.encode(seg))
    return tokens, ranges


# -- the request side ------------------------------------------------------------------


@dataclass
class MultimodalStats:
    """Counts of the gateway's multimodal work (`quillcache_multimodal_*` in the
    gateway's metrics)."""

    keyed: int = 0  # requests routed with multimodal keys
    items: int = 0  # images identified
    fetched: int = 0  # images fetched by URL
    refused: int = 0  # requests answered 400 (MediaError)
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)


class MultimodalPrompts:
    """Turns a chat body with images into an `MmPrompt`, per `MultimodalConfig`."""

    def __init__(self, config: MultimodalConfig | None = None) -> None:
        self.config = config or MultimodalConfig()
        self.fetcher = MediaFetcher(self.config.limits())
        c = self.config
        self.rule = ImagePlaceholders(
            placeholder=c.placeholder,
            token_id=c.image_token_id,
            tokens_per_image=c.tokens_per_image,
            patch_size=c.patch_size,
            image_tokens=c.image_tokens,
            merge_size=c.merge_size,
            min_pixels=c.resize_min_pixels,
            max_pixels=c.resize_max_pixels,
            text=c.placeholder_text,
        )
        self.stats = MultimodalStats()
        self._logged: set[str] = set()

    def fallback(self, exc: MultimodalUnavailable) -> None:
        """Count (and log once per cause) a request routed without multimodal keys."""
        self.stats.fallbacks[exc.reason] = self.stats.fallbacks.get(exc.reason, 0) + 1
        if exc.reason not in self._logged:
            self._logged.add(exc.reason)
            log.warning("multimodal request routed without multimodal keys: %s", exc)

    def _check(self, body: dict[str, Any]) -> list[ImagePart]:
        if not self.config.enabled:
            raise MultimodalUnavailable("disabled", "multimodal.enabled is off")
        for key in ("mm_processor_kwargs", "media_io_kwargs"):
            if body.get(key):
                raise MultimodalUnavailable(
                    "kwargs", f"the request's {key} change vLLM's hash; not reproduced"
                )
        parts = image_parts(body["messages"])
        if len(parts) > self.config.max_images:
            raise MediaError(
                f"too many images: {len(parts)}, the limit is {self.config.max_images} "
                "(multimodal.max_images)"
            )
        if any(p.url is None for p in parts):
            raise MultimodalUnavailable(
                "uuid_only", "an image given by uuid alone has no size to count its tokens"
            )
        if any(p.uuid is None for p in parts):
            _hasher(self.config.hash_algorithm)  # a missing blake3 before any work
        return parts

    def needs_fetch(self, body: dict[str, Any]) -> bool:
        """Whether the body names an image URL this gateway would fetch."""
        messages = body.get("messages")
        if not self.config.fetch or not isinstance(messages, list):
            return False
        for p in _parts(messages):
            spec = p.get("image_url") if p.get("type") == "image_url" else None
            url = spec.get("url") if isinstance(spec, dict) else spec
            if isinstance(url, str) and url[:5].lower() != "data:":
                return True
        return False

    def _prompt(
        self,
        tokenizer: Tokenizer,
        body: dict[str, Any],
        model_id: str,
        parts: Sequence[ImagePart],
        blobs: Sequence[bytes],
    ) -> MmPrompt:
        # vLLM hashes with its --model, not the served name the gateway may know it by
        model_id = self.config.model_id or model_id
        images = [open_image(b, self.config.max_image_pixels) for b in blobs]
        tokens, ranges = render(
            tokenizer, body["messages"], [self.rule.count(i) for i in images], self.rule
        )
        items = [
            MmItem(
                p.uuid
                if p.uuid is not None
                else image_hash(self.config.hash_algorithm, model_id, img.data, img.converted),
                offset,
                length,
            )
            for p, img, (offset, length) in zip(parts, images, ranges, strict=True)
        ]
        self.stats.keyed += 1
        self.stats.items += len(items)
        return MmPrompt(tokens, items)

    def prompt_now(self, tokenizer: Tokenizer, body: dict[str, Any], model_id: str) -> MmPrompt:
        """The prompt of a body whose images are all data URLs (no awaiting)."""
        try:
            parts = self._check(body)
            blobs = []
            for p in parts:
                assert p.url is not None
                data = self.fetcher.load_now(p.url)
                if data is None:
                    raise MediaError("this image URL is fetched only on the awaiting path")
                blobs.append(data)
            return self._prompt(tokenizer, body, model_id, parts, blobs)
        except MediaError:
            self.stats.refused += 1
            raise

    async def prompt(self, tokenizer: Tokenizer, body: dict[str, Any], model_id: str) -> MmPrompt:
        """The prompt of a chat body with images, fetching URLs when enabled."""
        try:
            parts = self._check(body)
            blobs = []
            for p in parts:
                assert p.url is not None
                blobs.append(await self.fetcher.load(p.url))
                self.stats.fetched += p.url[:5].lower() != "data:"
            return self._prompt(tokenizer, body, model_id, parts, blobs)
        except MediaError:
            self.stats.refused += 1
            raise
