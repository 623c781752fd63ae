#!/usr/bin/env bash
# The Redis-protocol servers the shared-state tests (tests/state/) start on free ports:
# redis-server (Debian's 7.0.x on bookworm: the Redis the scripts target) and
# valkey-server (wire-compatible; in Debian's main archive from trixie on, in
# bookworm-backports before). Idempotent; run as root (`make deps` calls it).
#
# On bookworm, Valkey comes from backports through a sources list of its own given to
# apt on the command line: /etc/apt is not changed, and no other package is taken from
# backports.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
updated=""
update() { [ -n "$updated" ] || { apt-get update -qq; updated=1; }; }

if ! command -v redis-server >/dev/null; then
  update
  apt-get install -y -qq redis-server >/dev/null
fi
if ! command -v valkey-server >/dev/null; then
  update
  if ! apt-get install -y -qq valkey-server >/dev/null 2>&1; then
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    dir="$(mktemp -d)"
    trap 'rm -rf "$dir"' EXIT
    mkdir -p "$dir/lists/partial"
    {
      echo "deb http://deb.debian.org/debian $codename main"
      echo "deb http://deb.debian.org/debian-security $codename-security main"
      echo "deb http://deb.debian.org/debian $codename-backports main"
    } >"$dir/sources.list"
    opts=(-o "Dir::Etc::SourceList=$dir/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$dir/lists")
    apt-get "${opts[@]}" update -qq
    apt-get "${opts[@]}" install -y -qq -t "$codename-backports" valkey-server >/dev/null
  fi
fi
# Debian's packages start a service where there is an init system: the tests use their
# own servers on free ports, so a service on 6379 is harmless.
echo "redis-servers: $(redis-server --version | cut -d' ' -f3) / $(valkey-server --version | cut -d' ' -f3)"
