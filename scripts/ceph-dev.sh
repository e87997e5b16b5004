#!/usr/bin/env bash
# A one-node Ceph cluster (one monitor, one manager, one BlueStore OSD on a
# loop device over a sparse file) for keelfs's RBD tests and demos, from Debian's packages
# only: no cephadm, no containers, no ceph-volume. The cluster listens on
# the bridge keelfs-ceph0 (10.87.0.1/24), so that network namespaces made
# by `host add` reach it as if they were other machines.
#
#   ceph-dev.sh up | down | status | host add NAME ADDR | host del NAME
#
# Exit status: 0 done, 1 failed, 2 usage error.
set -Eeuo pipefail

prog=ceph-dev.sh
dir=${KEELFS_CEPH_DIR:-/var/lib/keelfs-ceph}
block=${KEELFS_CEPH_BLOCK:-/dev/shm/keelfs-ceph-osd0.block}
block_size=$((32 << 30))
etc=/etc/ceph
lock=/run/keelfs-ceph.lock
bridge=keelfs-ceph0
net=10.87.0
addr=$net.1
marker="# written by keelfs scripts/ceph-dev.sh"
pool=keelfs
# Each wait below is bounded; up as a whole takes well under two minutes.
wait_mon=30 wait_osd=60 wait_pgs=60 wait_mgr=60 wait_health=60

usage() {
  cat <<EOF
Usage: scripts/$prog up | down | status
       scripts/$prog host add NAME ADDR | host del NAME

A one-node Ceph cluster for keelfs's RBD tests and demos: one monitor, one
manager and one BlueStore OSD on a loop device over a sparse
$((block_size >> 30)) GiB file, cephx on, all listening on $addr, the address of the bridge $bridge ($net.0/24).

up              Start the cluster (about 20 s from nothing), make pool
                '$pool' (size 1, rbd), wait for HEALTH_OK and print the
                seconds it took. Quick when the cluster is already up and
                healthy; concurrent calls wait for each other. Writes
                $etc/ceph.conf, $etc/ceph.client.admin.keyring and
                $etc/ceph.client.keelfs.keyring (client.keelfs: rbd on pool
                '$pool' only), each marked as written here, and refuses to
                overwrite files it did not write.
down            Stop the daemons, remove the state, the loop device and block file, the
                bridge, the 'host add' namespaces and the files in $etc
                written here. Fine when nothing is up.
status          Print 'ceph -s'; exit 1 when the cluster is not up.
host add NAME ADDR
                Make network namespace NAME with lo up and a veth whose outer
                end joins $bridge and whose inner end (eth0) has ADDR/24
                (ADDR in $net.2-254): 'ip netns exec NAME ceph -s' and
                librbd clients in it reach the cluster. down removes it.
host del NAME   Remove namespace NAME made by 'host add'.
-h, --help      Show this help.

There is one such cluster on a machine: the bridge, its address and the
files in $etc are the same whatever the environment says.
Environment: KEELFS_CEPH_DIR (state: data, logs, pid files; default
/var/lib/keelfs-ceph), KEELFS_CEPH_BLOCK (the OSD's sparse block file;
default /dev/shm/keelfs-ceph-osd0.block: in RAM, so the live data in the
cluster counts against memory and /dev/shm's size; BlueStore discards
what it frees through the loop device, which gives it back).
Exit status: 0 done, 1 failed, 2 usage error.
EOF
}

usage_error() {
  echo "$prog: error: $*" >&2
  echo "Try 'scripts/$prog --help'." >&2
  exit 2
}
fail() {
  echo "$prog: error: $*" >&2
  exit 1
}
say() { echo "ceph-dev: $*"; }

step="parsing the arguments"
# A failing command anywhere names the step it broke.
on_error() {
  local rc=$?
  echo "$prog: error: step \"$step\" failed (exit $rc)" >&2
  [[ -d $dir/log ]] && echo "$prog: the daemons' logs are in $dir/log" >&2
  exit "$rc"
}
trap on_error ERR

have() { command -v "$1" >/dev/null 2>&1; }
# quiet CMD...: runs CMD without its chatter, which is printed only when
# it fails.
quiet() {
  local out
  if ! out=$("$@" 2>&1); then
    echo "$out" >&2
    return 1
  fi
}

