"""One routing decision (route + load booking) per router at 16 and 1,024 engines, on
`quillcache bench-route`'s fleet: block 0 held by every engine, each prefix by 1-3."""

from __future__ import annotations

from quillcache.bench.route_cli import BLOCK_SIZE, build_fleet
from quillcache.controlplane import ControlPlane
from quillcache.routing import Request


class Route:
    params = (["round-robin", "llm-d", "quillcache"], [16, 1024])
    param_names = ["router", "engines"]

    def setup(self, router: str, engines: int) -> None:
        self.fleet = build_fleet(engines, conversations_per_engine=4, requests=256, seed=0)
        self.cp = ControlPlane(router=router, block_size=BLOCK_SIZE, track_load=True)
        for e in range(engines):
            self.cp.add_worker(e)
            self.cp.ingest(e, self.fleet.stored[e])
        self.i = 0

    def teardown(self, router: str, engines: int) -> None:
        self.cp.close()

    def time_decision(self, router: str, engines: int) -> None:
        self.i += 1
        keys, tokens, _ = self.fleet.requests[self.i % len(self.fleet.requests)]
        self.cp.route(Request(self.i, keys, tokens, expected_output_tokens=64))
        self.cp.prefill_done(self.i)
        self.cp.finish(self.i)
