# shellcheck shell=bash
# Sourced by run-vhost.sh and run-seeds.sh: what a keelfsd's idle policy
# chose in a run of the poll-mode matrix, so that a mode's figure can be
# read beside the decision behind it.
#
# poll_state KEELFSD RPC_SOCKET TAGS: one JSON line, {TAGS "bench":
# "poll-state", "reactors": [each reactor's `poll` object from `keelfsd
# stats`]}. TAGS is a list of "key":value, pairs, ending in a comma.
poll_state() {
  local keelfsd=$1 rpc=$2 tags=$3
  "$keelfsd" stats --rpc "$rpc" | python3 -c '
import json, sys
polls = [r.get("poll") for r in json.load(sys.stdin)["reactors"]]
tags = json.loads("{" + sys.argv[1].rstrip(",") + "}")
print(json.dumps({**tags, "bench": "poll-state", "reactors": polls}))' "$tags"
}