# The admin's ceph CLI, on the client configuration written by up.
cceph() {
  ceph --conf "$etc/ceph.conf" --name client.admin --keyring "$etc/ceph.client.admin.keyring" \
    --connect-timeout 10 "$@"
}

# ours FILE: FILE starts with the marker line.
ours() {
  local first
  [[ -f $1 ]] && IFS= read -r first <"$1" && [[ $first == "$marker" ]]
}

# write_marked FILE MODE: writes stdin to FILE after the marker line, in
# one rename, refusing to replace a file that someone else wrote.
write_marked() {
  local f=$1 mode=$2
  if [[ -e $f ]] && ! ours "$f"; then
    fail "$f exists and was not written by $prog (another cluster's?); not overwriting it"
  fi
  { echo "$marker"; cat; } >"$f.keelfs-tmp"
  chmod "$mode" "$f.keelfs-tmp"
  mv -f "$f.keelfs-tmp" "$f"
}

# wait_until SECONDS CMD...: runs CMD every half second until it succeeds;
# false when SECONDS pass first.
wait_until() {
  local end=$((SECONDS + $1))
  shift
  until "$@"; do
    ((SECONDS < end)) || return 1
    sleep 0.5
  done
}

# The daemons: name (as ceph says it), program.
daemons=("mon.a ceph-mon" "mgr.x ceph-mgr" "osd.0 ceph-osd")

# pid_of NAME PROGRAM: the pid of the running daemon NAME that up
# started, from its pid file; false when it is not running.
pid_of() {
  local pid comm
  read -r pid 2>/dev/null <"$dir/run/$1.pid" || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  read -r comm 2>/dev/null <"/proc/$pid/comm" || return 1
  [[ $comm == "$2" ]] || return 1
  echo "$pid"
}

