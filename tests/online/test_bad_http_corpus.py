"""Bad HTTP, byte for byte, on both data paths: every request of the corpus gets an
answer, the answer is a 2xx or a 4xx, and a 4xx carries OpenAI's JSON error shape.

Raw sockets on 127.0.0.1 against a gateway with healthy engine simulators, once with the
native relay and once with `relay: python`. The corpus: JSON nested too deep on every
endpoint that parses JSON, asterisk-form targets, bodies cut short, clients that shut
their sending side after the request (valid requests too), oversized headers and URIs,
malformed request lines, a prompt over the byte limit and one over the engine's context.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.online.conftest import ADMIN, Stack

MAX_MODEL_LEN = 2048
AUTH = f"authorization: Bearer {ADMIN}\r\n"
JSON_ENDPOINTS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/admin/lookup"),
    ("POST", "/admin/pins"),
    ("DELETE", "/admin/pins"),
    ("POST", "/admin/workers"),
    ("POST", "/admin/workers/0/drain"),
    ("POST", "/ingest/kv_events"),
]
VALID_COMPLETION = {"model": "sim-model", "prompt": "hello there", "max_tokens": 2}
VALID_CHAT = {
    "model": "sim-model",
    "messages": [{"role": "user", "content": "hello there"}],
    "max_tokens": 2,
}


@dataclass
class Case:
    name: str
    data: bytes
    half_close: bool = False
    # the statuses this case must get (None: any 2xx or 4xx)
    expect: set[int] | None = None
    # words the error message must contain
    says: list[str] = field(default_factory=list)
    # the answer must come within this many seconds
    within_s: float = 20.0


def request(
    method: str,
    path: str,
    body: bytes = b"",
    *,
    headers: str = "",
    length: int | None = None,
) -> bytes:
    length = len(body) if length is None else length
    head = f"{method} {path} HTTP/1.1\r\nhost: gw\r\n{AUTH}content-type: application/json\r\n"
    return (head + headers + f"content-length: {length}\r\n\r\n").encode() + body


def deep(levels: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * levels + b"]" * levels
    if kind == "object":
        return b'{"a":' * levels + b"1" + b"}" * levels
    # a valid completion carrying the nesting in a field of its own
    inner = (b"[" * levels + b"]" * levels).decode()
    return ('{"model": "sim-model", "prompt": "hi", "x": ' + inner + "}").encode()


def corpus() -> list[Case]:
    cases: list[Case] = []
    for method, path in JSON_ENDPOINTS:
        for levels in (1_000, 100_000):
            for kind in ("list", "object", "field"):
                cases.append(
                    Case(
                        f"deep {kind} {levels} {method} {path}",
                        request(method, path, deep(levels, kind)),
                        expect={400},
                        says=["nested"],
                    )
                )
    # nesting that is deep but under the limit is parsed as usual
    cases.append(Case("nested 40", request("POST", "/v1/completions", deep(40, "field"))))
    for method in ("OPTIONS", "GET", "POST", "DELETE"):
        cases.append(Case(f"{method} *", f"{method} * HTTP/1.1\r\nhost: gw\r\n\r\n".encode()))
    cases.append(Case("GET absolute-form", b"GET http://gw/health HTTP/1.1\r\nhost: gw\r\n\r\n"))
    # bodies cut short: the client shuts its sending side before the promised length
    for path in [
        "/v1/completions",
        "/v1/chat/completions",
        "/admin/lookup",
        "/admin/pins",
        "/admin/workers",
        "/ingest/kv_events",
    ]:
        for sent in (b"", b'{"prompt": "hel'):
            cases.append(
                Case(
                    f"truncated {len(sent)} of 100 {path}",
                    request("POST", path, sent, length=100),
                    half_close=True,
                    expect={400},
                )
            )
    chunked_cut = (
        b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
        b'10\r\n{"prompt": "h'
    )
    cases.append(Case("truncated chunked", chunked_cut, half_close=True, expect={400}))
    # clients that shut their sending side right after a complete request
    valid = [
        ("completion", request("POST", "/v1/completions", json.dumps(VALID_COMPLETION).encode())),
        ("chat", request("POST", "/v1/chat/completions", json.dumps(VALID_CHAT).encode())),
        ("models", b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n"),
        ("health", b"GET /health HTTP/1.1\r\nhost: gw\r\n\r\n"),
        ("index", f"GET /admin/index HTTP/1.1\r\nhost: gw\r\n{AUTH}\r\n".encode()),
        ("http/1.0", b"GET /health HTTP/1.0\r\n\r\n"),
        (
            "stream",
            request(
                "POST", "/v1/completions", json.dumps({**VALID_COMPLETION, "stream": True}).encode()
            ),
        ),
    ]
    for name, data in valid:
        cases.append(Case(f"half-closed valid {name}", data, half_close=True, expect={200}))
        cases.append(Case(f"valid {name}", data, expect={200}))
    invalid = [
        ("bad json", request("POST", "/v1/completions", b"{nope")),
        ("no prompt", request("POST", "/v1/completions", b"{}")),
        ("unknown model", request("POST", "/v1/completions", b'{"model": "x", "prompt": "a"}')),
        ("bad lookup", request("POST", "/admin/lookup", b"[]")),
        ("no such path", b"GET /nope HTTP/1.1\r\nhost: gw\r\n\r\n"),
        ("deep", request("POST", "/v1/chat/completions", deep(5_000, "list"))),
    ]
    for name, data in invalid:
        cases.append(Case(f"half-closed invalid {name}", data, half_close=True))
    # protocol-level errors: hyper and uvicorn answer these before any handler runs
    big_header = "x-big: " + "a" * 200_000 + "\r\n"
    many_headers = "".join(f"x-h{i}: v\r\n" for i in range(300))
    for name, headers in (("one big header", big_header), ("300 headers", many_headers)):
        for path in ("/v1/completions", "/health"):
            cases.append(
                Case(
                    f"{name} {path}",
                    request("POST", path, b"{}", headers=headers),
                    expect={431},
                )
            )
    long_uri = "/v1/completions?" + "q" * 70_000
    cases.append(Case("uri 70k", request("POST", long_uri, b"{}"), expect={414}))
    cases.append(
        Case("uri 70k GET", f"GET /health?{'q' * 70_000} HTTP/1.1\r\n\r\n".encode(), expect={414})
    )
    malformed = [
        b"GARBAGE\r\n\r\n",
        b"GET\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"GET / FTP/1.1\r\n\r\n",
        b"G@T / HTTP/1.1\r\n\r\n",
        b"GET /\x00 HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nno colon here\r\n\r\n",
        b"GET / HTTP/1.1\r\nbad name: v\r\n\r\n",
        b"GET / HTTP/1.1\r\nx: a\x00b\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\ncontent-length: abc\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,  # a TLS ClientHello
    ]
    for i, data in enumerate(malformed):
        cases.append(Case(f"malformed {i} {data[:20]!r}", data, expect={400}))
        cases.append(Case(f"malformed half-closed {i}", data, half_close=True, expect={400}))
    # prompts the engine would refuse: refused before tokenizing, or by the engine's context
    huge = json.dumps({"model": "sim-model", "prompt": "lorem ipsum " * 900_000}).encode()
    cases.append(
        Case(
            "10 MB prompt",
            request("POST", "/v1/completions", huge),
            expect={400},
            says=["bytes"],
            within_s=5.0,
        )
    )
    huge_chat = json.dumps(
        {"model": "sim-model", "messages": [{"role": "user", "content": "ab " * 2_000_000}]}
    ).encode()
    cases.append(
        Case(
            "6 MB chat",
            request("POST", "/v1/chat/completions", huge_chat),
            expect={400},
            says=["bytes"],
            within_s=5.0,
        )
    )
    for path, body in (
        ("/v1/completions", {"model": "sim-model", "prompt": "x" * (MAX_MODEL_LEN + 10)}),
        (
            "/v1/chat/completions",
            {"model": "sim-model", "messages": [{"role": "user", "content": "x" * 5000}]},
        ),
        ("/v1/completions", {"model": "sim-model", "prompt": list(range(MAX_MODEL_LEN + 1))}),
    ):
        cases.append(
            Case(
                f"over max_model_len {path} {type(body.get('prompt', '')).__name__}",
                request("POST", path, json.dumps(body).encode()),
                expect={400},
                says=[f"maximum context length is {MAX_MODEL_LEN} tokens. However, your request"],
            )
        )
    return cases


CORPUS = corpus()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def exchange(port: int, case: Case) -> Answer | None:
    """Send the case's bytes and read one answer (None: the connection ended without
    one, or nothing came within the case's time)."""
    deadline = time.monotonic() + case.within_s
    with socket.create_connection(("127.0.0.1", port), timeout=case.within_s) as sock:
        try:
            sock.sendall(case.data)
            if case.half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may answer and close before taking every byte
        data = b""
        while True:
            parsed = parse(data)
            if parsed is not None:
                return parsed
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                return parse(data, at_eof=True)
            if not chunk:
                return parse(data, at_eof=True)
            data += chunk


