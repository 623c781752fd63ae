"""A Hugging Face tokenizer.json (with its chat template) on both sides: engine and gateway."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quillcache.errors import ConfigError
from quillcache.tokenization.local import HFTokenizer, load_tokenizer
from tests.online.conftest import Stack
from tests.online.helpers import http_get, http_post, wait_for

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    corpus = [" ".join(f"word{i % 97} token{i % 13}" for i in range(j, j + 40)) for j in range(200)]
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"})
    )
    return path


def test_hf_tokenizer_and_chat_template(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tokenizer_dir))
    assert isinstance(tok, HFTokenizer)
    text = tok.apply_chat_template([{"role": "user", "content": "word1 token2"}], True)
    assert text == "<s>user: word1 token2</s><s>assistant:"
    ids = tok.encode("word1 token2 word3")
    assert ids and tok.decode(ids).replace(" ", "") == "word1token2word3"
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(str(tokenizer_dir / "missing.json"))


@pytest.mark.parametrize("where", ["gateway", "engine"])
def test_gateway_and_engine_share_a_tokenizer_json(
    stack: Stack, tokenizer_dir: Path, where: str
) -> None:
    """The tokenizer.json (and its chat template) loaded by the gateway itself, or used
    through the engine's own `/tokenize` (with `messages` for chat)."""
    stack.engine(extra=["--tokenizer", str(tokenizer_dir)])
    stack.engine(extra=["--tokenizer", str(tokenizer_dir)])
    spec = str(tokenizer_dir) if where == "gateway" else "engine"
    gw = stack.start_gateway({"tokenizer": spec, "router": "quillcache"})
    admin = stack.admin()
    wait_for(
        lambda: [w["parity"] for w in admin.get("/admin/workers").json()["workers"]] == ["ok"] * 2,
        what="the parity self-check with the local tokenizer.json",
    )
    system = " ".join(f"word{i} token{i % 13}" for i in range(150))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "word5"}]
    first = http_post(gw.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert first.status_code == 200, first.text
    holder = first.headers["x-quillcache-worker"]
    wait_for(
        lambda: any(
            m["blocks"] > 0
            for m in admin.post("/admin/lookup", json={"messages": messages}).json()["matches"]
        ),
        what="the chat prompt's blocks",
    )
    again = http_post(
        gw.url + "/v1/chat/completions",
        json={"messages": [*messages[:1], {"role": "user", "content": "word6"}], "max_tokens": 2},
    )
    assert again.headers["x-quillcache-worker"] == holder
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_parity_check_catches_a_tokenizer_mismatch(stack: Stack, tokenizer_dir: Path) -> None:
    stack.engine(extra=["--tokenizer", str(tokenizer_dir)])
    gw = stack.start_gateway({"tokenizer": "builtin"})  # not the engine's tokenizer
    admin = stack.admin()
    wait_for(
        lambda: admin.get("/admin/workers/0").json()["parity"].startswith("mismatch"),
        timeout=25,  # each probe waits 5 s for events that never match
        what="the parity self-check to fail",
    )
    parity = admin.get("/admin/workers/0").json()["parity"]
    assert "completion" in parity and "chat template" in parity
    assert 'quillcache_worker_parity_ok{worker="0"} 0.0' in http_get(gw.url + "/metrics").text
