"""`quillcache loadgen` with bad input: every flag outside its range is refused before a
request is sent (exit 2, naming the flag), a trace that cannot be replayed says where,
and an answer of another shape than OpenAI's fails its request, not the run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from quillcache.cli import main
from quillcache.errors import ConfigError
from quillcache.loadgen.runner import RunConfig, run_load
from quillcache.loadgen.workload import LoadRequest, mooncake_trace

DOWN = "http://127.0.0.1:9"  # nothing is sent: every case is refused first


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--rate", "0"], "--rate must be a finite number"),
        (["--rate", "-1"], "--rate must be a finite number"),
        (["--rate", "nan"], "--rate must be a finite number"),
        (["--rate", "inf"], "--rate must be a finite number"),
        (["--warmup", "-2"], "--warmup must be >= 0"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--trace-time-scale", "-1"], "--trace-time-scale must be a finite number"),
        (["--prefix-chars", "-10"], "--prefix-chars must be at least 1"),
        (["--trace-block-chars", "0"], "--trace-block-chars must be at least 1"),
        (["--json", ""], "--json needs a path"),
        (["--json", "/proc/no-such-dir/out.json"], "does not exist"),
        (["--json", "/tmp"], "is a directory"),
        (["--url", DOWN, "--name", "a", "--name", "a"], "the same label"),
    ],
)
def test_flags_out_of_range_are_refused_before_the_run(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["loadgen", "--url", DOWN, "--requests", "3", "--no-progress", *flags]) == 2
    assert said in capsys.readouterr().err


def test_traces_that_cannot_be_replayed_say_where(tmp_path: Path) -> None:
    cases = {
        "empty.jsonl": (b"", "has no records"),
        "latin1.jsonl": (b'{"hash_ids": [1], "timestamp": 0}\n\xff\xfe\n', ":2: not a Mooncake"),
        "inf.jsonl": (b'{"hash_ids": [1], "timestamp": "inf"}\n', ":1: timestamp must be"),
        "noids.jsonl": (b'{"hash_ids": [], "timestamp": 0}\n', ":1: a record without"),
    }
    for name, (content, said) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ConfigError, match=said):
            mooncake_trace(path)
    with pytest.raises(ConfigError, match="is a directory"):
        mooncake_trace(tmp_path)


def test_an_answer_of_another_shape_fails_its_request_not_the_run() -> None:
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: [1, 2]\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def go() -> list[str]:
        app = web.Application()
        app.router.add_post("/v1/completions", stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            cfg = RunConfig(url=f"http://127.0.0.1:{port}", concurrency=2)
            samples, _ = await run_load(cfg, [LoadRequest("hi", 2)] * 3, lambda s: None)
            return [s.error or "" for s in samples]
        finally:
            await runner.cleanup()

    errors = asyncio.run(asyncio.wait_for(go(), 30))
    assert len(errors) == 3 and all(e.startswith("malformed answer") for e in errors), errors
