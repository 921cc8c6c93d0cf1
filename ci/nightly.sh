#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# mlacheck nightly job: the nightly matrix (premerge + 16k prefill, 128 heads, batch 128,
# 32k+ contexts, KV pools past 2^31 / 2^32 bytes: the large_kv cases), then the self-test,
# then the GSM8K gate of a served model against a stored baseline; one combined report.
#
#   MLACHECK_GSM8K_URL=http://host:8000/v1 MLACHECK_GSM8K_MODEL=deepseek-ai/DeepSeek-V3 \
#       BASELINE=dsv3-bf16-triton-mi300x ci/nightly.sh
#   ci/nightly.sh          # with SERVER_CMD etc. in ci/nightly.env: start, wait, gate, stop
#
# The gate's server: MLACHECK_GSM8K_URL (already running), or SERVER_CMD (started here after
# the matrix and the self-test, so the GPUs are free; waited for until it answers a
# completion; stopped at the end, whatever happens). Settings may also come from a config
# file, NIGHTLY_ENV (default ci/nightly.env, shell KEY=value lines); the environment wins.
# The baseline is references/gsm8k/$BASELINE.json (or BASELINE as a path).
#
# Backends: as ci/premerge.sh (BACKENDS, OPTIONAL_BACKENDS, the platform's required defaults).
# CPU machine: the smoke matrix on the embedded default backend, the quick self-test, and the
# gate skipped with a clear line unless a URL (or SERVER_CMD) is given.
#
# Exit (README "Exit codes"; the worst step wins): 0 all steps pass (or were skipped); 1 a step
# failed (a FAIL/CRASH/XPASS verdict, a fault the self-test missed, the gate FAILs); 3 a suite
# error; 6 not enough ran (a required backend not usable here or running nothing, coverage
# policy, incomplete);
# 2 bad environment: ONE line on stderr (no GPU with
# REQUIRE_GPU=1, baseline missing or unreadable, server unreachable or never answering,
# lm-eval missing, no verdicts recorded). Environment problems are checked before the
# matrix runs, so a misconfigured night fails in seconds, not hours.
#
# Artifacts ($ARTIFACTS): nightly.md (the combined report), matrix/ (results.jsonl,
# junit.xml, report.md, report.html, summary.md, run.log, backends.json), selftest.log, gsm8k/ (run.json,
# run.responses.jsonl, gsm8k_gate.md/.json/.png, run.log), server.log.
set -euo pipefail

CI_NAME=nightly
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
NIGHTLY_ENV=${NIGHTLY_ENV:-$CI_DIR/nightly.env}
load_env_file "$NIGHTLY_ENV"

