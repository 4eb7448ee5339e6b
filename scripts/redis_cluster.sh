#!/usr/bin/env bash
# A Redis Cluster on loopback for Narsil's Redis table store: its tests,
# benchmarks, and trying it out.
#
#   scripts/redis_cluster.sh start DIR [--masters N] [--replicas R] [--port P]
#   scripts/redis_cluster.sh stop DIR
#
# `start` needs Debian's redis-server (`scripts/setup_system.sh` installs
# it; this script never installs, since tests run it in parallel), starts
# N x (1 + R) nodes (default 3 masters, 1 replica each) on consecutive
# loopback ports from P (default: the first free run of ports from 7100),
# each in DIR/PORT (its config, log, pid and cluster state; no persistence:
# tables are reloaded with `narsil tables load`), joins them into a cluster,
# waits until every node sees every slot served and every replica has
# synced, and prints the seed list for `--table-store` (also in
# DIR/seeds). `stop` shuts every node of DIR down and removes DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

usage() { sed -n '4,6p' "$0" | sed 's/^# //' >&2; exit 2; }

require_redis() {
  command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 && return
  die "redis-server and redis-cli not found: scripts/setup_system.sh installs them (scripts/test.sh runs it)"
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# The first port from $1 with $2 free ports after it (the cluster bus uses
# port + 10000 too).
free_run() {
  local port=$1 count=$2 i ok
  while [ "$port" -lt 20000 ]; do
    ok=1
    for ((i = 0; i < count; i++)); do
      if ! port_free $((port + i)) || ! port_free $((port + i + 10000)); then ok=0; break; fi
    done
    [ "$ok" -eq 1 ] && { echo "$port"; return; }
    port=$((port + count))
  done
  die "no $count free ports between $1 and 20000"
}

start() {
  local dir="$1" masters=3 replicas=1 port=""
  shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --masters) masters="$2"; shift 2 ;;
      --replicas) replicas="$2"; shift 2 ;;
      --port) port="$2"; shift 2 ;;
      *) usage ;;
    esac
  done
  require_redis
  local nodes=$((masters * (1 + replicas)))
  # Clusters started at once (parallel tests) take turns choosing ports:
  # the lock is held until this cluster's nodes listen.
  exec 9>"${TMPDIR:-/tmp}/narsil-redis-ports.lock"
  flock 9
  [ -n "$port" ] || port=$(free_run 7100 "$nodes")
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  local addrs=() p
  for ((p = port; p < port + nodes; p++)); do
    mkdir -p "$dir/$p"
    cat >"$dir/$p/redis.conf" <<EOF
port $p
bind 127.0.0.1
protected-mode no
cluster-enabled yes
cluster-config-file $dir/$p/nodes.conf
cluster-node-timeout 2000
dir $dir/$p
daemonize yes
pidfile $dir/$p/redis.pid
logfile $dir/$p/redis.log
save ""
appendonly no
repl-diskless-sync-delay 0
cluster-replica-validity-factor 0
EOF
    redis-server "$dir/$p/redis.conf"
    addrs+=("127.0.0.1:$p")
  done
  for addr in "${addrs[@]}"; do
    for _ in $(seq 100); do
      redis-cli -h 127.0.0.1 -p "${addr#*:}" ping >/dev/null 2>&1 && break
      sleep 0.05
    done
  done
  flock -u 9
  redis-cli --cluster create "${addrs[@]}" --cluster-replicas "$replicas" --cluster-yes >"$dir/create.log" 2>&1 \
    || { cat "$dir/create.log" >&2; die "redis-cli --cluster create failed"; }
  # Every node, not only the first: a client checks `cluster_state` on
  # each node it connects to, and nodes learn the slots' owners one by one.
  for _ in $(seq 400); do
    local ready=1 addr replica
    for addr in "${addrs[@]}"; do
      redis-cli -p "${addr#*:}" cluster info 2>/dev/null | grep -q "cluster_state:ok" || { ready=0; break; }
    done
    if [ "$ready" -eq 1 ] &&
      [ "$(redis-cli -p "$port" cluster nodes 2>/dev/null | grep -c slave)" -eq $((masters * replicas)) ]; then
      for replica in "${addrs[@]:$masters}"; do
        redis-cli -p "${replica#*:}" info replication 2>/dev/null | grep -q "master_link_status:up" || ready=0
      done
      if [ "$ready" -eq 0 ]; then sleep 0.05; continue; fi
      local seeds
      seeds=$(printf 'redis://%s,' "${addrs[@]:0:$masters}")
      echo "${seeds%,}" >"$dir/seeds"
      cat "$dir/seeds"
      return
    fi
    sleep 0.05
  done
  die "the cluster in $dir did not reach cluster_state:ok with $((masters * replicas)) replicas"
}

stop() {
  local dir="$1" conf pid_file
  [ -d "$dir" ] || return 0
  # A node stopped by a test (SIGSTOP) would never answer its shutdown.
  for pid_file in "$dir"/*/redis.pid; do
    [ -f "$pid_file" ] && kill -CONT "$(cat "$pid_file")" 2>/dev/null || true
  done
  for conf in "$dir"/*/redis.conf; do
    [ -f "$conf" ] || continue
    redis-cli -p "$(sed -n 's/^port //p' "$conf")" shutdown nosave >/dev/null 2>&1 || true
  done
  for conf in "$dir"/*/redis.conf; do
    [ -f "$conf" ] || continue
    local pid_file="${conf%/redis.conf}/redis.pid"
    [ -f "$pid_file" ] && kill "$(cat "$pid_file")" 2>/dev/null || true
  done
  rm -rf "$dir"
}

[ $# -ge 2 ] || usage
command="$1"
shift
case "$command" in
  start) start "$@" ;;
  stop) stop "$1" ;;
  *) usage ;;
esac
