"""End to end: chat requests with images through the gateway, the official `openai` client.

Two engine simulators publish each image's vLLM extra keys (`[identifier, offset]` per
block); the gateway computes the same items from the request, so a second request with
the same image goes to the engine holding it and hits there, while the same text with
another image matches nothing (the image is part of the key).
"""

from __future__ import annotations

import base64
import io
import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from tests.online.conftest import Stack
from tests.online.helpers import http_post, wait_for

SHA = ["--mm-hasher-algorithm", "sha256"]


def png(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def messages(url: str, text: str, part_uuid: str | None = None) -> list[dict[str, Any]]:
    image: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if part_uuid is not None:
        image["uuid"] = part_uuid
    return [{"role": "user", "content": [image, {"type": "text", "text": text}]}]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


def held_blocks(admin: httpx.Client, msgs: list[dict[str, Any]], worker: str) -> int:
    found = admin.post("/admin/lookup", json={"messages": msgs}).json()["matches"]
    return max((m["blocks"] for m in found if str(m["worker"]) == worker), default=0)


def start(stack: Stack, multimodal: dict[str, Any] | None = None) -> str:
    stack.engine(extra=SHA)
    stack.engine(extra=SHA)
    mm = {"hash_algorithm": "sha256", **(multimodal or {})}
    gw = stack.start_gateway({"router": "quillcache", "multimodal": mm})
    return gw.url


def multimodal_counts(url: str) -> dict[tuple[str, ...], float]:
    """The gateway's multimodal counters from /metrics: (sample name, outcome, reason)."""
    page = httpx.get(url + "/metrics").text
    counts: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(page):
        if family.name.startswith("quillcache_multimodal_"):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (
                        sample.name,
                        sample.labels.get("outcome", ""),
                        sample.labels.get("reason", ""),
                    )
                    counts[key] = sample.value
    return counts


def test_the_same_image_hits_the_engine_that_holds_it(stack: Stack) -> None:
    url = start(stack)
    oa = client(url)
    admin = stack.admin()
    text = f"[{uuid.uuid4().hex[:8]}] describe this picture in detail " * 6
    image = data_url(png((200, 30, 90)))
    first = oa.chat.completions.with_raw_response.create(
        model="sim-model", messages=messages(image, text), max_tokens=2
    )
    holder = first.headers["x-quillcache-worker"]
    prompt_tokens = first.parse().usage.prompt_tokens
    full = prompt_tokens // 16
    # the index learns the blocks, image included, under the gateway's own keys
    wait_for(
        lambda: held_blocks(admin, messages(image, text), holder) == full,
        what="the index to hold the image prompt's blocks under the gateway's keys",
    )
    more = messages(image, text + " and more")
    predicted = held_blocks(admin, more, holder)  # all but the block the new text changes
    assert predicted == full - 1
    follow = oa.chat.completions.with_raw_response.create(
        model="sim-model", messages=more, max_tokens=2
    )
    assert follow.headers["x-quillcache-worker"] == holder
    details = follow.parse().usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == predicted * 16  # the engine's hit
    # the same text with another image: the image's blocks are another chain
    other = data_url(png((10, 220, 40)))
    assert held_blocks(admin, messages(other, text), holder) == 0
    # a client's uuid names the item instead of its bytes (vLLM's rule without kwargs)
    named = messages(image, text, part_uuid=f"img-{uuid.uuid4().hex}")
    assert held_blocks(admin, named, holder) == 0
    r = oa.chat.completions.with_raw_response.create(
        model="sim-model", messages=named, max_tokens=2
    )
    named_holder = r.headers["x-quillcache-worker"]
    wait_for(
        lambda: held_blocks(admin, named, named_holder) == full,
        what="the uuid-named prompt's blocks",
    )


def test_a_gateway_without_multimodal_keys_misses(stack: Stack) -> None:
    """The control: the same engines, a gateway keying on text alone. The engine holds
    the blocks (under keys with the image), the gateway never finds them."""
    url = start(stack, {"enabled": False})
    oa = client(url)
    admin = stack.admin()
    text = f"[{uuid.uuid4().hex[:8]}] describe this picture in detail " * 6
    image = data_url(png((200, 30, 90)))
    first = oa.chat.completions.with_raw_response.create(
        model="sim-model", messages=messages(image, text), max_tokens=2
    )
    assert first.status_code == 200
    stats = lambda: admin.get("/admin/index").json()  # noqa: E731
    wait_for(lambda: stats()["blocks"] > 0, what="the engine's blocks in the index")
    assert held_blocks(admin, messages(image, text), first.headers["x-quillcache-worker"]) == 0
    before = multimodal_counts(url)
    oa.chat.completions.create(model="sim-model", messages=messages(image, text), max_tokens=2)
    after = multimodal_counts(url)
    fallback = ("quillcache_multimodal_requests_total", "fallback", "disabled")
    assert after[fallback] - before[fallback] == 1
    assert after[("quillcache_multimodal_requests_total", "keyed", "")] == 0


class _Images(BaseHTTPRequestHandler):
    body = png((1, 2, 3))

    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/img.png")
            self.end_headers()
            return
        if self.path not in ("/img.png", "/big.png"):
            self.send_error(404)
            return
        data = self.body * 40 if self.path == "/big.png" else self.body
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def image_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_fetched_image_urls_and_their_400s(stack: Stack, image_server: str) -> None:
    """A URL on the allowlisted 127.0.0.1 is fetched and keyed like the same bytes sent
    inline; every refusal is a 400 in OpenAI's error shape naming its cause."""
    limit = len(_Images.body) * 10
    url = start(stack, {"fetch": True, "fetch_allow": ["127.0.0.1"], "max_image_bytes": limit})
    admin = stack.admin()
    text = f"[{uuid.uuid4().hex[:8]}] what is in it " * 6
    inline = messages(data_url(_Images.body), text)
    fetched = messages(image_server + "/img.png", text)
    first = client(url).chat.completions.with_raw_response.create(
        model="sim-model", messages=inline, max_tokens=2
    )
    holder = first.headers["x-quillcache-worker"]
    full = first.parse().usage.prompt_tokens // 16
    wait_for(lambda: held_blocks(admin, inline, holder) == full, what="the inline image's blocks")
    assert held_blocks(admin, fetched, holder) == full  # the fetched bytes, the same key

    def error(msgs: list[dict[str, Any]]) -> tuple[int, str]:
        r = http_post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
        body = r.json()
        assert set(body) == {"error"}, body
        return r.status_code, str(body["error"]["message"])

    before = multimodal_counts(url)
    cases = {
        image_server + "/big.png": "image too large",
        image_server + "/redirect": "redirect",
        image_server + "/missing": "HTTP 404",
        "ftp://127.0.0.1/x.png": "unsupported image URL scheme",
        "data:image/png;base64,@@@": "not base64",
        data_url(b"not an image"): "cannot decode the image",
    }
    for bad, cause in cases.items():
        status, message = error(messages(bad, text))
        assert status == 400 and cause in message, (bad, message)
    # addresses off the allowlist are refused before any connection
    denied = {
        "http://127.0.0.2/x.png": "loopback",
        "http://[::ffff:127.0.0.2]/x.png": "loopback",
        "http://10.1.2.3/x.png": "private",
        "http://169.254.169.254/latest/meta-data": "link-local",
        "http://0.0.0.0/x.png": "not a public address",
    }
    for bad, cause in denied.items():
        status, message = error(messages(bad, text))
        assert status == 400 and cause in message and "fetch_allow" in message, (bad, message)
    after = multimodal_counts(url)
    refused = ("quillcache_multimodal_requests_total", "refused", "")
    assert after[refused] - before[refused] == len(cases) + len(denied)
    # a fetched image (a lookup: the engine simulator does not fetch URLs): keyed, one
    # item, one fetch
    assert held_blocks(admin, fetched, holder) == full
    done = multimodal_counts(url)
    for name, outcome in (("requests", "keyed"), ("items", ""), ("fetches", "")):
        key = (f"quillcache_multimodal_{name}_total", outcome, "")
        assert done[key] - after[key] == 1, key


def test_fetching_is_off_by_default_and_loopback_is_denied(stack: Stack) -> None:
    url = start(stack)
    r = http_post(
        url + "/v1/chat/completions",
        json={"messages": messages("http://127.0.0.1:9/x.png", "hi"), "max_tokens": 1},
    )
    assert r.status_code == 400 and "multimodal.fetch is off" in r.json()["error"]["message"]
    json.dumps(r.json())  # a JSON error, never a 500


def test_an_engine_tokenizing_gateway_routes_images_on_text(stack: Stack) -> None:
    """`tokenizer: engine`: /tokenize does not say where images are, so the request is
    routed on its text (no image match) and served, never refused."""
    stack.engine(extra=SHA)
    gw = stack.start_gateway({"tokenizer": "engine", "multimodal": {"hash_algorithm": "sha256"}})
    text = f"[{uuid.uuid4().hex[:8]}] describe " * 6
    r = client(gw.url).chat.completions.create(
        model="sim-model", messages=messages(data_url(png((5, 5, 5))), text), max_tokens=2
    )
    assert r.usage is not None and r.usage.prompt_tokens > len(text)
    found = stack.admin().post(
        "/admin/lookup", json={"messages": messages(data_url(png((5, 5, 5))), text)}
    )
    assert found.json()["matches"] == []  # the image blocks are not found on text keys
