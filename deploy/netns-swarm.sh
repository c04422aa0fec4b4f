#!/usr/bin/env bash
# netns-swarm.sh: a coordinator and four nodes in network namespaces on 10.77.0.0/24, joined by a
# bridge in a hub namespace, each node's egress shaped with tc (HTB per destination + tbf), as root.
#
#   deploy/netns-swarm.sh up                 create tn-hub, tn-coord, tn-n1..tn-n4 and shape the links
#   deploy/netns-swarm.sh down               delete them (also removes every veth and qdisc)
#   deploy/netns-swarm.sh run n1 CMD...      run CMD inside tn-n1 (name with or without the prefix)
#   deploy/netns-swarm.sh addr n1            print n1's address (10.77.0.11)
#   deploy/netns-swarm.sh status             namespaces, addresses and the tc counters
#
# Example swarm (each command in its own terminal or with &):
#   deploy/netns-swarm.sh run coord tahnode coordinator --listen 10.77.0.10:7000 --http 10.77.0.10:8080 --stages 3
#   deploy/netns-swarm.sh run n1 tahnode join --coordinator 10.77.0.10:7000 --stage auto \
#       --listen 10.77.0.11:7100 --advertise 10.77.0.11:7100 --node-id n1
#
# Shaping. Every namespace's eth0 has an HTB root used only to classify by destination address
# (u32 filters); each class carries a tbf with the rate. The default class gets the namespace's
# rate from RATE below; a pair listed in TN_SLOW_LINKS gets its own class, in both directions,
# so exactly that link is slow (a tbf on the whole interface would slow every link of the node).
# Each class is shaped on its own: a node's fast links do not share one budget.
# netem is not used (not every kernel has it). Nothing touches the root namespace: the bridge
# lives in the hub namespace and has no address, so traffic only flows between the namespaces.
#
# Environment:
#   TN_PREFIX      namespace name prefix (default "tn-"; another prefix runs a second swarm beside it)
#   TN_RATES       per-namespace egress overrides in Mbit/s, e.g. "n1=100 coord=1000"
#   TN_SLOW_LINKS  slow pairs, "a-b:Mbit ..." (default "n2-n3:20"; "" for none)
#   TN_BURST       tbf burst (default: 32kbit, or 1 ms of the rate when that is larger)

set -euo pipefail

PREFIX=${TN_PREFIX-tn-}
HUB=${PREFIX}hub
NAMES=(coord n1 n2 n3 n4)
declare -A ADDR=([coord]=10.77.0.10 [n1]=10.77.0.11 [n2]=10.77.0.12 [n3]=10.77.0.13 [n4]=10.77.0.14)
declare -A RATE=([coord]=1000 [n1]=200 [n2]=200 [n3]=200 [n4]=200)   # Mbit/s, default egress
SLOW_LINKS=${TN_SLOW_LINKS-n2-n3:20}
LATENCY=400ms

die() { echo "netns-swarm: $*" >&2; exit 1; }

