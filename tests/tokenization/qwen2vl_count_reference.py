"""Image token counts by transformers' own Qwen2-VL image processor, for
`test_multimodal_vllm_parity.py`; run by the real-vLLM venv's interpreter (vLLM calls
this processor for the Qwen2-VL family). Reads {"cases": [{width, height, patch_size,
merge_size, min_pixels, max_pixels}]} on stdin; writes one count per case (null when
the processor refuses the image)."""

from __future__ import annotations

import json
import sys
import warnings

from PIL import Image

warnings.simplefilter("ignore")
from transformers import Qwen2VLImageProcessorPil  # noqa: E402


def count(case: dict[str, int]) -> int | None:
    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": case["min_pixels"], "longest_edge": case["max_pixels"]},
        patch_size=case["patch_size"],
        merge_size=case["merge_size"],
    )
    image = Image.new("RGB", (case["width"], case["height"]))
    try:
        grid = processor(images=[image], return_tensors="np")["image_grid_thw"][0]
    except ValueError:
        return None
    return int(grid[0] * grid[1] * grid[2]) // case["merge_size"] ** 2


def main() -> None:
    cases = json.load(sys.stdin)["cases"]
    json.dump([count(c) for c in cases], sys.stdout)


if __name__ == "__main__":
    main()
