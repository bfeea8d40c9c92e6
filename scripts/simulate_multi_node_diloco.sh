#!/usr/bin/env bash
# Simulate a DiLoCo run of N nodes with LOCAL_RANKS local ranks each on this machine.
#
#   scripts/simulate_multi_node_diloco.sh N LOCAL_RANKS [zb train args...]
#   scripts/simulate_multi_node_diloco.sh 2 1 @configs/debug/diloco.toml
#
# Starts `zb store` on a free loopback port, then N nodes (each through torch's launcher, so a
# node's local ranks are supervised together), one log per node under $ZB_SIM_LOGDIR (default
# logs/sim/<time>/nodeI.log, metrics in nodeI/metrics.jsonl). The machine's cores are split between
# the ranks (OMP_NUM_THREADS, unless set): N nodes each using every core would fight over them. A
# progress line every $ZB_SIM_PROGRESS seconds (default 10; 0: none) and a summary at the end (final
# losses, outer steps, whether the nodes hold the same params). Ctrl-C stops everything, with no
# orphans. Exits non-zero if any node failed. PYTHON picks the interpreter (default: the one that can
# import zb among python, python3 and this checkout's .venv).
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 N LOCAL_RANKS [zb train args...]" >&2
    exit 2
fi
N=$1 LOCAL=$2
shift 2
# Prime's form names its training script third (... 2 2 src/zeroband/train.py @cfg): here the nodes
# always run `zb train`, so a Prime launch line works unchanged.
if [ $# -gt 0 ] && [[ "$1" == *.py ]]; then
    echo "note: $1 ignored: the nodes run zb train" >&2
    shift
fi
case "$N$LOCAL" in *[!0-9]*|"") echo "error: N and LOCAL_RANKS must be positive integers" >&2; exit 2;; esac
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/_sim_common.sh"
find_python
split_cores $(( N * LOCAL ))
LOGDIR=${ZB_SIM_LOGDIR:-logs/sim/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$LOGDIR"

pids=()
store_pid=""
pids_monitor=""
stop_monitor() {
    if [ -n "${pids_monitor:-}" ]; then
        # SIGPIPE: bash reports a background job killed by SIGTERM ("Terminated"), not by SIGPIPE.
        pkill -PIPE -P "$pids_monitor" 2>/dev/null || true  # its sleep
        kill -PIPE "$pids_monitor" 2>/dev/null || true
        wait "$pids_monitor" 2>/dev/null || true
        pids_monitor=""
    fi
}
cleanup() {
    trap - INT TERM EXIT
    stop_monitor
    stop_all
}
trap 'echo "stopping all nodes" >&2; cleanup; exit 130' INT TERM
trap cleanup EXIT

start_store "$LOGDIR"
echo "store on 127.0.0.1:$PORT (log: $LOGDIR/store.log); $N nodes x $LOCAL local ranks," \
     "$OMP_NUM_THREADS thread(s) each on $CORES core(s)" >&2

for i in $(seq 0 $((N - 1))); do
    GLOBAL_ADDR=127.0.0.1 GLOBAL_PORT=$PORT GLOBAL_WORLD_SIZE=$N GLOBAL_RANK=$i GLOBAL_UNIQUE_ID=${ZB_SIM_PREFIX:-node}$i \
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$LOCAL" -m zb train \
        --log.progress plain --train.log_model_hash "$@" --log.dir "$LOGDIR/node$i" >"$LOGDIR/node$i.log" 2>&1 &
    pids+=($!)
    echo "node $i: pid $! (log: $LOGDIR/node$i.log)" >&2
done

PROGRESS=${ZB_SIM_PROGRESS:-10}
if [ "$PROGRESS" -gt 0 ] 2>/dev/null; then
    ( while sleep "$PROGRESS"; do "$PYTHON" "$HERE/_sim_report.py" line "$LOGDIR" "$N" >&2 || true; done ) &
    pids_monitor=$!
fi

status=0
for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "node $i failed: see $LOGDIR/node$i.log" >&2
        status=1
    fi
done
stop_monitor
"$PYTHON" "$HERE/_sim_report.py" summary "$LOGDIR" "$N" >&2 || true
exit $status