# ---- knobs (environment variables, or NIGHTLY_ENV) --------------------------------------------
STEPS=${STEPS:-matrix selftest gate}    # which steps to run, in this order
MATRIX=${MATRIX:-}                      # default nightly (GPU) / smoke (CPU); or a YAML path
BACKENDS=${BACKENDS:-}                  # default: the platform's backends (CPU: embedded); see ci/premerge.sh
OPTIONAL_BACKENDS=${OPTIONAL_BACKENDS:-} # of those, the ones that may be missing (run when usable)
DEVICE=${DEVICE:-auto}                  # auto | cpu | cuda (GPUs: VISIBLE_DEVICES)
WORKERS=${WORKERS:-}                    # xdist workers; default 1 on CPU, on GPUs mlacheck run's (2 cores each, <= 8 per GPU)
ARTIFACTS=${ARTIFACTS:-./mlacheck-artifacts}
REQUIRE_GPU=${REQUIRE_GPU:-0}           # 1: no GPU is an error (exit 2)
REQUIRE_OPS=${REQUIRE_OPS:-}            # e.g. mla_decode,mla_prefill: each backend must run one
MIN_EXECUTED=${MIN_EXECUTED:-}          # least executed fraction per backend x op (0..1)
ALLOW_XPASS=${ALLOW_XPASS:-0}           # 1: a known failure that passes does not fail the job
VISIBLE_DEVICES=${VISIBLE_DEVICES:-}    # e.g. 0,1,2,3: exported as HIP_/CUDA_VISIBLE_DEVICES
MARKERS=${MARKERS:-}                    # pytest -m expression (default: all, large_kv included)
SHARD=${SHARD:-}                        # K/N: only the K-th of N shards (join them with mlacheck merge)
SEED=${SEED:-}                          # another draw each night, e.g. SEED=$(date +%j) (mlacheck run --seed); default 0
MERGE=${MERGE:-}                        # shard results files or globs: merge them instead of running (mlacheck merge)
TIMEOUT=${TIMEOUT:-1800}                # seconds per case
PYTHON=${PYTHON:-python3}
MLACHECK=${MLACHECK:-}                  # mlacheck command; default "$PYTHON -m mlacheck.cli"
# GSM8K gate
MLACHECK_GSM8K_URL=${MLACHECK_GSM8K_URL:-}      # a running OpenAI-compatible server
MLACHECK_GSM8K_MODEL=${MLACHECK_GSM8K_MODEL:-}  # the model name the server knows
SERVER_CMD=${SERVER_CMD:-}              # or: a command that starts one (run with bash -c)
SERVER_URL=${SERVER_URL:-http://127.0.0.1:8000/v1/completions}  # where SERVER_CMD serves
SERVER_WAIT=${SERVER_WAIT:-1800}        # seconds to wait for SERVER_CMD's server to answer
SERVER_POLL=${SERVER_POLL:-5}           # seconds between tries
SERVER_STOP_WAIT=${SERVER_STOP_WAIT:-60} # seconds between SIGTERM and SIGKILL at the end
BASELINE=${BASELINE:-}                  # baseline name in REFS_DIR, or a path to a record
REFS_DIR=${REFS_DIR:-$REPO_ROOT/references/gsm8k}
REQUIRE_GATE=${REQUIRE_GATE:-0}         # 1: no URL and no SERVER_CMD is an error, not a skip
GSM8K_LIMIT=${GSM8K_LIMIT:-}            # first N questions only (default: all 1319)
GSM8K_DATA_DIR=${GSM8K_DATA_DIR:-}      # offline GSM8K (train.jsonl, test.jsonl)
GSM8K_CONCURRENT=${GSM8K_CONCURRENT:-32}
GATE_RUN_ARGS=${GATE_RUN_ARGS:-}        # extra words for `mlacheck gate gsm8k run`
GATE_COMPARE_ARGS=${GATE_COMPARE_ARGS:-} # extra words for `mlacheck gate gsm8k compare`
SELFTEST_ARGS=${SELFTEST_ARGS:---quick} # words for `mlacheck selftest`
# ------------------------------------------------------------------------------------------------

SERVER_PID=""
FINAL_RC=0
STEP_ROWS=()     # "NAME=RESULT" for the combined report
SECTIONS=()      # "TITLE=FILE"

want() { [[ " $STEPS " == *" $1 "* ]]; }

# Worst-of, in the order of README "Exit codes": 2 (environment) beats 1 (kernel failure)
# beats 3 (suite error) beats 6 (not enough ran) beats 5 (nothing selected) beats 0; any
# other non-zero code of a step counts as 1.
record_rc() {
    local rc=$1 order=" 2 1 3 6 5 " r
    if [[ $order != *" $rc "* && $rc -ne 0 ]]; then rc=1; fi
    for r in 2 1 3 6 5; do
        if [[ $FINAL_RC -eq $r || $rc -eq $r ]]; then FINAL_RC=$r; return 0; fi
    done
}

# An error found after the checks: the one stderr line, then the report is still written.
step_error() {
    printf '%s: error: %s\n' "$CI_NAME" "$*" >&2
    record_rc 2
}

# Is the process running (a zombie, exited but not yet reaped, is not)?
running() {
    kill -0 "$1" 2>/dev/null || return 1
    local state
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || state=R
    [[ $state != Z ]]
}

# Stop the server we started: SIGTERM to its process group (setsid made it a group
# leader, so its workers go too), SIGKILL after SERVER_STOP_WAIT seconds.
stop_server() {
    [[ -n $SERVER_PID ]] || return 0
    local pid=$SERVER_PID waited=0
    SERVER_PID=""
    if running "$pid"; then
        say "stopping the server (pid $pid)"
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        while running "$pid" && [[ $waited -lt $SERVER_STOP_WAIT ]]; do
            sleep 1
            waited=$((waited + 1))
        done
        if running "$pid"; then
            say "the server did not stop in $SERVER_STOP_WAIT s: SIGKILL"
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    wait "$pid" 2>/dev/null || true
}

# ---------------------------------------------------------------- checks (before any work)

GATE_MODE=skip GATE_URL="" BASELINE_PATH="" GATE_SKIP_WHY=""
check_gate_config() {
    if ! want gate; then
        GATE_SKIP_WHY="not in STEPS"
        return 0
    fi
    if [[ -n $MLACHECK_GSM8K_URL ]]; then
        GATE_MODE=url GATE_URL=$MLACHECK_GSM8K_URL
    elif [[ -n $SERVER_CMD ]]; then
        GATE_MODE=server GATE_URL=$SERVER_URL
    else
        [[ $REQUIRE_GATE == 1 ]] &&
            die "REQUIRE_GATE=1 but neither MLACHECK_GSM8K_URL nor SERVER_CMD is set (env or $NIGHTLY_ENV)"
        GATE_SKIP_WHY="no MLACHECK_GSM8K_URL and no SERVER_CMD (env or $NIGHTLY_ENV)"
        return 0
    fi
    [[ -n $MLACHECK_GSM8K_MODEL ]] ||
        die "the GSM8K gate needs MLACHECK_GSM8K_MODEL (the model name the server at $GATE_URL knows)"
    [[ -n $BASELINE ]] ||
        die "the GSM8K gate needs BASELINE: a baseline name in $REFS_DIR or a record path (docs/ci.md)"
    if [[ $BASELINE == */* || $BASELINE == *.json ]]; then
        BASELINE_PATH=$BASELINE
    else
        BASELINE_PATH=$REFS_DIR/$BASELINE.json
    fi
    local why
    why=$("${CI_PY[@]}" baseline "$BASELINE_PATH" 2>&1) || die "${why#mlacheck-ci: error: }"
    "$PYTHON" -c 'import lm_eval' >/dev/null 2>&1 ||
        die "the GSM8K gate needs lm-eval: pip install 'mlacheck[eval]' (or run with STEPS without gate)"
    if [[ $GATE_MODE == url ]]; then
        say "checking that the server at $GATE_URL answers"
        why=$("${CI_PY[@]}" wait-server "$GATE_URL" "$MLACHECK_GSM8K_MODEL" 2>&1) ||
            die "${why#mlacheck-ci: error: }"
    fi
    say "gate: GSM8K on $MLACHECK_GSM8K_MODEL at $GATE_URL ($GATE_MODE), baseline $BASELINE_PATH"
}

# ---------------------------------------------------------------- steps

step_matrix() {
    if ! want matrix; then
        STEP_ROWS+=("kernel matrix=skipped (not in STEPS)")
        return 0
    fi
    choose_backends "$ARTIFACTS/matrix"
    local n
    for n in "${NOTES[@]}"; do say "$n"; done
    local name=${MATRIX##*/}
    run_matrix "$ARTIFACTS/matrix" "mlacheck nightly matrix: ${name%.yaml}"
    if [[ -s "$ARTIFACTS/matrix/summary.txt" ]]; then cat "$ARTIFACTS/matrix/summary.txt"; fi
    local result
    case $MATRIX_RC in
        0) result="PASS" ;;
        1) result="FAIL" ;;
        3) result="SUITE ERROR (mlacheck failed on some cases; see matrix/summary.txt)" ;;
        5) result="NOTHING SELECTED" ;;
        6) result="NOT ENOUGH RAN (coverage policy or incomplete; see matrix/summary.txt)" ;;
        *) result="ERROR (no verdicts; see matrix/run.log)" ;;
    esac
    STEP_ROWS+=("kernel matrix (${name%.yaml})=$result")
    SECTIONS+=("Kernel matrix=$ARTIFACTS/matrix/summary.md")
    record_rc "$MATRIX_RC"
}

