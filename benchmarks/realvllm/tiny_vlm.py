"""Make a tiny random Qwen2-VL, its tokenizer and its processor (seeded, the same every time).

Run by the vLLM interpreter, not the project's: `python tiny_vlm.py OUT_DIR`. It imports
only torch, tokenizers and transformers. The text vocabulary is trained on words `w0` ..
`w2999` (as tiny_model.py's), plus Qwen2-VL's special tokens; the chat template renders an
image part as `<|vision_start|><|image_pad|><|vision_end|>` where it stands among the
message's parts (string content as is), so a gateway that puts that text in place of each
image part and renders the template sees the same text as vLLM. The image processor is
Qwen2-VL's (patch 14, merge 2) with a small pixel range, so an image takes 4 to
`MAX_PIXELS / 28²` tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 2048
WORDS = 3000
PATCH = 14
MERGE = 2
MIN_PIXELS = 56 * 56  # 4 tokens
MAX_PIXELS = 28 * 28 * 64  # 64 tokens
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' or p['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,  # the torchvision-free one: the venv may lack torchvision
    )

    torch.manual_seed(0)
    words = [f"w{i}" for i in range(WORDS)]
    corpus = [" ".join(words[j : j + 50]) for j in range(0, WORDS, 7)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", *SPECIALS], show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    # the template in tokenizer_config.json too, where a tokenizer.json reader finds it
    tok_config = path / "tokenizer_config.json"
    tok_config.write_text(
        json.dumps({**json.loads(tok_config.read_text()), "chat_template": CHAT_TEMPLATE}, indent=2)
    )
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6]},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
        },
        vision_config={
            "depth": 1,
            "embed_dim": 64,
            "hidden_size": 128,
            "num_heads": 4,
            "mlp_ratio": 2,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    Qwen2VLForConditionalGeneration(config).save_pretrained(path)
    images = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
    )
    images.save_pretrained(path)
    # the processor's class (AutoProcessor reads it); its chat template is the tokenizer's
    (path / "processor_config.json").write_text(
        json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2)
    )


if __name__ == "__main__":
    make(Path(sys.argv[1]))
