"""The gateway process with LMCache's controller attached to its policy engine:
`python -m tests.online.lmcache_gateway --config gw.json --lmcache lmcache.json`.

The gateway's own code from end to end (`Gateway.startup`, its Starlette app, the Python
data path), plus the one call the gateway's configuration does not make yet:
`PolicyEngine.attach_lmcache` with a `LmcacheController` over the gateway's upstream
session, from the `LmcacheSettings` in `--lmcache`, and the keys of LMCache's chunks
(the prompt's keys in the namespace without a salt).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from quillcache.gateway.app import Gateway
from quillcache.gateway.config import GatewayConfig
from quillcache.gateway.lmcache_ctl import LmcacheController, LmcacheSettings
from quillcache.identity import content_keys
from quillcache.policy.targets import KeyArray
from quillcache.serving import run_loop, serve_app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--lmcache", required=True)
    parser.add_argument("--ready-file", required=True)
    args = parser.parse_args()
    config = GatewayConfig.model_validate(json.loads(Path(args.config).read_text()))
    settings = LmcacheSettings.model_validate(json.loads(Path(args.lmcache).read_text()))
    gateway = Gateway(config)

    async def serve() -> None:
        try:
            await gateway.startup()
            identifier, block_size = gateway.identifier, gateway.cp.block_size

            def offload_keys(model: str, tokens: list[int]) -> KeyArray:
                # LMCache's chunks as the index keys them: the namespace without a salt
                return content_keys(tokens, block_size, identifier.namespace_of(model, ""))

            gateway.policy.attach_lmcache(
                LmcacheController(gateway.upstream, settings), offload_keys
            )

            def started(port: int) -> dict[str, Any]:
                gateway.listening(port)
                return {"url": f"http://{config.host}:{port}", "port": port}

            await serve_app(
                gateway.starlette(with_lifespan=False),
                config.host,
                0,
                config.log_level,
                {},
                args.ready_file,
                on_started=started,
            )
        finally:
            await gateway.shutdown()

    run_loop(serve())


if __name__ == "__main__":
    main()
