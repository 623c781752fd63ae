"""Make a tiny random Llama and its BPE tokenizer (seeded, so the same every time).

Run by the vLLM interpreter, not the project's: `python tiny_model.py OUT_DIR`. It
imports only torch, tokenizers and transformers. The vocabulary is trained on words
`w0` .. `w2999`, so prompts for this model are made of such words (other characters
become `<unk>`).
"""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB = 2048
WORDS = 3000


def make(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    words = [f"w{i}" for i in range(WORDS)]
    corpus = [" ".join(words[j : j + 50]) for j in range(0, WORDS, 7)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    fast.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    LlamaForCausalLM(config).save_pretrained(path)


if __name__ == "__main__":
    make(Path(sys.argv[1]))
