"""The gateway's multimodal items against vLLM 0.32's own code, in the real-vLLM venv.

Random chat prompts with images (PNG / JPEG / GIF / BMP, modes RGB, RGBA, L, P, LA; some
parts with a client `uuid`; hash algorithms sha256, sha512 and blake3) go through the
gateway's path (`MultimodalPrompts.prompt_now` with the builtin tokenizer). The images'
bytes, the resulting token ids and placeholder ranges then go to vLLM
(`tests/tokenization/vllm_mm_reference.py`, run by the vLLM interpreter), which loads
each image with its `ImageMediaIO`, hashes it with `ProcessorInputs.get_mm_hashes`,
lists each block's extra keys with `generate_block_hash_extra_keys` on a real
`vllm.v1.request.Request`, and hashes the blocks with its sha256_cbor block hasher.
Checked equal: every item's identifier, every block's `("mm", id, offset)` keys, and
every block hash (the gateway's `vllm_block_hashes` with those extra keys).

The placeholder *count* is the model processor's: for the Qwen2-VL family
(`image_tokens: smart_resize`) it is checked against transformers' own
`Qwen2VLImageProcessorPil` in the same venv (`qwen2vl_count_reference.py`), which vLLM
calls for those models; the `patches` rule is the engine simulator's by construction.

SKIPPED with the reason when QUILLCACHE_VLLM_PYTHON names no usable vLLM interpreter.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from benchmarks.realvllm.launcher import ENV_VAR
from quillcache.hashing import vllm_block_hashes
from quillcache.tokenization.local import ByteTokenizer
from quillcache.tokenization.media_fetch import MediaError
from quillcache.tokenization.multimodal import (
    MultimodalConfig,
    MultimodalPrompts,
    smart_resize_tokens,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

REFERENCE = Path(__file__).with_name("vllm_mm_reference.py")
COUNT_REFERENCE = Path(__file__).with_name("qwen2vl_count_reference.py")
FORMATS = {"PNG": ("RGB", "RGBA", "L", "P", "LA"), "JPEG": ("RGB", "L"), "GIF": ("P",)}
FORMATS["BMP"] = ("RGB", "L")
# blake3 (vLLM's default) when this interpreter has the multimodal extra's package
ALGORITHMS = ["sha256", "sha512"] + (["blake3"] if importlib.util.find_spec("blake3") else [])


def _vllm_python() -> str:
    py = os.environ.get(ENV_VAR, "")
    if not py or not Path(py).is_file():
        pytest.skip(f"multimodal vLLM parity skipped: {ENV_VAR} names no vLLM interpreter")
    return py


def _image(rng: random.Random) -> bytes:
    fmt = rng.choice(sorted(FORMATS))
    mode = rng.choice(FORMATS[fmt])
    size = (rng.randint(1, 90), rng.randint(1, 90))
    img = Image.new(mode, size)
    img.putdata(
        [tuple(rng.randrange(256) for _ in mode) if len(mode) > 1 else rng.randrange(256)]
        * (size[0] * size[1])
    )
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def _case(rng: random.Random) -> tuple[dict[str, Any], dict[str, Any]]:
    """(a chat body, what the gateway made of it)."""
    algorithm = rng.choice(ALGORITHMS)
    content: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.7:
            content.append({"type": "text", "text": "x" * rng.randint(0, 40)})
        data = _image(rng)
        blobs.append(data)
        part: dict[str, Any] = {
            "type": "image_url",
            "image_url": {"url": "data:image/x;base64," + base64.b64encode(data).decode()},
        }
        if rng.random() < 0.25:
            part["uuid"] = f"client-{rng.randrange(1 << 30)}"
        content.append(part)
    body = {"messages": [{"role": "user", "content": content}]}
    model_id = rng.choice(["org/tiny-vlm", "/models/ünïcode-vlm"])
    prompts = MultimodalPrompts(
        MultimodalConfig(hash_algorithm=algorithm, patch_size=rng.choice([8, 14, 16, 32]))
    )
    mm = prompts.prompt_now(ByteTokenizer(), body, model_id)
    block_size = rng.choice([1, 4, 16, 32])
    parts = [p for p in content if p["type"] == "image_url"]
    vllm_case = {
        "model_id": model_id,
        "algorithm": algorithm,
        "images": [
            {"data": base64.b64encode(b).decode(), "uuid": p.get("uuid")}
            for b, p in zip(blobs, parts, strict=True)
        ],
        "tokens": mm.tokens,
        "ranges": [[it.offset, it.length] for it in mm.items],
        "block_size": block_size,
    }
    ours = {
        "hashes": [it.identifier for it in mm.items],
        "blocks": mm.blocks(block_size),
        "tokens": mm.tokens,
        "block_size": block_size,
    }
    return vllm_case, ours


def _run(python: str, script: Path, payload: dict[str, Any]) -> Any:
    proc = subprocess.run(
        [python, str(script)],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=500,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_items_extra_keys_and_block_hashes_equal_vllms() -> None:
    python = _vllm_python()
    rng = random.Random(20261205)
    cases = [_case(rng) for _ in range(60)]
    theirs = _run(python, REFERENCE, {"cases": [c for c, _ in cases]})
    assert len(theirs) == len(cases)
    for i, ((_, ours), vllm) in enumerate(zip(cases, theirs, strict=True)):
        assert ours["hashes"] == vllm["hashes"], i
        expected = [[(k[1], k[2]) for k in keys] if keys else None for keys in vllm["extra_keys"]]
        assert ours["blocks"] == expected, i
        extra = [[("mm", h, off) for h, off in b] if b else None for b in ours["blocks"]]
        digests = vllm_block_hashes(ours["tokens"], ours["block_size"], extra_keys=extra)
        assert [d.hex() for d in digests] == vllm["block_hashes"], i


def _size(rng: random.Random) -> tuple[int, int]:
    kind = rng.random()
    if kind < 0.1:  # a strip: near or past the processor's aspect-ratio limit
        return rng.randint(1, 12), rng.randint(150, 2048)
    if kind < 0.3:  # small: scaled up to min_pixels
        return rng.randint(1, 80), rng.randint(1, 80)
    return rng.randint(1, 2048), rng.randint(1, 2048)


def test_smart_resize_counts_equal_the_qwen2_vl_processors() -> None:
    """Random sizes (strips, tiny images, large ones), patch 14 or 16, merge 1 or 2, and
    the pixel ranges of the Qwen2-VL processor's defaults, Qwen2-VL-7B-Instruct's
    preprocessor config, and a small deployment's: the same count, or both refuse."""
    python = _vllm_python()
    rng = random.Random(20261206)
    ranges = [(56 * 56, 28 * 28 * 1280), (3136, 12845056), (256 * 28 * 28, 512 * 28 * 28)]
    cases = []
    for _ in range(240):
        w, h = _size(rng)
        if rng.random() < 0.5:
            w, h = h, w
        lo, hi = rng.choice(ranges)
        cases.append(
            {
                "width": w,
                "height": h,
                "patch_size": rng.choice([14, 16]),
                "merge_size": rng.choice([1, 2]),
                "min_pixels": lo,
                "max_pixels": hi,
            }
        )
    theirs = _run(python, COUNT_REFERENCE, {"cases": cases})
    ours: list[int | None] = []
    for c in cases:
        try:
            ours.append(
                smart_resize_tokens(
                    c["width"],
                    c["height"],
                    c["patch_size"] * c["merge_size"],
                    c["min_pixels"],
                    c["max_pixels"],
                )
            )
        except MediaError:
            ours.append(None)
    assert None in theirs and len(set(theirs)) > 50  # the cases reach both outcomes
    assert ours == theirs
