"""Run by the real-vLLM interpreter (not collected by pytest): vLLM 0.32's own multimodal
hashes, block extra keys and sha256_cbor block hashes for the cases on stdin (JSON), as
JSON on stdout. Each case: model_id, algorithm, images [{data: base64, uuid}], tokens,
ranges [[offset, length]] (one per image), block_size, kwargs (the request's
mm_processor_kwargs, or null)."""

from __future__ import annotations

import base64
import json
import sys
from typing import Any


def main() -> None:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.parse import MultiModalDataParser
    from vllm.multimodal.processing.inputs import ProcessorInputs
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        get_request_block_hasher,
        init_none_hash,
    )
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    out: list[dict[str, Any]] = []
    for case in json.load(sys.stdin)["cases"]:
        media = [ImageMediaIO().load_bytes(base64.b64decode(i["data"])) for i in case["images"]]
        uuids = [i["uuid"] for i in case["images"]]
        inputs = ProcessorInputs(
            prompt=case["tokens"],
            mm_data_items=MultiModalDataParser().parse_mm_data({"image": media}),
            mm_uuid_items={"image": uuids} if any(u is not None for u in uuids) else None,
            hf_processor_mm_kwargs=case.get("kwargs") or {},
        )
        hashes = inputs.get_mm_hashes(case["model_id"], case["algorithm"])["image"]
        features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=h,
                mm_position=PlaceholderRange(offset=off, length=n),
                mm_hash=h,
            )
            for h, (off, n) in zip(hashes, case["ranges"], strict=True)
        ]
        bs = case["block_size"]
        req = Request(
            request_id="parity",
            prompt_token_ids=case["tokens"],
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            mm_features=features,
            block_hasher=get_request_block_hasher(bs, sha256_cbor),
        )
        extra: list[Any] = []
        mm_idx = 0
        for start in range(0, len(case["tokens"]) - bs + 1, bs):
            keys, mm_idx = generate_block_hash_extra_keys(req, start, start + bs, mm_idx)
            extra.append([list(k) for k in keys] if keys else None)
        out.append(
            {
                "hashes": hashes,
                "extra_keys": extra,
                "block_hashes": [bytes(h).hex() for h in req.block_hashes],
            }
        )
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
