"""A user's router, named in a gateway config as "tests.online.custom_router:HighestWorker"."""

from __future__ import annotations

from quillcache.routing import Decision, Request, Router, View


class HighestWorker(Router):
    name = "highest-worker"

    def route(self, request: Request, view: View) -> Decision:
        if not view.workers:
            return self.no_workers()
        return self.decide(request, view, max(view.workers, key=lambda w: w.worker), "highest")


class Broken(Router):
    """A router with a bug: every request must still get an answer (a JSON 500)."""

    name = "broken"

    def route(self, request: Request, view: View) -> Decision:
        raise RuntimeError("this router has a bug")
