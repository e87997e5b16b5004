#!/usr/bin/env bash
# Installs what keelfs's build, tests and benchmarks need on a fresh Debian
# bookworm machine (as root). Idempotent: quick when everything is present.
set -euo pipefail

need_apt=()
command -v fio >/dev/null || need_apt+=(fio)
command -v cc >/dev/null || need_apt+=(build-essential)
if ((${#need_apt[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null; then
  echo "setup: cargo is missing; install a Rust toolchain (rustup) first" >&2
  exit 1
fi

# The POSIX suites run against a host mount of keelfs.
export PATH="$HOME/.cargo/bin:$PATH"
command -v pjdfstest >/dev/null || cargo install --quiet pjdfstest
command -v fsx >/dev/null || cargo install --quiet fsx
# pjdfstest switches to these users.
getent passwd tests >/dev/null || printf 'tests:x:::pjdfstest dummy user:/:/usr/sbin/nologin\n' | newusers
echo "setup: ok (fio $(fio --version), $(cargo --version))"
