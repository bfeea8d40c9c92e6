#!/usr/bin/env bash
# Simulate a DiLoCo-SWARM run on this machine: a store and an S x M grid (S stages, M workers each).
#
#   scripts/simulate_swarm.sh S M [zb train args...]
#   scripts/simulate_swarm.sh 2 2 @configs/debug/swarm.toml
#
# Starts `zb store` on a free loopback port, then S x M `zb train` processes, worker m of stage j
# pinned there (--swarm.stage j; GLOBAL_WORLD_SIZE=M is each stage's initial quorum), one log per
# worker under $ZB_SIM_LOGDIR (default logs/swarm/<time>/sJwM.log, metrics in sJwM/metrics.jsonl).
# The machine's cores are split between the workers (OMP_NUM_THREADS, unless set). At the end a
# summary: the first-stage workers' final losses, each worker's micro-batches, and whether the
# workers of each stage hold the same params at every outer step. ZB_SIM_CKPT=DIR gives worker sJwM
# the checkpoint directory DIR/sJwM and --ckpt.resume latest (add --ckpt.interval N): run the script
# again with the same DIR and the grid resumes from its checkpoints. Ctrl-C stops everything, with no
# orphans. Exits non-zero if any worker failed. PYTHON picks the interpreter as in
# simulate_multi_node_diloco.sh.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 STAGES WORKERS_PER_STAGE [zb train args...]" >&2
    exit 2
fi
S=$1 M=$2
shift 2
case "$S$M" in *[!0-9]*|"") echo "error: STAGES and WORKERS_PER_STAGE must be positive integers" >&2; exit 2;; esac
if [ "$S" -lt 2 ] || [ "$M" -lt 1 ]; then
    echo "error: at least 2 stages and 1 worker per stage (one stage is plain DiLoCo:" \
         "scripts/simulate_multi_node_diloco.sh)" >&2
    exit 2
fi
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/_sim_common.sh"
find_python
split_cores $(( S * M ))
LOGDIR=${ZB_SIM_LOGDIR:-logs/swarm/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$LOGDIR"

pids=()
names=()
store_pid=""
cleanup() {
    trap - INT TERM EXIT
    stop_all
}
trap 'echo "stopping all workers" >&2; cleanup; exit 130' INT TERM
trap cleanup EXIT

start_store "$LOGDIR"
echo "store on 127.0.0.1:$PORT (log: $LOGDIR/store.log); $S stages x $M workers," \
     "$OMP_NUM_THREADS thread(s) each on $CORES core(s)" >&2

for j in $(seq 0 $((S - 1))); do
    for m in $(seq 0 $((M - 1))); do
        name="s${j}w${m}"
        ckpt=()
        if [ -n "${ZB_SIM_CKPT:-}" ]; then
            ckpt=(--ckpt.path "$ZB_SIM_CKPT/$name" --ckpt.resume latest)
        fi
        GLOBAL_ADDR=127.0.0.1 GLOBAL_PORT=$PORT GLOBAL_WORLD_SIZE=$M GLOBAL_RANK=$m \
            GLOBAL_UNIQUE_ID=${ZB_SIM_PREFIX:-}$name \
            "$PYTHON" -m zb train --log.progress plain --train.log_model_hash --swarm.stages "$S" \
            --swarm.stage "$j" "${ckpt[@]}" "$@" --log.dir "$LOGDIR/$name" >"$LOGDIR/$name.log" 2>&1 &
        pids+=($!)
        names+=("$name")
        echo "stage $j worker $m: pid $! (log: $LOGDIR/$name.log)" >&2
    done
done

status=0
for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "${names[$i]} failed: see $LOGDIR/${names[$i]}.log" >&2
        status=1
    fi
done
"$PYTHON" "$HERE/_swarm_report.py" "$LOGDIR" >&2 || true
exit $status
