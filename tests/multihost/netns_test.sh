#!/usr/bin/env bash
# Multi-host rearrangement across network namespaces joined by veth pairs and a bridge on
# this machine: three "hosts", one `eplbx worker` rank each, rendezvous over TCP with a
# token, transfers over UCX tcp. Then the same with one host's link taken down mid-run:
# the survivors must fail with an error naming that rank, within the deadline, weights
# consistent with their maps. Needs root and iproute2; exits 77 (skipped) otherwise.
#   tests/multihost/netns_test.sh BUILD_DIR
set -uo pipefail
EPLBX=${1:-build}/bin/eplbx
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
  echo "SKIP: needs root and iproute2 (ip netns)"; exit 77
fi
tag=e$$
br=br$tag
ns=(${tag}n0 ${tag}n1 ${tag}n2)
work=$(mktemp -d)
cleanup() {
  for n in "${ns[@]}"; do ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null; ip netns del "$n" 2>/dev/null; done
  # The root-side veth ends can outlive their namespaces (the kernel frees a namespace
  # lazily); deleting one end deletes the pair.
  for i in 0 1 2; do ip link del "b${tag}$i" 2>/dev/null; done
  ip link del "$br" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() { echo "FAIL: $*"; for f in "$work"/*; do echo "--- $f"; tail -5 "$f"; done; exit 1; }

ip link add "$br" type bridge || { echo "SKIP: cannot create a bridge here"; exit 77; }
ip link set "$br" up
for i in 0 1 2; do
  n=${ns[$i]}
  ip netns add "$n" || { echo "SKIP: cannot create network namespaces here"; exit 77; }
  ip link add v${tag}$i type veth peer name b${tag}$i
  ip link set v${tag}$i netns "$n"
  ip link set b${tag}$i master "$br"
  ip link set b${tag}$i up
  ip netns exec "$n" ip addr add 10.77.$((($$ % 200) + 1)).$((i + 1))/24 dev v${tag}$i
  ip netns exec "$n" ip link set v${tag}$i up
  ip netns exec "$n" ip link set lo up
done
master=10.77.$((($$ % 200) + 1)).1
port=$((20000 + $$ % 20000))

# run_ranks NAME EXTRA_FLAGS... : starts rank i in namespace i, waits for all (a rank that
# hangs is killed after 90 s: its exit code, 124, fails the part with the logs).
run_ranks() {
  local name=$1; shift
  local pids=()
  for i in 0 1 2; do
    ip netns exec "${ns[$i]}" env EPLBX_MASTER_ADDR=$master EPLBX_MASTER_PORT=$port EPLBX_RANK=$i \
      EPLBX_WORLD_SIZE=3 EPLBX_TOKEN=s3cret-$tag EPLBX_NODE=host$i UCX_NET_DEVICES=v${tag}$i \
      timeout 90 "$EPLBX" worker "$@" >"$work/$name.$i.json" 2>"$work/$name.$i.err" &
    pids+=($!)
  done
  local codes=()
  for p in "${pids[@]}"; do wait "$p"; codes+=($?); done
  echo "${codes[@]}"
}
json() { /usr/bin/python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print($2)" "$1"; }

# 1. A full rearrangement across the three hosts, every byte verified.
codes=$(run_ranks ok --json --layers 4 --experts 16 --slots-per-rank 6 --expert-bytes 256K --steps 2 --deadline 20)
[[ "$codes" == "0 0 0" ]] || fail "exit codes $codes"
[[ $(json "$work/ok.0.json" "d['verified'] and d['weights_intact']") == True ]] || fail "not verified"
[[ $(json "$work/ok.0.json" "d['cross_node_bytes'] > 0") == True ]] || fail "no cross-node bytes"
echo "ok: $(json "$work/ok.0.json" "[(round(s['gbps'],3), s['bytes_moved']) for s in d['steps']]")"

# 2. Rank 2's link goes down mid-run: named errors within the deadline on the survivors.
port=$((port + 1))
( sleep 3; ip link set b${tag}2 down ) &
start=$(date +%s)
codes=$(run_ranks down --json --layers 8 --experts 16 --slots-per-rank 6 --expert-bytes 1M --steps 400 --deadline 6)
took=$(( $(date +%s) - start ))
read -r c0 c1 c2 <<<"$codes"
[[ $c0 -ne 0 && $c1 -ne 0 ]] || fail "survivors exited $c0 $c1"
err=$(json "$work/down.0.json" "d.get('error','')")
[[ "$err" == *"rank 2"* ]] || fail "error does not name rank 2: $err"
[[ $(json "$work/down.0.json" "d['weights_intact']") == True ]] || fail "weights not intact"
# The link goes down 3 s in; the survivors must be done within the 6 s deadline after it
# (plus start-up and teardown): the store stops waiting for a rank whose link died.
[[ $took -le 15 ]] || fail "took $took s"
echo "link down: exit $codes in ${took}s: $err"

# 3. Serving across the hosts (issue 20): rank 2's link goes down while they serve; the store
# declares it lost (its keepalive / the round timeout), ranks 0 and 1 learn it from their
# step's collective, re-place over themselves, restore rank 2's only experts from their own
# node's backup, and serve on to the end with every row checked. Rank 2 ends with an error.
# (The text report: rank 0 prints progress, which says when they serve.)
port=$((port + 1))
ip link set b${tag}2 up  # (part 2 took it down)
# Part 2 left failed neighbour entries for rank 2's address in the other namespaces (a connect
# then fails at once with "Destination is unreachable"), and the bridge port may not forward
# yet: flush them and wait for the port, as a host whose link came back would after a while.
for n in "${ns[@]}"; do ip netns exec "$n" ip neigh flush all 2>/dev/null || true; done
for _ in $(seq 1 50); do
  [[ $(cat /sys/class/net/b${tag}2/brport/state 2>/dev/null) == 3 ]] && break  # forwarding
  sleep 0.1
done
rm -f "$work"/serve.*
run_ranks serve --serve --modes async --layers 4 --experts 16 --slots-per-rank 8 \
  --expert-bytes 256K --steps 4000 --interval 20 --tokens 64 --top-k 4 --work-bytes 1K \
  --deadline 3 >"$work/serve.codes" &
runner=$!
# The link goes down once they serve (rank 0 prints progress every 100 steps).
for _ in $(seq 1 300); do
  grep -q "step 300/4000" "$work/serve.0.err" 2>/dev/null && break
  sleep 0.1
done
grep -q "step 300/4000" "$work/serve.0.err" || fail "never reached step 300: $(tail -3 "$work/serve.0.err")"
ip link set b${tag}2 down
start=$(date +%s)
wait $runner
took=$(( $(date +%s) - start ))
read -r c0 c1 c2 <<<"$(cat "$work/serve.codes")"
[[ $c0 -eq 0 && $c1 -eq 0 ]] || fail "survivors exited $c0 $c1 (rank 2: $c2)"
[[ $c2 -ne 0 ]] || fail "rank 2 (cut off) exited 0"
out=$(cat "$work/serve.0.json")
[[ "$out" == *"lost [2] at step"*", the others went on"* ]] || fail "no loss of rank 2 reported: $out"
[[ "$out" == *"epoch 2, members [0,1]"* ]] || fail "survivors not [0,1]: $out"
[[ "$out" == *"every row a step used checked against its map: yes"* ]] || fail "rows: $out"
[[ "$out" =~ restore\ from\ the\ host\ backup\ [0-9.]+\ \(([0-9]+)\ rows ]] || fail "no restore: $out"
(( BASH_REMATCH[1] > 0 )) || fail "nothing restored from the node's backup: $out"
[[ $took -le 20 ]] || fail "serving on after the link went down took $took s"
echo "serving, link down: exit $c0 $c1 $c2; $(grep -o 'detected at step [0-9]* after [0-9.]* s' <<<"$out"); $(grep -o 'recovery (detection[^:]*: [0-9.]* s' <<<"$out")"

# 4. Coordination on etcd across the hosts (issue 31): an etcd member per namespace, one
# worker rank each, no store. Rank 0's host (its worker and its etcd member) is cut off while
# they serve: ranks 1 and 2 and the two etcd members left (a quorum) serve on to the end, one
# placement, every row checked; rank 0 ends with an error. Nothing central is left running.
if [[ -z $(command -v etcd) ]]; then
  echo "SKIP part 4: no etcd binary (apt-get install etcd-server; scripts/setup.sh does)"
  echo PASS; exit 0
fi
for n in "${ns[@]}"; do ip netns exec "$n" ip neigh flush all 2>/dev/null || true; done
ip link set b${tag}2 up
net=10.77.$((($$ % 200) + 1))
cluster=""
for i in 0 1 2; do cluster+="${cluster:+,}m$i=http://$net.$((i + 1)):2380"; done
for i in 0 1 2; do
  ip=$net.$((i + 1))
  ( ip netns exec "${ns[$i]}" etcd --name m$i --data-dir "$work/etcd$i" \
    --listen-client-urls http://$ip:2379 --advertise-client-urls http://$ip:2379 \
    --listen-peer-urls http://$ip:2380 --initial-advertise-peer-urls http://$ip:2380 \
    --initial-cluster "$cluster" --initial-cluster-state new \
    --heartbeat-interval 50 --election-timeout 500 >"$work/etcd$i.log" 2>&1 & )
done
url=etcd://$net.1:2379,$net.2:2379,$net.3:2379
group=g$tag
pids=()
for i in 0 1 2; do
  ip netns exec "${ns[$i]}" env EPLBX_RANK=$i EPLBX_WORLD_SIZE=3 EPLBX_TOKEN=s3cret-$tag \
    EPLBX_NODE=host$i EPLBX_BACKUP_DIR="$work" UCX_NET_DEVICES=v${tag}$i \
    timeout 120 "$EPLBX" worker --serve --modes async --layers 4 --experts 16 --slots-per-rank 8 \
    --expert-bytes 256K --steps 1500 --interval 20 --tokens 64 --top-k 4 --work-bytes 1K \
    --deadline 2 --json --coordination "$url" --group "$group" \
    >"$work/etcd.$i.json" 2>"$work/etcd.$i.err" &
  pids+=($!)
done
# Serving once the first view (the `epoch` key) is written and rounds go on (asked of host
# 1's member).
view=$(printf '/eplbx/%s/epoch' "$group" | base64 -w0)
serving=0
for _ in $(seq 1 300); do
  if ip netns exec "${ns[1]}" curl -s -m 1 http://$net.2:2379/v3/kv/range -d "{\"key\":\"$view\"}" \
    2>/dev/null | grep -q '"kvs"'; then serving=1; break; fi
  sleep 0.1
done
[[ $serving -eq 1 ]] || fail "etcd: the group never wrote its first view"
sleep 2
ip link set b${tag}0 down
start=$(date +%s)
codes=()
for p in "${pids[@]}"; do wait "$p"; codes+=($?); done
took=$(( $(date +%s) - start ))
[[ ${codes[1]} -eq 0 && ${codes[2]} -eq 0 ]] || fail "etcd: survivors exited ${codes[*]}"
[[ ${codes[0]} -ne 0 ]] || fail "etcd: rank 0 (cut off) exited 0"
for i in 1 2; do
  [[ $(json "$work/etcd.$i.json" "d['verified'] and d['drill']['members'] == [1, 2]") == True ]] ||
    fail "etcd: rank $i: $(head -c 600 "$work/etcd.$i.json")"
done
d1=$(json "$work/etcd.1.json" "d['placement_digest']")
[[ $d1 == $(json "$work/etcd.2.json" "d['placement_digest']") ]] || fail "etcd: two placements"
echo "etcd, host 0 cut off: exit ${codes[*]} ${took}s after; $(json "$work/etcd.1.json" \
  "'detected at step %d after %.2f s, recovery %.3f s, epoch %d' % (d['drill']['detected_step'], d['drill']['detect_wait_s'], d['drill']['recovery_s'], d['coordination']['epoch'])")"
echo PASS
