"""Loading a request's images: data URLs, and fetches against a real local HTTP server."""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.tokenization.media_fetch import MediaError, MediaFetcher, MediaLimits
from quillcache.tokenization.multimodal import MmItem, block_mm_keys

PAYLOAD = bytes(range(256)) * 8


class _Server(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/slow":
            time.sleep(1.5)
        self.send_response(200)
        if self.path != "/chunked":  # no Content-Length: the limit is checked while reading
            self.send_header("Content-Length", str(len(PAYLOAD)))
        self.end_headers()
        self.wfile.write(PAYLOAD)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def load(limits: MediaLimits, url: str) -> bytes:
    return asyncio.run(MediaFetcher(limits).load(url))


@given(st.binary(max_size=300), st.integers(min_value=1, max_value=400))
def test_data_urls_decode_exactly_within_the_limit(data: bytes, limit: int) -> None:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    if len(data) <= limit:
        assert MediaFetcher(MediaLimits(max_bytes=limit)).load_now(url) == data
    else:
        with pytest.raises(MediaError, match="image too large"):
            MediaFetcher(MediaLimits(max_bytes=limit)).load_now(url)


@pytest.mark.parametrize(
    ("url", "cause"),
    [
        ("data:image/png,abc", "only base64"),
        ("data:image/png;base64", "no ','"),
        ("data:image/png;base64,ab c=", "not base64"),
        ("file:///etc/passwd", "unsupported image URL scheme 'file'"),
        ("http://127.0.0.1/x.png", "multimodal.fetch is off"),
    ],
)
def test_bad_urls_name_their_cause(url: str, cause: str) -> None:
    with pytest.raises(MediaError, match=cause):
        MediaFetcher(MediaLimits()).load_now(url)


def test_fetch_within_the_allowlist(server: str) -> None:
    allowed = MediaLimits(fetch=True, allow=("127.0.0.0/8",))
    assert load(allowed, server + "/x") == PAYLOAD
    with pytest.raises(MediaError, match="loopback"):  # the allowlist is what lets it in
        load(MediaLimits(fetch=True), server + "/x")
    by_name = MediaLimits(fetch=True, allow=("localhost",))
    assert load(by_name, server.replace("127.0.0.1", "localhost") + "/x") == PAYLOAD


def test_fetch_limits(server: str) -> None:
    small = MediaLimits(fetch=True, allow=("127.0.0.1",), max_bytes=len(PAYLOAD) - 1)
    for path in ("/x", "/chunked"):
        with pytest.raises(MediaError, match="image too large"):
            load(small, server + path)
    quick = MediaLimits(fetch=True, allow=("127.0.0.1",), timeout_s=0.3)
    with pytest.raises(MediaError, match=r"timed out after 0\.3 s"):
        load(quick, server + "/slow")


def _vllm_walk(items: list[MmItem], start: int, end: int) -> list[tuple[str, int]]:
    """vLLM 0.32's `_gen_mm_extra_hash_keys` loop, restated (items sorted by offset)."""
    out: list[tuple[str, int]] = []
    for it in items:
        if end > it.offset:
            if start >= it.offset + it.length:
                continue
            out.append((it.identifier, it.offset - start))
            if end < it.offset + it.length:
                break
        else:
            break
    return out


@given(
    st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40)), max_size=6),
    st.integers(1, 20),
    st.integers(0, 30),
)
def test_block_keys_follow_vllms_walk(
    gaps: list[tuple[int, int]], block_size: int, tail: int
) -> None:
    items, at = [], 0
    for i, (gap, length) in enumerate(gaps):
        items.append(MmItem(f"h{i}", at + gap, length))
        at += gap + length
    n = at + tail
    blocks = block_mm_keys(items, n, block_size)
    assert len(blocks) == n // block_size
    for b, keys in enumerate(blocks):
        assert (keys or []) == _vllm_walk(items, b * block_size, (b + 1) * block_size)