step_selftest() {
    if ! want selftest; then
        STEP_ROWS+=("selftest=skipped (not in STEPS)")
        return 0
    fi
    local log=$ARTIFACTS/selftest.log args=()
    read -r -a args <<<"$SELFTEST_ARGS"
    say "running: mlacheck selftest ${args[*]}"
    local rc=0
    "${MLA[@]}" selftest "${args[@]}" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
    if [[ $rc -eq 2 ]] && grep -q 'selftest is not available' "$log"; then
        say "selftest skipped: this mlacheck has no selftest command yet"
        STEP_ROWS+=("selftest=skipped (not available in this mlacheck)")
    elif [[ $rc -eq 0 ]]; then
        STEP_ROWS+=("selftest=PASS")
    else
        say "selftest failed (exit $rc): a fault escaped or a correct backend failed; see $log"
        STEP_ROWS+=("selftest=FAIL (exit $rc)")
        record_rc 1
    fi
    SECTIONS+=("Selftest=$log")
}

start_server() {
    local log=$ARTIFACTS/server.log
    say "starting the server: $SERVER_CMD (log: $log)"
    if have setsid; then
        setsid bash -c "$SERVER_CMD" >"$log" 2>&1 </dev/null &
    else
        bash -c "$SERVER_CMD" >"$log" 2>&1 </dev/null &
    fi
    SERVER_PID=$!
    say "waiting up to $SERVER_WAIT s for $GATE_URL to answer"
    local why
    why=$("${CI_PY[@]}" wait-server "$GATE_URL" "$MLACHECK_GSM8K_MODEL" --timeout "$SERVER_WAIT" \
        --interval "$SERVER_POLL" --pid "$SERVER_PID" --log "$log" 2>&1) || {
        step_error "${why#mlacheck-ci: error: }"
        return 1
    }
    say "server answers"
}