def parse(data: bytes, at_eof: bool = False) -> Answer | None:
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    lines = data[:head_end].decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    if 100 <= status < 200:  # an interim answer: the final one follows
        return parse(data[head_end + 4 :], at_eof)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = data[head_end + 4 :]
    if "content-length" in headers:
        n = int(headers["content-length"])
        return Answer(status, headers, body[:n]) if len(body) >= n else None
    if "chunked" in headers.get("transfer-encoding", ""):
        if body.endswith(b"0\r\n\r\n") or at_eof:
            return Answer(status, headers, dechunk(body))
        return None
    return Answer(status, headers, body) if at_eof else None


def dechunk(body: bytes) -> bytes:
    out, rest = b"", body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2 :]
    return out


@pytest.fixture(scope="module", params=["native", "python"])
def gateway_port(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[int]:
    s = Stack(tmp_path_factory.mktemp(f"bad-http-{request.param}"), relay=request.param)
    try:
        for _ in range(2):
            s.engine(time_scale=0.0, extra=["--max-model-len", str(MAX_MODEL_LEN)])
        gw = s.start_gateway({"parity_check": False})
        yield int(gw.url.rsplit(":", 1)[1])
    finally:
        s.kill_all()


def check(case: Case, answer: Answer | None) -> str | None:
    """What is wrong with `answer` to `case`, or None."""
    if answer is None:
        return "no answer"
    if not (200 <= answer.status < 300 or 400 <= answer.status < 500):
        return f"status {answer.status}: {answer.body[:200]!r}"
    if case.expect is not None and answer.status not in case.expect:
        return f"status {answer.status}, expected {sorted(case.expect)}: {answer.body[:200]!r}"
    if answer.status >= 400:
        if "application/json" not in answer.headers.get("content-type", ""):
            return f"{answer.status} with content-type {answer.headers.get('content-type')!r}"
        try:
            error = json.loads(answer.body)["error"]
        except (ValueError, KeyError, TypeError):
            return f"{answer.status} without an OpenAI error: {answer.body[:200]!r}"
        if set(error) != {"message", "type", "param", "code"} or not error["message"]:
            return f"{answer.status} error of the wrong shape: {error}"
        missing = [w for w in case.says if w not in error["message"]]
        if missing:
            return f"{answer.status} message lacks {missing}: {error['message'][:300]}"
    return None


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_every_bad_request_gets_a_2xx_or_a_json_4xx(gateway_port: int, case: Case) -> None:
    started = time.monotonic()
    answer = exchange(gateway_port, case)
    problem = check(case, answer)
    assert problem is None, problem
    assert time.monotonic() - started < case.within_s


def test_the_corpus_size() -> None:
    """The number the docs quote (requests per data path)."""
    assert len(CORPUS) == 124
