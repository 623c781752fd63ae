"""The gateway's end-to-end tests start the same real processes as tests/online."""

from tests.online.conftest import shared_stack, stack

__all__ = ["shared_stack", "stack"]