for kv in ${TN_RATES-}; do
    name=${kv%%=*}
    [[ -n ${ADDR[$name]+x} ]] || die "TN_RATES names an unknown namespace '$name' (known: ${NAMES[*]})"
    [[ ${kv#*=} =~ ^[0-9]+$ ]] || die "TN_RATES: '$kv' is not NAME=Mbit"
    RATE[$name]=${kv#*=}
done

for pair in $SLOW_LINKS; do  # checked before anything is created
    mbit=${pair#*:}; a=${pair%%:*}; b=${a#*-}; a=${a%%-*}
    [[ $pair == *-*:* && -n ${ADDR[$a]+x} && -n ${ADDR[$b]+x} && $a != "$b" && $mbit =~ ^[0-9]+$ ]] \
        || die "bad TN_SLOW_LINKS entry '$pair' (want a-b:Mbit with a, b among ${NAMES[*]})"
done

short() {  # n1 | tn-n1 -> n1
    local name=${1#"$PREFIX"}
    [[ -n ${ADDR[$name]+x} ]] || die "unknown namespace '$1' (known: ${NAMES[*]})"
    echo "$name"
}

burst_for() {  # tbf burst for a rate in Mbit/s: at least 32kbit (4 KB), else 1 ms worth of bytes
    if [[ -n ${TN_BURST-} ]]; then echo "$TN_BURST"; return; fi
    local bytes=$(( $1 * 1000000 / 8 / 1000 ))
    (( bytes > 4096 )) && echo "${bytes}b" || echo "32kbit"
}

need_root() {
    [[ $(id -u) -eq 0 ]] || die "needs root (network namespaces and tc)"
    command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (ip, tc)"
}

shape() {  # shape NAME: HTB classifier + one tbf per destination class on NAME's eth0
    local name=$1 ns=${PREFIX}$1
    local rate=${RATE[$name]} minor=2 pair a b mbit peer
    tc -n "$ns" qdisc add dev eth0 root handle 1: htb default 1
    tc -n "$ns" class add dev eth0 parent 1: classid 1:1 htb rate 10gbit quantum 60000
    tc -n "$ns" qdisc add dev eth0 parent 1:1 handle 10: tbf rate "${rate}mbit" burst "$(burst_for "$rate")" latency $LATENCY
    for pair in $SLOW_LINKS; do
        mbit=${pair#*:}; a=${pair%%:*}; b=${a#*-}; a=${a%%-*}
        if [[ $name == "$a" ]]; then peer=$b; elif [[ $name == "$b" ]]; then peer=$a; else continue; fi
        tc -n "$ns" class add dev eth0 parent 1: classid "1:$minor" htb rate 10gbit quantum 60000
        tc -n "$ns" qdisc add dev eth0 parent "1:$minor" handle "$((10 + minor)):" tbf rate "${mbit}mbit" \
            burst "$(burst_for "$mbit")" latency $LATENCY
        tc -n "$ns" filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst "${ADDR[$peer]}/32" flowid "1:$minor"
        minor=$((minor + 1))
    done
}

down() {
    local name
    for name in "${NAMES[@]}"; do
        ip netns del "${PREFIX}${name}" 2>/dev/null || true
    done
    ip netns del "$HUB" 2>/dev/null || true
}

up() {
    need_root
    down
    UP_DONE=0
    trap '[[ $UP_DONE == 1 ]] || { echo "netns-swarm: setup failed, cleaning up" >&2; down; }' EXIT
    ip netns add "$HUB"
    ip -n "$HUB" link set lo up
    ip -n "$HUB" link add br0 type bridge
    ip -n "$HUB" link set br0 up
    local name ns
    for name in "${NAMES[@]}"; do
        ns=${PREFIX}${name}
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip -n "$HUB" link add "$name" type veth peer name eth0 netns "$ns"
        ip -n "$HUB" link set "$name" master br0 up
        ip -n "$ns" addr add "${ADDR[$name]}/24" dev eth0
        ip -n "$ns" link set eth0 up
        shape "$name"
    done
    UP_DONE=1
    local table=""
    for name in "${NAMES[@]}"; do table+=" ${PREFIX}${name}=${ADDR[$name]}@${RATE[$name]}Mbit"; done
    echo "netns-swarm: up:${table}${SLOW_LINKS:+; slow links (Mbit/s): $SLOW_LINKS}"
}

status() {
    local name ns
    for name in "${NAMES[@]}"; do
        ns=${PREFIX}${name}
        if ip netns exec "$ns" true 2>/dev/null; then
            echo "== $ns ${ADDR[$name]}"
            tc -n "$ns" -s qdisc show dev eth0 | sed 's/^/   /'
        else
            echo "== $ns (absent)"
        fi
    done
}

cmd=${1-}
case $cmd in
    up) up ;;
    down) need_root; down; echo "netns-swarm: down (prefix '$PREFIX')" ;;
    run)
        [[ $# -ge 3 ]] || die "usage: $0 run NAME CMD..."
        need_root
        name=$(short "$2"); shift 2
        exec ip netns exec "${PREFIX}${name}" "$@" ;;
    addr)
        [[ $# -eq 2 ]] || die "usage: $0 addr NAME"
        name=$(short "$2"); echo "${ADDR[$name]}" ;;
    status) need_root; status ;;
    *) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; [[ -z $cmd || $cmd == -h || $cmd == --help ]] || exit 2 ;;
esac