# Every process running on this cluster's daemon configuration: those
# with pid files and any that lost theirs.
our_pids() {
  local p i args
  for p in /proc/[0-9]*; do
    mapfile -d '' -t args 2>/dev/null <"$p/cmdline" || continue
    case "${args[0]:-}" in
      ceph-mon|ceph-mgr|ceph-osd) ;;
      *) continue ;;
    esac
    for ((i = 1; i + 1 < ${#args[@]}; i++)); do
      if [[ ${args[i]} == --conf && ${args[i + 1]} == "$dir/ceph.conf" ]]; then
        echo "${p#/proc/}"
        break
      fi
    done
  done
}

# start_daemon NAME PROGRAM ARGS...: starts one daemon in the foreground
# of its own session, its output in its log directory, and writes its pid
# file. The lock's descriptor is closed for it: a daemon must not hold
# up's lock.
start_daemon() {
  local name=$1 program=$2
  shift 2
  setsid nohup "$program" -f --conf "$dir/ceph.conf" "$@" \
    </dev/null >>"$dir/log/$name.out" 2>&1 9>&- &
  echo $! >"$dir/run/$name.pid"
}

ensure_bridge() {
  if ! ip link show "$bridge" >/dev/null 2>&1; then
    ip link add "$bridge" type bridge
  fi
  if ! ip -4 addr show dev "$bridge" | grep -q "inet $addr/24"; then
    ip addr add "$addr/24" dev "$bridge"
  fi
  ip link set "$bridge" up
}

mon_answers() { cceph mon stat >/dev/null 2>&1; }
osd_up() { cceph osd stat 2>/dev/null | grep -q '1 up.*1 in'; }
mgr_up() { cceph mgr stat 2>/dev/null | grep -q '"available": true'; }
pgs_clean() { cceph pg stat 2>/dev/null | grep -Eq '^([0-9]+) pgs: \1 active\+clean;'; }
healthy() { [[ $(cceph health 2>/dev/null) == HEALTH_OK ]]; }

# Writes the daemons' configuration (in the state directory; clients use
# $etc/ceph.conf).
write_daemon_conf() {
  cat >"$dir/ceph.conf" <<EOF
$marker
[global]
fsid = $1
mon_host = $addr
public_network = $net.0/24
public_addr = $addr
cluster_addr = $addr
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
# Clients must reclaim their global_id securely (Pacific's fix for
# CVE-2021-20288), which also silences the AUTH_INSECURE_GLOBAL_ID_RECLAIM
# warnings the proper way.
auth_allow_insecure_global_id_reclaim = false
run_dir = $dir/run
crash_dir = $dir/crash
pid_file = $dir/run/\$name.pid
log_file = $dir/log/\$name.log
mon_cluster_log_file = $dir/log/\$cluster.\$channel.log
# One OSD: pools of one replica, placed on it alone.
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
mon_allow_pool_delete = true
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
# The state directory's file system may well be fuller than Ceph's 30 %
# warning level (the monitor's store is small); still stop short of full.
mon_data_avail_warn = 5
mon_data_avail_crit = 2

[mon]
mon_data = $dir/mon/ceph-a
mon_memory_target = 268435456
# Only the always-on modules: no restful, iostat, nfs (or dashboard).
mgr_initial_modules =

[mgr]
mgr_data = $dir/mgr/ceph-x

[osd]
osd_data = $dir/osd/ceph-0
osd_objectstore = bluestore
# A loop device over the block file: BlueStore discards what it frees, and
# the loop driver punches the file, so RAM holds only live data (BlueStore
# cannot discard on a plain file, which then only grows).
bluestore_block_path = $2
bdev_enable_discard = true
bdev_async_discard = true
# A file reports itself rotational; one in RAM (tmpfs) is better served
# by the SSD settings (no deferred writes). Few threads: a small machine.
bluestore_debug_enforce_settings = ssd
osd_op_num_shards = 2
osd_op_num_threads_per_shard = 2
# Its minimum is 896 MiB (osd_memory_base + osd_memory_cache_min).
osd_memory_target = 1073741824
EOF
}

write_client_conf() {
  write_marked "$etc/ceph.conf" 0644 <<EOF
# The keelfs dev cluster (scripts/ceph-dev.sh up); 'down' removes this.
[global]
fsid = $1
mon_host = $addr
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
EOF
}

# keyring_of KEY NAME: a keyring holding NAME's KEY, on stdout.
keyring_of() {
  local key=$1 name=$2
  printf '[%s]\n\tkey = %s\n' "$name" "$key"
}

teardown() {
  local f d pid pids name program
  # The namespaces made by host add (their veths go with them).
  if [[ -d $dir/hosts ]]; then
    for f in "$dir"/hosts/*; do
      [[ -e $f ]] || continue
      del_host "${f##*/}"
    done
  fi
  # The daemons: TERM, up to 20 s, then KILL.
  mapfile -t pids < <(
    {
      for d in "${daemons[@]}"; do
        read -r name program <<<"$d"
        pid_of "$name" "$program" || true
      done
      our_pids
    } | sort -un
  )
  if ((${#pids[@]})); then
    step="stopping the daemons"
    say "$step (${pids[*]})"
    kill -TERM "${pids[@]}" 2>/dev/null || true
    local end=$((SECONDS + 20))
    for pid in "${pids[@]}"; do
      while kill -0 "$pid" 2>/dev/null; do
        if ((SECONDS >= end)); then
          say "pid $pid did not stop in 20 s: killing it"
          kill -KILL "$pid" 2>/dev/null || true
          break
        fi
        sleep 0.2
      done
    done
    for pid in "${pids[@]}"; do
      while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    done
  fi
  step="removing the bridge $bridge"
  if ip link show "$bridge" >/dev/null 2>&1; then
    ip link del "$bridge"
  fi
  # Only the block file up recorded is ours to detach and remove, whatever
  # KEELFS_CEPH_BLOCK says now.
  local recorded=""
  if [[ -f $dir/block-path ]]; then read -r recorded <"$dir/block-path"; fi
  step="detaching the loop device"
  if [[ -f $dir/loop-path && -n $recorded ]]; then
    local loopdev
    read -r loopdev <"$dir/loop-path"
    if [[ -n $loopdev ]] && losetup "$loopdev" 2>/dev/null | grep -qF "($recorded)"; then
      losetup -d "$loopdev"
    fi
  fi
  step="removing the block file"
  if [[ -n $recorded && -f $recorded ]]; then rm -f -- "$recorded"; fi
  step="removing the files in $etc written here"
  for f in "$etc"/*; do
    if ours "$f"; then rm -f -- "$f"; fi
  done
  rm -f -- "$etc"/*.keelfs-tmp
  step="removing $dir"
  if [[ -e $dir ]]; then
    if [[ -e $dir/KEELFS-CEPH-DEV ]]; then
      rm -rf -- "$dir"
    elif rmdir -- "$dir" 2>/dev/null; then
      :
    else
      fail "$dir has no KEELFS-CEPH-DEV mark: not ceph-dev.sh's state; not removing it"
    fi
  fi
}

# Whether the OSD's loop device is still attached to the block file (it
# is gone after a reboot, and the cluster must be made again).
loop_attached() {
  local loopdev="" recorded=""
  [[ -f $dir/loop-path ]] && read -r loopdev <"$dir/loop-path"
  [[ -f $dir/block-path ]] && read -r recorded <"$dir/block-path"
  [[ -n $loopdev && -n $recorded ]] && losetup "$loopdev" 2>/dev/null | grep -qF "($recorded)"
}

# Starts a daemon of a cluster set up before, if it is not running.
restart_dead() {
  local d name program
  for d in "${daemons[@]}"; do
    read -r name program <<<"$d"
    if ! pid_of "$name" "$program" >/dev/null; then
      say "restarting $name"
      start_daemon "$name" "$program" --id "${name#*.}"
    fi
  done
}

restart_and_check() { restart_dead; mgr_up && healthy; }

all_alive() {
  local d name program
  for d in "${daemons[@]}"; do
    read -r name program <<<"$d"
    pid_of "$name" "$program" >/dev/null || return 1
  done
}

# Fails up naming the step, with the cluster's own words when it has any.
fail_wait() {
  echo "$prog: error: step \"$step\": $1" >&2
  cceph health detail 2>/dev/null | sed 's/^/  /' >&2 || true
  echo "$prog: the daemons' logs are in $dir/log" >&2
  exit 1
}

wait_healthy() {
  step="waiting for HEALTH_OK"
  wait_until "$wait_health" healthy || fail_wait "no HEALTH_OK within $wait_health s"
}

up() {
  local start=$SECONDS
  step="checking the packages"
  local t
  for t in ceph ceph-mon ceph-mgr ceph-osd ceph-authtool monmaptool rbd ip setsid nohup flock; do
    have "$t" || fail "$t is missing: run scripts/setup.sh"
  done
  step="checking $etc"
  local f
  for f in ceph.conf ceph.client.admin.keyring ceph.client.keelfs.keyring; do
    if [[ -e $etc/$f ]] && ! ours "$etc/$f"; then
      fail "$etc/$f exists and was not written by $prog (another cluster's?); not overwriting it"
    fi
  done

  local recorded=""
  if [[ -f $dir/block-path ]]; then read -r recorded <"$dir/block-path"; fi
  # A cluster set up before, whose data and client files are all there.
  if [[ -e $dir/up.done && -n $recorded && -f $recorded ]] && loop_attached && ours "$etc/ceph.conf" &&
    ours "$etc/ceph.client.admin.keyring" && ours "$etc/ceph.client.keelfs.keyring"; then
    step="checking the running cluster"
    if all_alive && healthy; then
      say "already up and healthy ($addr, pool $pool)"
      return 0
    fi
    # Set up before: start what stopped (a daemon may still be on its way
    # out) until the cluster is healthy again.
    step="restarting the stopped daemons"
    ensure_bridge
    wait_until $((wait_osd + wait_health)) restart_and_check ||
      fail_wait "no HEALTH_OK within $((wait_osd + wait_health)) s"
    say "up in $((SECONDS - start)) s (was up already; HEALTH_OK)"
    return 0
  fi
  if [[ -e $dir ]]; then
    say "clearing what an earlier cluster left (an unfinished up, a reboot)"
    teardown
  fi

  step="making the state directory $dir"
  mkdir -p "$dir"
  touch "$dir/KEELFS-CEPH-DEV"
  mkdir -p "$dir"/{run,log,crash,hosts,mon,mgr/ceph-x,osd/ceph-0}
  echo "$block" >"$dir/block-path"
  mkdir -p "$etc" "$(dirname "$block")"

  step="making the bridge $bridge ($addr/24)"
  say "$step"
  ensure_bridge

  step="making the keys and the monitor map"
  say "$step"
  local fsid
  fsid=$(cat /proc/sys/kernel/random/uuid)
  step="making the loop device over $block"
  say "$step"
  # Never another's file: teardown above removed any block file of ours.
  [[ ! -e $block ]] || fail "$block exists and is not this cluster's block file; not overwriting it"
  truncate -s "$block_size" "$block"
  local loopdev
  loopdev=$(losetup --find --show "$block")
  echo "$loopdev" >"$dir/loop-path"
  write_daemon_conf "$fsid" "$loopdev"
  write_client_conf "$fsid"
  local k=$dir/mon/keyring
  quiet ceph-authtool --create-keyring "$k" --gen-key -n mon. --cap mon 'allow *'
  quiet ceph-authtool "$k" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mds 'allow *' --cap mgr 'allow *'
  quiet ceph-authtool "$k" --gen-key -n mgr.x \
    --cap mon 'allow profile mgr' --cap osd 'allow *' --cap mds 'allow *'
  quiet ceph-authtool "$k" --gen-key -n client.keelfs \
    --cap mon 'profile rbd' --cap osd "profile rbd pool=$pool" --cap mgr "profile rbd pool=$pool"
  keyring_of "$(ceph-authtool "$k" -p -n client.admin)" client.admin |
    write_marked "$etc/ceph.client.admin.keyring" 0600
  keyring_of "$(ceph-authtool "$k" -p -n client.keelfs)" client.keelfs |
    write_marked "$etc/ceph.client.keelfs.keyring" 0600
  keyring_of "$(ceph-authtool "$k" -p -n mgr.x)" mgr.x >"$dir/mgr/ceph-x/keyring"
  quiet monmaptool --create --fsid "$fsid" --addv a "[v2:$addr:3300,v1:$addr:6789]" "$dir/mon/monmap"

  step="making the monitor's store"
  say "$step"
  quiet ceph-mon --conf "$dir/ceph.conf" --mkfs --id a --monmap "$dir/mon/monmap" --keyring "$k"
  step="starting the monitor mon.a"
  say "$step"
  start_daemon mon.a ceph-mon --id a
  wait_until "$wait_mon" mon_answers || fail_wait "the monitor did not answer within $wait_mon s"

  step="starting the manager mgr.x"
  say "$step"
  start_daemon mgr.x ceph-mgr --id x

  step="making the OSD (BlueStore on a loop device over $block, $((block_size >> 30)) GiB sparse)"
  say "$step"
  local uuid key id
  uuid=$(cat /proc/sys/kernel/random/uuid)
  key=$(ceph-authtool --gen-print-key)
  id=$(printf '{"cephx_secret": "%s"}' "$key" | cceph osd new "$uuid" -i -)
  [[ $id == 0 ]] || fail "ceph osd new gave the OSD id '$id', not 0"
  keyring_of "$key" osd.0 >"$dir/osd/ceph-0/keyring"
  if ! ceph-osd --conf "$dir/ceph.conf" --id 0 --mkfs --osd-uuid "$uuid" >>"$dir/log/osd.0.mkfs.out" 2>&1; then
    grep -a ERROR "$dir/log/osd.0.mkfs.out" | tail -n 3 >&2 || true
    fail "step \"$step\": ceph-osd --mkfs failed (see $dir/log/osd.0.mkfs.out and osd.0.log)"
  fi
  step="starting the OSD osd.0"
  say "$step"
  start_daemon osd.0 ceph-osd --id 0

  step="making the pool $pool"
  say "$step"
  quiet cceph osd pool create "$pool" 8 8 replicated
  quiet cceph osd pool set "$pool" size 1 --yes-i-really-mean-it
  quiet cceph osd pool set "$pool" min_size 1
  step="waiting for the OSD"
  wait_until "$wait_osd" osd_up || fail_wait "osd.0 did not come up within $wait_osd s"
  step="waiting for the placement groups"
  wait_until "$wait_pgs" pgs_clean || fail_wait "the placement groups were not active+clean within $wait_pgs s"
  step="rbd pool init $pool"
  say "$step"
  quiet rbd --conf "$etc/ceph.conf" --id admin pool init "$pool"
  step="waiting for the manager"
  wait_until "$wait_mgr" mgr_up || fail_wait "mgr.x was not available within $wait_mgr s"
  wait_healthy
  touch "$dir/up.done"
  say "up in $((SECONDS - start)) s: HEALTH_OK, mon $addr (v2 3300, v1 6789), pool $pool," \
    "client.keelfs in $etc/ceph.client.keelfs.keyring"
}

down() {
  teardown
  say "down"
}

status() {
  if [[ ! -e $dir/up.done ]] || ! ours "$etc/ceph.conf"; then
    echo "$prog: the dev cluster is not up (scripts/$prog up)" >&2
    exit 1
  fi
  step="ceph -s"
  cceph -s
}

netns_exists() { ip netns list | cut -d' ' -f1 | grep -qxF -- "$1"; }

# del_host NAME: removes namespace NAME and its record.
del_host() {
  local name=$1 rec=$dir/hosts/$1 a=""
  step="host del $name"
  if [[ -f $rec ]]; then read -r a <"$rec"; fi
  if netns_exists "$name"; then
    ip netns del "$name"
  fi
  if [[ -n $a ]] && ip link show "kceph-h${a##*.}" >/dev/null 2>&1; then
    ip link del "kceph-h${a##*.}"
  fi
  rm -f -- "$rec"
}

host_add() {
  local name=$1 a=$2 f
  step="host add $name $a"
  [[ -e $dir/up.done ]] || fail "the dev cluster is not up: run scripts/$prog up first"
  if [[ -e $dir/hosts/$name ]]; then
    [[ $(cat "$dir/hosts/$name") == "$a" ]] || fail "host $name already exists with address $(cat "$dir/hosts/$name")"
    if netns_exists "$name" && ip -n "$name" -4 addr show dev eth0 2>/dev/null | grep -qF " $a/"; then
      say "host $name ($a) is already there"
      return 0
    fi
    say "host $name was left half made: making it again"
    del_host "$name"
  fi
  if netns_exists "$name"; then
    fail "network namespace $name exists and was not made by $prog"
  fi
  for f in "$dir"/hosts/*; do
    [[ -e $f ]] || continue
    [[ $(cat "$f") == "$a" ]] || continue
    # A host no process runs in is one an interrupted test left behind.
    [[ -z $(ip netns pids "${f##*/}" 2>/dev/null) ]] || fail "address $a is taken by host ${f##*/}"
    say "reclaiming $a from host ${f##*/}, which nothing runs in"
    del_host "${f##*/}"
  done
  local outer=kceph-h${a##*.}
  ip link del "$outer" 2>/dev/null || true
  # Recorded first, so that down removes a host that failed half way.
  echo "$a" >"$dir/hosts/$name"
  ip netns add "$name"
  ip link add "$outer" type veth peer name eth0 netns "$name"
  ip link set "$outer" master "$bridge" up
  ip -n "$name" link set lo up
  ip -n "$name" addr add "$a/24" dev eth0
  ip -n "$name" link set eth0 up
  say "host $name: $a on $bridge (ip netns exec $name ...)"
}

host_del() {
  local name=$1
  [[ -e $dir/hosts/$name ]] || fail "no host $name made by $prog"
  del_host "$name"
  say "host $name removed"
}

valid_name() { [[ $1 =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$ ]]; }
valid_addr() {
  [[ $1 =~ ^10\.87\.0\.([0-9]{1,3})$ ]] || return 1
  local o=${BASH_REMATCH[1]}
  [[ $o == "${o#0}" || $o == 0 ]] && ((o >= 2 && o <= 254))
}

(($#)) || usage_error "no command"
case "$1" in
  -h|--help) (($# == 1)) || usage_error "unexpected argument '$2'"; usage; exit 0 ;;
  up|down|status) (($# == 1)) || usage_error "unexpected argument '$2'"; cmd=$1 ;;
  host)
    case "${2:-}" in
      add)
        (($# == 4)) || usage_error "usage: host add NAME ADDR"
        valid_name "$3" || usage_error "bad host name '$3' (letters, digits, '_', '.', '-')"
        valid_addr "$4" || usage_error "bad address '$4' (want $net.2 to $net.254)"
        cmd=host_add ;;
      del)
        (($# == 3)) || usage_error "usage: host del NAME"
        valid_name "$3" || usage_error "bad host name '$3'"
        cmd=host_del ;;
      *) usage_error "unknown host command '${2:-}' (add or del)" ;;
    esac ;;
  *) usage_error "unknown argument '$1'" ;;
esac

((EUID == 0)) || fail "run as root"
unset CEPH_ARGS
case "$cmd" in
  status) status ;;
  *)
    step="taking the lock $lock"
    exec 9>>"$lock"
    flock -w 600 9 || fail "another $prog held $lock for 10 minutes"
    case "$cmd" in
      up) up ;;
      down) down ;;
      host_add) host_add "$3" "$4" ;;
      host_del) host_del "$3" ;;
    esac ;;
esac