step_gate() {
    local dir=$ARTIFACTS/gsm8k skip_md=$ARTIFACTS/gsm8k/skipped.md
    mkdir -p "$dir"
    rm -f "$dir/run.json" "$dir/run.responses.jsonl" "$dir/gsm8k_gate.md" "$dir/gsm8k_gate.json" \
        "$dir/gsm8k_gate.png" "$skip_md"
    if [[ $GATE_MODE == skip ]]; then
        say "gate skipped: $GATE_SKIP_WHY"
        STEP_ROWS+=("GSM8K gate=skipped ($GATE_SKIP_WHY)")
        printf 'Skipped: %s.\n' "$GATE_SKIP_WHY" >"$skip_md"
        SECTIONS+=("GSM8K gate=$skip_md")
        return 0
    fi
    if [[ $GATE_MODE == server ]] && ! start_server; then
        STEP_ROWS+=("GSM8K gate=ERROR (server never answered; see server.log)")
        printf 'Not run: the server started by SERVER_CMD never answered (see server.log).\n' >"$skip_md"
        SECTIONS+=("GSM8K gate=$skip_md")
        stop_server
        return 0
    fi
    local run_args=(gate gsm8k run --base-url "$GATE_URL" --model "$MLACHECK_GSM8K_MODEL"
        --out "$dir/run.json" --num-concurrent "$GSM8K_CONCURRENT" --meta "job=nightly")
    if [[ -n $GSM8K_LIMIT ]]; then run_args+=(--limit "$GSM8K_LIMIT"); fi
    if [[ -n $GSM8K_DATA_DIR ]]; then run_args+=(--data-dir "$GSM8K_DATA_DIR"); fi
    if [[ $GATE_MODE == server ]]; then run_args+=(--server-args "$SERVER_CMD"); fi
    if [[ -n ${GITHUB_SHA:-} ]]; then run_args+=(--meta "commit=$GITHUB_SHA"); fi
    local extra=()
    read -r -a extra <<<"$GATE_RUN_ARGS"
    run_args+=("${extra[@]}")
    say "running: mlacheck ${run_args[*]}"
    local rc=0
    "${MLA[@]}" "${run_args[@]}" 2>&1 | tee "$dir/run.log" || rc=${PIPESTATUS[0]}
    stop_server
    if [[ ! -s "$dir/run.json" ]]; then
        step_error "GSM8K run wrote no record (exit $rc): $(grep -E 'error' "$dir/run.log" | tail -n 1 || true)"
        STEP_ROWS+=("GSM8K gate=ERROR (no run record; see gsm8k/run.log)")
        printf 'Not compared: the run wrote no record (see gsm8k/run.log).\n' >"$skip_md"
        SECTIONS+=("GSM8K gate=$skip_md")
        return 0
    fi
    # A partial record (the server failed mid-run: a crashing kernel does that) is compared
    # anyway: it always FAILs, and the report says how far it got.
    read -r -a extra <<<"$GATE_COMPARE_ARGS"
    local cmp=(gate gsm8k compare "$BASELINE_PATH" "$dir/run.json" --out-dir "$dir" "${extra[@]}")
    say "running: mlacheck ${cmp[*]}"
    rc=0
    "${MLA[@]}" "${cmp[@]}" 2>&1 | tee "$dir/compare.log" || rc=${PIPESTATUS[0]}
    case $rc in
        0) STEP_ROWS+=("GSM8K gate=PASS") ;;
        1) STEP_ROWS+=("GSM8K gate=FAIL") ;;
        *)
            step_error "GSM8K compare failed (exit $rc): $(tail -n 1 "$dir/compare.log")"
            STEP_ROWS+=("GSM8K gate=ERROR (compare exit $rc; see gsm8k/compare.log)")
            ;;
    esac
    if [[ $rc -le 1 ]]; then record_rc "$rc"; fi
    SECTIONS+=("GSM8K gate=$dir/gsm8k_gate.md")
}

