# Shared by the simulators (scripts/simulate_*.sh source it): the interpreter, the split of the
# cores, the store, and stopping every process they started.

SIM_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# The simulators' own settings (ZB_SIM_*) stay in the script: exported, every node would warn that zb
# does not know them.
for _sim_var in ${!ZB_SIM_@}; do export -n "$_sim_var"; done

# PYTHON: as given, else the first of python, python3 and this checkout's .venv that can import zb
# with its dependencies (in the checkout any python imports the bare package); exit 2 with one line
# when none can (a bare system python fails only inside a node's log).
ZB_IMPORT="import torch, zb.cli.terminal"
find_python() {
    if [ -z "${PYTHON:-}" ]; then
        for candidate in "$(command -v python || true)" "$(command -v python3 || true)" "$SIM_HERE/../.venv/bin/python"; do
            if [ -n "$candidate" ] && "$candidate" -c "$ZB_IMPORT" 2>/dev/null; then PYTHON=$candidate; break; fi
        done
    fi
    if [ -z "${PYTHON:-}" ] || ! "$PYTHON" -c "$ZB_IMPORT" 2>/dev/null; then
        echo "error: no python that can import zb (tried ${PYTHON:-python, python3, .venv/bin/python}): activate the" \
             "venv (source .venv/bin/activate) or set PYTHON=/path/to/python" >&2
        exit 2
    fi
}

# split_cores PROCESSES: CORES, and OMP_NUM_THREADS (unless set) so the processes share the cores
# instead of each using all of them.
split_cores() {
    CORES=$("$PYTHON" -c 'import os; print(len(os.sched_getaffinity(0)))')
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / $1 > 0 ? CORES / $1 : 1 ))}
}

# start_store LOGDIR: a `zb store` on ZB_SIM_PORT or a free loopback port; sets PORT and store_pid.
start_store() {
    PORT=${ZB_SIM_PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
    "$PYTHON" -m zb store --port "$PORT" >"$1/store.log" 2>&1 &
    store_pid=$!
}

# stop_all: SIGTERM to every pid in `pids`, then to the store, waiting for each (no orphans).
stop_all() {
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [ -n "${store_pid:-}" ]; then kill -TERM "$store_pid" 2>/dev/null || true; wait "$store_pid" 2>/dev/null || true; fi
}
