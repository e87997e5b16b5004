# shellcheck shell=bash
# Sourced by the RBD benchmarks (run from the repository's root): the dev
# cluster's OSD keeps its live data in RAM, so a run stops, cleanly, when
# the host runs short.

# stop_below_min_avail PROG MIB: exit 3 when less than MIB MiB of memory
# is available.
stop_below_min_avail() {
  local avail
  avail=$(awk '/^MemAvailable:/ { print int($2 / 1024) }' /proc/meminfo)
  if ((avail < $2)); then
    echo "$1: only $avail MiB of memory available (--min-avail $2): stopping" >&2
    exit 3
  fi
}