write_report() {
    local args=(combine --out "$ARTIFACTS/nightly.md" --title "mlacheck nightly") row
    for row in "${STEP_ROWS[@]}"; do args+=(--step "$row"); done
    for row in "${SECTIONS[@]}"; do args+=(--section "$row"); done
    "${CI_PY[@]}" "${args[@]}" || say "warning: could not write $ARTIFACTS/nightly.md"
}

main() {
    local start=$SECONDS
    setup_python
    detect_gpus
    if [[ -z $MATRIX ]]; then
        MATRIX=smoke
        if [[ $MODE == gpu ]]; then MATRIX=nightly; fi
    fi
    mkdir -p "$ARTIFACTS" || die "cannot create ARTIFACTS=$ARTIFACTS"
    ARTIFACTS=$(cd "$ARTIFACTS" && pwd)
    check_gate_config
    trap stop_server EXIT
    trap 'stop_server; exit 130' INT TERM

    step_matrix
    step_selftest
    step_gate
    write_report

    echo
    say "summary ($((SECONDS - start)) s; report: $ARTIFACTS/nightly.md)"
    local row
    for row in "${STEP_ROWS[@]}"; do say "  ${row%%=*}: ${row#*=}"; done
    say "exit $FINAL_RC"
    return "$FINAL_RC"
}

main "$@"
