"""The same end-to-end checks on the gateway's Python data path (`relay: python`).

The native relay is the default, so every other online test runs through it; these
tests keep the Starlette path (the one `https://` engines are delegated to) honest on
streaming, errors, engine failures and client disconnects. Imported tests run here
with this module's fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.online.conftest import Stack, make_shared_stack, make_stack
from tests.online.test_failures_e2e import (  # noqa: F401  (collected here)
    test_client_disconnect_cancels_a_non_streamed_request,
    test_client_disconnect_cancels_the_upstream_request,
    test_engine_killed_mid_stream,
    test_failed_connect_is_retried_on_another_worker,
    test_unreachable_tokenize_engine_is_marked_down_and_another_asked,
)
from tests.online.test_gateway_e2e import (  # noqa: F401
    test_actual_hits_are_counted_from_streamed_usage,
    test_malformed_requests_get_a_4xx_json_error,
    test_metrics_cover_what_the_issue_lists,
    test_openai_client_streams_through_the_gateway,
    test_shared_prefixes_go_to_the_worker_that_holds_them,
    test_streaming_is_relayed_chunk_by_chunk,
    test_upstream_errors_pass_through_unchanged,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    yield from make_stack(tmp_path, relay="python")


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from make_shared_stack(tmp_path_factory.mktemp("python-relay"), relay="python")


def test_the_python_path_is_the_one_serving(shared_stack: Stack) -> None:
    """uvicorn answers the hot path (the native relay's answers carry no `server`)."""
    assert shared_stack.gateway is not None
    resp = httpx.post(shared_stack.gateway.url + "/v1/completions", content=b"{", timeout=10)
    assert resp.status_code == 400
    assert resp.headers.get("server") == "uvicorn"
