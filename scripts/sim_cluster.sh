#!/usr/bin/env bash
# A simulated multi-node cluster on one Linux machine, for bandwidth experiments.
#
#   sim_cluster.sh up N RATE        N nodes joined by links of RATE (100mbit, 1gbit, unlimited)
#   sim_cluster.sh rate RATE        reshape every inter-node link
#   sim_cluster.sh down             end the processes inside the namespaces, delete them
#   sim_cluster.sh exec NODE CMD... run CMD inside node NODE's namespace
#   sim_cluster.sh status           namespaces, addresses, shaping, byte counters
#   sim_cluster.sh shape-args RATE  the tbf arguments RATE maps to (no root needed)
#
# Topology: node i is the network namespace zpp-node{i} with one veth, zpp-veth{i}, addressed
# 10.77.0.{i+1}/24. Its peer, zpp-port{i}, sits in the namespace zpp-br, enslaved to the
# bridge zpp-bridge: a non-blocking switch. Ranks of one node share its namespace, so their
# traffic to each other goes over the namespace's loopback and is never shaped.
#
# Shaping: a tbf qdisc on both ends of every veth (node -> switch and switch -> node), so each
# node has an uplink and a downlink of RATE, as a NIC of that speed would. netem is not
# available on every kernel this runs on; tbf is. The bucket (burst) must hold about 2 ms of
# traffic at RATE: smaller, and the bucket empties between timer ticks and the link delivers
# less than RATE; it is at least 32 KiB so that one full-size TSO segment always fits. The
# queue (limit) holds 20 ms at RATE on top of the burst: TCP then sees loss-free pacing
# instead of drops, with a bounded queueing delay.
#
# Only addresses inside namespaces this script creates are used: no default route, no NAT,
# nothing in the root namespace changes. Needs root, ip (iproute2) and tc.
set -euo pipefail

readonly NODE_NS_PREFIX="zpp-node"
readonly SWITCH_NS="zpp-br"
readonly SWITCH_DEV="zpp-bridge"
readonly NODE_IF_PREFIX="zpp-veth"
readonly PORT_IF_PREFIX="zpp-port"
readonly SUBNET="10.77.0"
readonly MAX_NODES=64
readonly MIN_BURST_BYTES=32768
readonly BURST_MICROSECONDS=2000
readonly QUEUE_MICROSECONDS=20000
readonly LOCK_FILE="/run/lock/zpp-sim-cluster.lock"

die() {
  echo "sim_cluster.sh: error: $*" >&2
  exit 2
}

usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
}

# ---- rates and tbf parameters (pure arithmetic, no root) -----------------------------------

