"""A user's router whose shortlist breaks the booking's contract (it does not start with
its own decision's row), named in a gateway config as
"tests.gateway.bad_shortlist_router:NotLedByItsDecision"."""

from __future__ import annotations

from quillcache.routing import Decision, Request, Router, View
from quillcache.routing.shortlist import Preference


class NotLedByItsDecision(Router):
    name = "not-led-by-its-decision"

    def route(self, request: Request, view: View) -> Decision:
        if not view.workers:
            return self.no_workers()
        return self.decide(request, view, min(view.workers, key=lambda w: w.worker), "lowest")

    def shortlist(
        self, request: Request, view: View, position: int, size: int
    ) -> list[Preference] | None:
        others = [r for r in range(len(view)) if r != position]
        return [Preference(r, 1.0) for r in [*others, position][:size]]
