#!/usr/bin/env bash
# Checks that keelfsd's release binary contains no test support: the
# vhost-user test frontend, the fault-injecting device, the test helpers
# and the daemon's own test hooks sit behind each crate's `test-utils`
# feature, which only tests, keelfs-bench and the fuzzer turn on (issues
# 19 and 32).
#
# What counts as test support is found by rule, not listed: every
# `#[cfg(feature = "test-utils")]` in a workspace crate's src/ must gate a
# whole module (`mod NAME;`) or a re-export (`use`/`pub use`), and each
# module so gated gives a symbol path (`keelfs_bdev::rbd::scratch::`) that
# must not appear in the release binary, and string literals naming
# environment variables (`"KEELFS_..."`) in its files that must not appear
# either. A gate on anything else fails the check, so new test support
# cannot slip past it.
#
# keelfsd is built alone: Cargo unifies features across the packages of
# one build, so building it together with keelfs-bench would switch the
# feature on. The linker drops functions that nothing calls, so what the
# check proves is that nothing in keelfsd reaches test support, whichever
# features a build turns on. keelfs-bench, which does call it, is the
# control: the same patterns must match its symbols. Run by .ci/run after
# the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The gated modules, as "SYMBOL-PREFIX FILE..." lines, and the gates that
# break the rule, from every workspace member's src/.
python3 - "$work/modules" <<'EOF'
import os, re, sys, tomllib

GATE = re.compile(r'^\s*#\[cfg\((?:any\(test,\s*)?feature\s*=\s*"test-utils"\)?\)\]\s*$')
MOD = re.compile(r'^\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+([a-z_][a-z0-9_]*)\s*;')
USE = re.compile(r'^\s*(?:pub(?:\([a-z]+\))?\s+)?use\s')

members = tomllib.load(open("Cargo.toml", "rb"))["workspace"]["members"]
modules, broken = [], []
for member in members:
    manifest = tomllib.load(open(os.path.join(member, "Cargo.toml"), "rb"))
    crate = manifest["package"]["name"].replace("-", "_")
    src = os.path.join(member, "src")
    for root, _, files in os.walk(src):
        for name in sorted(files):
            if not name.endswith(".rs"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)[:-3].split(os.sep)
            # The module this file is: lib.rs/main.rs the crate, mod.rs its
            # directory, NAME.rs NAME.
            if rel[-1] in ("lib", "main", "mod"):
                rel = rel[:-1]
            here = os.path.dirname(path) if name in ("lib.rs", "main.rs", "mod.rs") else path[:-3]
            lines = open(path).read().split("\n")
            for i, line in enumerate(lines):
                if not GATE.match(line):
                    continue
                j = i + 1
                while j < len(lines) and (lines[j].strip().startswith(("#[", "//")) or not lines[j].strip()):
                    j += 1
                item = lines[j] if j < len(lines) else ""
                m = MOD.match(item)
                if m:
                    sub = m.group(1)
                    files_of = [f for f in (os.path.join(here, sub + ".rs"), os.path.join(here, sub)) if os.path.exists(f)]
                    modules.append(("::".join([crate] + rel + [sub]) + "::", files_of))
                elif not USE.match(item):
                    broken.append(f"{path}:{j + 1}: a test-utils gate on something other than a module or a use: {item.strip()}")
if broken:
    print("\n".join(broken), file=sys.stderr)
    print("check-release-symbols: gate test support by whole modules, so that this check can see it", file=sys.stderr)
    sys.exit(1)
with open(sys.argv[1], "w") as out:
    for prefix, files in modules:
        out.write(prefix + " " + " ".join(files) + "\n")
EOF

# A dependency's module that a test-utils feature turns on: the vhost
# crate's frontend (keelfs-vhost's test-utils = vhost/vhost-user-frontend).
forbidden='vhost::vhost_user::frontend::'
while read -r prefix _; do forbidden+="|$prefix"; done <"$work/modules"
# The environment variables that test support reads.
variables=$(cut -d' ' -f2- "$work/modules" | xargs -r grep -rhoE '"KEELFS_[A-Z0-9_]+"' | tr -d '"' | sort -u)
echo "check-release-symbols: test support by rule: $(wc -l <"$work/modules") gated modules ($(cut -d' ' -f1 "$work/modules" | tr '\n' ' ')), variables: $(echo "$variables" | tr '\n' ' ')"
for expected in keelfs_bdev::fault:: keelfs_bdev::rbd::scratch:: keelfs_vhost::frontend:: keelfsd::test_hooks::; do
  grep -q "^$expected " "$work/modules" || { echo "check-release-symbols: the rule no longer finds $expected: is it still gated?" >&2; exit 1; }
done

cargo build --release -q -p keelfsd
bin=target/release/keelfsd
nm -C "$bin" >"$work/symbols"
# The check is only as good as the symbol names it sees: each layer crate
# must show up under its own path, or a change of naming (a stripped
# binary, another mangling) would let anything through.
for present in keelfs_bdev:: keelfs_reactor:: keelfs_fs:: keelfs_vhost:: keelfs_base:: keelfsd::; do
  if ! grep -q "$present" "$work/symbols"; then
    echo "check-release-symbols: no $present symbol in $bin: cannot check it" >&2
    exit 1
  fi
done

cargo build --release -q -p keelfs-bench
control=$(nm -C target/release/keelfs-bench | grep -cE "$forbidden" || true)
if ((control == 0)); then
  echo "check-release-symbols: the patterns match nothing in keelfs-bench either: they are stale" >&2
  exit 1
fi
if grep -E "$forbidden" "$work/symbols" >&2; then
  echo "check-release-symbols: FAILED: test support above is in $bin" >&2
  exit 1
fi
strings -a "$bin" >"$work/strings"
for variable in $variables; do
  if grep -q "$variable" "$work/strings"; then
    echo "check-release-symbols: FAILED: $bin names $variable, which only test support reads" >&2
    exit 1
  fi
done
echo "check-release-symbols: $bin ($(wc -l <"$work/symbols") symbols) has no test support" \
  "(keelfs-bench, the control, has $control such symbols)"