# RATE -> bits per second on stdout; "unlimited" -> 0. Units are tc's decimal bit units.
rate_to_bits() {
  local rate="${1,,}"
  if [[ "$rate" == unlimited ]]; then
    echo 0
    return
  fi
  if [[ ! "$rate" =~ ^([0-9]+)(bit|kbit|mbit|gbit|tbit)$ ]]; then
    die "rate '$1' is not a number followed by bit, kbit, mbit, gbit or tbit (or 'unlimited')"
  fi
  local value="${BASH_REMATCH[1]}" unit="${BASH_REMATCH[2]}" multiplier
  case "$unit" in
    bit) multiplier=1 ;;
    kbit) multiplier=1000 ;;
    mbit) multiplier=1000000 ;;
    gbit) multiplier=1000000000 ;;
    tbit) multiplier=1000000000000 ;;
  esac
  local bits=$((10#$value * multiplier))
  ((bits > 0)) || die "rate '$1' must be above zero (use 'unlimited' for no shaping)"
  echo "$bits"
}

# tbf arguments for a link of BITS bits per second: "rate Rbit burst B limit L" (bytes).
tbf_args() {
  local bits="$1"
  local bytes_per_second=$((bits / 8))
  local burst=$((bytes_per_second * BURST_MICROSECONDS / 1000000))
  ((burst >= MIN_BURST_BYTES)) || burst=$MIN_BURST_BYTES
  local limit=$((burst + bytes_per_second * QUEUE_MICROSECONDS / 1000000))
  echo "rate ${bits}bit burst ${burst} limit ${limit}"
}

# ---- cluster state ---------------------------------------------------------------------------

require_root() {
  [[ $EUID -eq 0 ]] || die "needs root (network namespaces and tc); rerun with sudo"
  command -v ip >/dev/null || die "'ip' (iproute2) is not installed"
  command -v tc >/dev/null || die "'tc' (iproute2) is not installed"
}

# Serialize commands that change the cluster, so two concurrent 'up's cannot interleave.
take_lock() {
  mkdir -p "$(dirname "$LOCK_FILE")"
  exec 9>"$LOCK_FILE"
  flock -w 120 9 || die "another sim_cluster.sh command holds $LOCK_FILE"
}

# Names of this script's namespaces that exist now, one per line (nodes in index order).
our_namespaces() {
  ip netns list | awk '{print $1}' |
    grep -E "^(${NODE_NS_PREFIX}[0-9]+|${SWITCH_NS})$" | sort -V || true
}

node_count() {
  ip netns list | awk '{print $1}' | grep -cE "^${NODE_NS_PREFIX}[0-9]+$" || true
}

# True when exactly nodes 0..N-1 and the switch exist, each node wired and addressed.
cluster_matches() {
  local nodes="$1" i
  [[ "$(node_count)" == "$nodes" ]] || return 1
  ip netns list | awk '{print $1}' | grep -qx "$SWITCH_NS" || return 1
  for ((i = 0; i < nodes; i++)); do
    ip -n "${NODE_NS_PREFIX}$i" -4 addr show dev "${NODE_IF_PREFIX}$i" 2>/dev/null |
      grep -q "inet ${SUBNET}.$((i + 1))/24" || return 1
    ip -n "$SWITCH_NS" link show dev "${PORT_IF_PREFIX}$i" >/dev/null 2>&1 || return 1
  done
}

# ---- commands --------------------------------------------------------------------------------

apply_rate() {
  local rate="$1" bits args nodes i
  bits="$(rate_to_bits "$rate")"
  nodes="$(node_count)"
  ((nodes > 0)) || die "no simulated cluster is up; run: sim_cluster.sh up N RATE"
  for ((i = 0; i < nodes; i++)); do
    shape "${NODE_NS_PREFIX}$i" "${NODE_IF_PREFIX}$i" "$bits"
    shape "$SWITCH_NS" "${PORT_IF_PREFIX}$i" "$bits"
  done
  if ((bits == 0)); then
    echo "sim_cluster: $nodes node(s), links unshaped"
  else
    echo "sim_cluster: $nodes node(s), every link shaped to $rate ($(tbf_args "$bits"))"
  fi
}

# shape NAMESPACE DEVICE BITS: a tbf root qdisc on DEVICE's egress, or none when BITS is 0.
shape() {
  local namespace="$1" device="$2" bits="$3"
  if ((bits == 0)); then
    # No root qdisc to delete is the state we want already.
    tc -n "$namespace" qdisc del dev "$device" root 2>/dev/null || true
  else
    # shellcheck disable=SC2046  # tbf_args is a list of words by design
    tc -n "$namespace" qdisc replace dev "$device" root tbf $(tbf_args "$bits")
  fi
}

build_cluster() {
  local nodes="$1" i namespace
  ip netns add "$SWITCH_NS"
  ip -n "$SWITCH_NS" link set lo up
  ip -n "$SWITCH_NS" link add "$SWITCH_DEV" type bridge
  ip -n "$SWITCH_NS" link set "$SWITCH_DEV" up
  for ((i = 0; i < nodes; i++)); do
    namespace="${NODE_NS_PREFIX}$i"
    ip netns add "$namespace"
    ip -n "$namespace" link set lo up
    # Both ends are created directly in their namespaces: nothing appears in the root one.
    ip link add "${NODE_IF_PREFIX}$i" netns "$namespace" type veth \
      peer name "${PORT_IF_PREFIX}$i" netns "$SWITCH_NS"
    ip -n "$SWITCH_NS" link set "${PORT_IF_PREFIX}$i" master "$SWITCH_DEV" up
    ip -n "$namespace" addr add "${SUBNET}.$((i + 1))/24" dev "${NODE_IF_PREFIX}$i"
    ip -n "$namespace" link set "${NODE_IF_PREFIX}$i" up
  done
}

cmd_up() {
  (($# == 2)) || die "usage: sim_cluster.sh up N RATE"
  local nodes="$1" rate="$2"
  [[ "$nodes" =~ ^[0-9]+$ ]] && ((10#$nodes >= 1 && 10#$nodes <= MAX_NODES)) ||
    die "node count '$nodes' must be an integer from 1 to $MAX_NODES"
  nodes=$((10#$nodes))
  rate_to_bits "$rate" >/dev/null # reject a bad rate before touching anything
  require_root
  take_lock
  if cluster_matches "$nodes"; then
    apply_rate "$rate"
    return
  fi
  teardown quiet
  # A failure (or an interrupt) halfway must not leave half a cluster behind.
  trap remove_partial_cluster EXIT
  trap 'exit 130' INT TERM
  build_cluster "$nodes"
  apply_rate "$rate"
  trap - EXIT INT TERM
  echo "sim_cluster: up: nodes ${NODE_NS_PREFIX}0..$((nodes - 1)) at ${SUBNET}.1..$nodes," \
    "interfaces ${NODE_IF_PREFIX}{i}"
}

remove_partial_cluster() {
  local status=$?
  echo "sim_cluster.sh: up failed (status $status); removing what it created" >&2
  teardown quiet
  exit "$status"
}

cmd_rate() {
  (($# == 1)) || die "usage: sim_cluster.sh rate RATE"
  rate_to_bits "$1" >/dev/null
  require_root
  take_lock
  apply_rate "$1"
}

# End the processes inside one namespace by PID (TERM, then KILL after 3 s), then delete it.
remove_namespace() {
  local namespace="$1" pids pid waited
  pids="$(ip netns pids "$namespace" 2>/dev/null || true)"
  if [[ -n "$pids" ]]; then
    for pid in $pids; do kill -TERM "$pid" 2>/dev/null || true; done
    for ((waited = 0; waited < 30; waited++)); do
      [[ -z "$(ip netns pids "$namespace" 2>/dev/null || true)" ]] && break
      sleep 0.1
    done
    for pid in $(ip netns pids "$namespace" 2>/dev/null || true); do
      kill -KILL "$pid" 2>/dev/null || true
    done
  fi
  ip netns del "$namespace"
}

teardown() {
  local quiet="${1:-}" namespace removed=0
  for namespace in $(our_namespaces); do
    remove_namespace "$namespace"
    removed=$((removed + 1))
  done
  [[ -n "$quiet" ]] || echo "sim_cluster: down: removed $removed namespace(s)"
}

cmd_down() {
  (($# == 0)) || die "usage: sim_cluster.sh down"
  require_root
  take_lock
  teardown
}

cmd_exec() {
  (($# >= 2)) || die "usage: sim_cluster.sh exec NODE CMD..."
  local node="$1"
  shift
  [[ "$node" =~ ^[0-9]+$ ]] || die "node '$node' must be a node index (0, 1, ...)"
  require_root
  ip netns list | awk '{print $1}' | grep -qx "${NODE_NS_PREFIX}$((10#$node))" ||
    die "node $node does not exist (namespace ${NODE_NS_PREFIX}$((10#$node)))"
  exec ip netns exec "${NODE_NS_PREFIX}$((10#$node))" "$@"
}

cmd_status() {
  (($# == 0)) || die "usage: sim_cluster.sh status"
  require_root
  local nodes i namespace device
  nodes="$(node_count)"
  if ((nodes == 0)); then
    echo "sim_cluster: down (no ${NODE_NS_PREFIX}* namespaces)"
    return
  fi
  echo "sim_cluster: $nodes node(s); switch namespace $SWITCH_NS"
  for ((i = 0; i < nodes; i++)); do
    namespace="${NODE_NS_PREFIX}$i"
    device="${NODE_IF_PREFIX}$i"
    local address qdisc tx rx processes
    address="$(ip -n "$namespace" -4 -o addr show dev "$device" 2>/dev/null |
      awk '{print $4}')"
    qdisc="$(tc -n "$namespace" qdisc show dev "$device" root 2>/dev/null | head -n 1)"
    tx="$(ip netns exec "$namespace" cat "/sys/class/net/$device/statistics/tx_bytes")"
    rx="$(ip netns exec "$namespace" cat "/sys/class/net/$device/statistics/rx_bytes")"
    processes="$(ip netns pids "$namespace" | wc -l)"
    echo "  node $i: $namespace $device ${address:-no address} | ${qdisc:-no qdisc}" \
      "| tx $tx B rx $rx B | $processes process(es)"
  done
}

cmd_shape_args() {
  (($# == 1)) || die "usage: sim_cluster.sh shape-args RATE"
  local bits
  bits="$(rate_to_bits "$1")"
  if ((bits == 0)); then
    echo "unshaped"
  else
    tbf_args "$bits"
  fi
}

main() {
  (($# >= 1)) || {
    usage >&2
    exit 2
  }
  local command="$1"
  shift
  case "$command" in
    up) cmd_up "$@" ;;
    rate) cmd_rate "$@" ;;
    down) cmd_down "$@" ;;
    exec) cmd_exec "$@" ;;
    status) cmd_status "$@" ;;
    shape-args) cmd_shape_args "$@" ;;
    -h | --help | help) usage ;;
    *) die "unknown command '$command'; expected up, rate, down, exec, status or shape-args" ;;
  esac
}

main "$@"
