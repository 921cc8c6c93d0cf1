# shellcheck shell=bash
# Shared functions of ci/premerge.sh and ci/nightly.sh (sourced, not run).
#
# Conventions: progress goes to stdout prefixed with "$CI_NAME:"; a bad environment is ONE
# line on stderr and exit code 2 (die); the callers keep their knobs at their top.

CI_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$CI_DIR/.." && pwd)
CI_NAME=${CI_NAME:-mlacheck-ci}
EXIT_USAGE=2

say() { printf '%s: %s\n' "$CI_NAME" "$*"; }
die() {
    printf '%s: error: %s\n' "$CI_NAME" "$*" >&2
    exit "$EXIT_USAGE"
}
have() { command -v "$1" >/dev/null 2>&1; }

# Run a probe command with a time limit when `timeout` exists (rocm-smi can hang on a
# wedged GPU); its stderr is dropped.
probe() {
    if have timeout; then
        timeout 60 "$@" 2>/dev/null
    else
        "$@" 2>/dev/null
    fi
}

# A fact from Python: the code calls answer(value), which writes it to a file; what the
# interpreter or a library prints on import (stdout or stderr) is dropped and cannot become
# part of the value.
py_answer() {
    local file rc=0
    file=$(mktemp "${TMPDIR:-/tmp}/mlacheck-ci.XXXXXX")
    "$PYTHON" -c 'import sys
def answer(value):
    with open(sys.argv[1], "w") as f:
        f.write(str(value))
exec(sys.argv[2])' "$file" "$1" >/dev/null 2>&1 || rc=$?
    if [[ $rc -eq 0 ]]; then cat "$file"; fi
    rm -f "$file"
    return "$rc"
}

# Which python and which mlacheck. Inside the mlacheck checkout itself the checkout's code is
# what is tested, whatever an earlier `pip install -e` points at: put it first on PYTHONPATH.
setup_python() {
    PYTHON=${PYTHON:-python3}
    have "$PYTHON" || die "python interpreter '$PYTHON' not found (set PYTHON)"
    if [[ -f "$REPO_ROOT/mlacheck/__init__.py" && -f "$REPO_ROOT/pyproject.toml" ]]; then
        export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if [[ -n ${MLACHECK:-} ]]; then
        read -r -a MLA <<<"$MLACHECK"
    else
        MLA=("$PYTHON" -m mlacheck.cli)
    fi
    local plugin
    plugin=$(py_answer 'import mlacheck
from importlib.metadata import entry_points
answer(any(e.value.startswith("mlacheck.pytest_plugin") for e in entry_points(group="pytest11")))') ||
        die "python '$PYTHON' cannot import mlacheck: pip install mlacheck (docs/ci.md)"
    # A checkout used without `pip install` has no pytest11 entry point: load the plugin by name.
    if [[ $plugin != True && -z ${PYTEST_PLUGINS:-} ]]; then
        export PYTEST_PLUGINS=mlacheck.pytest_plugin
    fi
    CI_PY=("$PYTHON" "$CI_DIR/mlacheck_ci.py")
}

# Detect GPUs. Sets:
#   GPU_TOOL, GPU_TOOL_COUNT   what amd-smi / rocm-smi / nvidia-smi see (all GPUs of the node)
#   TORCH_BUILD                rocm | cuda | cpu (the torch build)
#   GPU_COUNT                  GPUs torch can use (HIP/CUDA_VISIBLE_DEVICES respected)
#   MODE, PLATFORM             gpu + rocm|cuda, or cpu + none
# Knobs read: DEVICE (auto|cpu|cuda), REQUIRE_GPU, VISIBLE_DEVICES.
detect_gpus() {
    : "${DEVICE:=auto}" "${REQUIRE_GPU:=0}"
    case $DEVICE in
        auto | cpu | cuda) ;;
        cuda:*) die "DEVICE=$DEVICE: choose GPUs with VISIBLE_DEVICES=${DEVICE#cuda:} (each xdist worker gets one of them) and DEVICE=cuda" ;;
        *) die "DEVICE=$DEVICE: expected auto, cpu or cuda" ;;
    esac
    GPU_TOOL="" GPU_TOOL_COUNT=0
    local n
    if have amd-smi; then
        n=$(probe amd-smi list | grep -cE '^GPU: *[0-9]+' || true)
        if [[ ${n:-0} -gt 0 ]]; then GPU_TOOL=amd-smi GPU_TOOL_COUNT=$n; fi
    fi
    if [[ $GPU_TOOL_COUNT -eq 0 ]] && have rocm-smi; then
        n=$(probe rocm-smi --showid | grep -oE '^GPU\[[0-9]+\]' | sort -u | wc -l || true)
        if [[ ${n:-0} -gt 0 ]]; then GPU_TOOL=rocm-smi GPU_TOOL_COUNT=$n; fi
    fi
    if [[ $GPU_TOOL_COUNT -eq 0 ]] && have nvidia-smi; then
        n=$(probe nvidia-smi -L | grep -cE '^GPU [0-9]+' || true)
        if [[ ${n:-0} -gt 0 ]]; then GPU_TOOL=nvidia-smi GPU_TOOL_COUNT=$n; fi
    fi

    TORCH_BUILD=$(py_answer 'import torch
answer("rocm" if getattr(torch.version, "hip", None) else ("cuda" if torch.version.cuda else "cpu"))') ||
        die "python '$PYTHON' cannot import torch (install the ROCm/CUDA build of torch first)"

    # VISIBLE_DEVICES: the GPUs this job may use (e.g. "0,1,2,3" on a shared node). Only the
    # variable of the platform is set: ROCm also reads CUDA_VISIBLE_DEVICES, and two
    # different lists would confuse the per-worker mapping.
    if [[ -n ${VISIBLE_DEVICES:-} ]]; then
        case $TORCH_BUILD in
            rocm) export HIP_VISIBLE_DEVICES=$VISIBLE_DEVICES ;;
            cuda) export CUDA_VISIBLE_DEVICES=$VISIBLE_DEVICES ;;
        esac
    fi

    GPU_COUNT=0
    if [[ $DEVICE != cpu && $TORCH_BUILD != cpu ]]; then
        GPU_COUNT=$(py_answer 'import torch
answer(torch.cuda.device_count() if torch.cuda.is_available() else 0)') || GPU_COUNT=0
    fi

    local seen="no GPU tool found (amd-smi, rocm-smi, nvidia-smi)"
    if [[ -n $GPU_TOOL ]]; then seen="$GPU_TOOL sees $GPU_TOOL_COUNT GPU(s)"; fi
    if [[ $DEVICE == cpu ]]; then
        if [[ $REQUIRE_GPU == 1 ]]; then die "REQUIRE_GPU=1 but DEVICE=cpu"; fi
        MODE=cpu PLATFORM=none
    elif [[ $GPU_COUNT -gt 0 ]]; then
        MODE=gpu PLATFORM=$TORCH_BUILD
    elif [[ $GPU_TOOL_COUNT -gt 0 ]]; then
        die "$seen but torch ($TORCH_BUILD build) sees none: install the ROCm/CUDA build of torch or fix HIP_VISIBLE_DEVICES/CUDA_VISIBLE_DEVICES (or DEVICE=cpu)"
    elif [[ $REQUIRE_GPU == 1 ]]; then
        die "no GPU found and REQUIRE_GPU=1 ($seen; torch is the $TORCH_BUILD build)"
    elif [[ $DEVICE == cuda ]]; then
        die "no GPU found and DEVICE=$DEVICE ($seen; torch is the $TORCH_BUILD build)"
    else
        MODE=cpu PLATFORM=none
    fi
    if [[ $MODE == gpu ]]; then
        # Name the GPUs explicitly (indices as torch counts them, i.e. after any
        # ROCR_VISIBLE_DEVICES): the plugin gives xdist worker gwK the K-th entry, so the
        # mapping never depends on its own GPU count (all GPUs of the node). On ROCm the HIP
        # runtime reads HIP_VISIBLE_DEVICES when it is set, else CUDA_VISIBLE_DEVICES: a
        # runner that restricts the job with CUDA_VISIBLE_DEVICES keeps exactly that subset
        # (HIP_VISIBLE_DEVICES=0..N-1 would move the job onto other GPUs of the node).
        local var=CUDA_VISIBLE_DEVICES
        if [[ $PLATFORM == rocm ]]; then var=HIP_VISIBLE_DEVICES; fi
        if [[ -z ${!var:-} ]]; then
            if [[ $PLATFORM == rocm && -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
                export HIP_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES
            else
                export "$var=$(seq -s, 0 $((GPU_COUNT - 1)))"
            fi
        fi
        say "GPUs: $GPU_COUNT usable by torch ($TORCH_BUILD build; $seen${HIP_VISIBLE_DEVICES:+; HIP_VISIBLE_DEVICES=$HIP_VISIBLE_DEVICES}${CUDA_VISIBLE_DEVICES:+; CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES})"
    else
        say "no GPU: CPU mode ($seen; torch is the $TORCH_BUILD build)"
    fi
}

# The backends to run. Sets the arrays RUN_BACKENDS (empty: mlacheck's embedded default),
# NOTES (lines for the top of the summary: the required backends, the optional ones and
# whether they ran) and UNUSABLE ("name: why" of required backends that are not usable here).
# BACKENDS (knob): space/comma separated names or pkg.module:factory paths, all required
# except those OPTIONAL_BACKENDS names; unset: the platform's defaults (ci/mlacheck_ci.py
# PLATFORM_BACKENDS). What is usable comes from `mlacheck list --json` on stdout alone, read
# from a file: nothing a library prints while it is imported (stdout or stderr, which goes to
# backends.log) can change which backends run.
choose_backends() {
    local dir=$1
    RUN_BACKENDS=() NOTES=() UNUSABLE=()
    # MERGE: the shards' results are joined, nothing runs here (their headers name the backends)
    if [[ -n ${MERGE:-} || ($MODE == cpu && -z ${BACKENDS:-}) ]]; then return 0; fi
    local listing=$dir/backends.json plan=$dir/backends.plan platform=$PLATFORM names
    mkdir -p "$dir"
    if [[ $MODE == cpu ]]; then platform=none; fi
    names=$("${CI_PY[@]}" candidates --platform "$platform" --backends "${BACKENDS:-}") ||
        die "cannot list the candidate backends"
    say "asking mlacheck list --json which of $names are usable here"
    local b asked=()
    for b in $names; do asked+=(-b "$b"); done
    "${MLA[@]}" list --json "${asked[@]}" >"$listing" 2>"$dir/backends.log" ||
        die "mlacheck list --json failed (exit $?; see $dir/backends.log)"
    local why
    why=$("${CI_PY[@]}" plan "$listing" --platform "$platform" --out "$plan" \
        --backends "${BACKENDS:-}" --optional "${OPTIONAL_BACKENDS:-}" 2>&1) ||
        die "${why#mlacheck-ci: error: }"
    local kind name
    while IFS=$'\t' read -r kind name why; do
        case $kind in
            run) RUN_BACKENDS+=("$name") ;;
            note) NOTES+=("$name") ;;
            unusable) UNUSABLE+=("$name: $why") ;;
        esac
    done <"$plan"
    return 0
}

# Run one matrix into $1 (a folder): results.jsonl, junit.xml, run.log, report.md/.html,
# summary.txt/.md. Sets MATRIX_RC to the gate's exit code (README "Exit codes": 0 pass,
# 1 FAIL/CRASH/XPASS, 3 suite error, 5 nothing selected, 6 not enough ran) or 2 when mlacheck
# could not run at all (bad environment or usage, no verdicts).
# Knobs read: MATRIX, WORKERS, MARKERS, SHARD, SEED, MERGE, TIMEOUT, REQUIRE_OPS, MIN_EXECUTED, ALLOW_XPASS;
# uses MODE, RUN_BACKENDS, NOTES, UNUSABLE.
run_matrix() {
    local out=$1 title=$2
    mkdir -p "$out"
    rm -f "$out/results.jsonl" "$out/junit.xml" "$out/report.md" "$out/report.html" \
        "$out/summary.txt" "$out/summary.md" "$out/run.log"
    local device=cpu
    if [[ $MODE == gpu ]]; then device=cuda; fi
    # WORKERS unset: one on a CPU runner (the fallback gate), else mlacheck run's own default
    # (2 cores per worker, at most 8 per GPU, as host memory allows)
    local workers=${WORKERS:-} worker_args=()
    if [[ -z $workers && $MODE != gpu ]]; then workers=1; fi
    if [[ -n $workers ]]; then worker_args=(--workers "$workers"); fi
    local policy=()
    if [[ -n ${REQUIRE_OPS:-} ]]; then policy+=(--require-ops "$REQUIRE_OPS"); fi
    if [[ -n ${MIN_EXECUTED:-} ]]; then policy+=(--min-executed "$MIN_EXECUTED"); fi
    if [[ ${ALLOW_XPASS:-0} == 1 ]]; then policy+=(--allow-xpass); fi
    local args=(run --matrix "$MATRIX" --device "$device" --results "$out/results.jsonl"
        --junit "$out/junit.xml" --timeout "$TIMEOUT" --no-report
        "${worker_args[@]}" "${policy[@]}")
    local b backend_args=()
    for b in "${RUN_BACKENDS[@]}"; do backend_args+=(--backend "$b"); done
    args+=("${backend_args[@]}")
    if [[ -n ${MARKERS:-} ]]; then args+=(-m "$MARKERS"); fi
    if [[ -n ${SHARD:-} ]]; then args+=(--shard "$SHARD"); fi
    if [[ -n ${SEED:-} ]]; then args+=(--seed "$SEED"); fi
    local whole=()
    if [[ -n ${MERGE:-} ]]; then
        # the shards' results instead of a run: each word a file or a glob (a glob that
        # matches nothing stays as it is: merge names it as missing)
        local word files=()
        for word in $MERGE; do
            mapfile -t -O "${#files[@]}" files < <(compgen -G "$word" || printf '%s\n' "$word")
        done
        args=(merge "${files[@]}" --results "$out/results.jsonl" --no-report "${policy[@]}")
        backend_args=() whole=(--shards)
    fi
    say "running: mlacheck ${args[*]}"
    local rc=0
    "${MLA[@]}" "${args[@]}" 2>&1 | tee "$out/run.log" || rc=${PIPESTATUS[0]}
    if [[ $rc -eq 5 ]]; then
        MATRIX_RC=5
        printf '%s: error: nothing selected to run (exit 5: empty matrix or MARKERS deselected everything)\n' \
            "$CI_NAME" >&2
        return 0
    fi
    if ! grep -q '"case_id"' "$out/results.jsonl" 2>/dev/null && [[ ${#UNUSABLE[@]} -gt 0 ]]; then
        # mlacheck run refused to start: a required backend is not usable here (exit 6)
        MATRIX_RC=6
        if [[ $rc -ne 6 ]]; then MATRIX_RC=2; fi
        local u
        for u in "${UNUSABLE[@]}"; do
            printf '%s: error: required backend %s is not usable here: %s (OPTIONAL_BACKENDS=%s runs without it)\n' \
                "$CI_NAME" "${u%%: *}" "${u#*: }" "${u%%: *}" >&2
        done
        return 0
    fi
    if ! grep -q '"case_id"' "$out/results.jsonl" 2>/dev/null; then
        MATRIX_RC=2
        local why
        why=$(grep -E '^mlacheck: error: |^(ERROR|E  ) ' "$out/run.log" | tail -n 1 || true)
        printf '%s: error: mlacheck run recorded no verdicts (exit %s%s; see %s)\n' \
            "$CI_NAME" "$rc" "${why:+: ${why#mlacheck: error: }}" "$out/run.log" >&2
        return 0
    fi
    "${MLA[@]}" report "$out/results.jsonl" -o "$out" >"$out/report.log" 2>&1 ||
        say "warning: mlacheck report failed (see $out/report.log)"
    local notes=() n src=${MATRIX##*/}
    src=${src%.yaml}
    if [[ -n ${MERGE:-} ]]; then
        src="the merged shards ${MERGE}"
    elif [[ ${#RUN_BACKENDS[@]} -eq 0 ]]; then
        src="$src, embedded default backends"
    fi
    # the draw (SEED): a nightly that takes another each night says which one it took
    if [[ -z ${MERGE:-} && -n ${SEED:-} ]]; then src="$src, seed offset $SEED"; fi
    for n in "${NOTES[@]}"; do notes+=(--note "$n"); done
    # device and worker count: the summary reads them from the results file's run header
    local src_note=(--note "matrix $src; artifacts in $out")
    local src_rc=0
    "${CI_PY[@]}" summary "$out/results.jsonl" --title "$title" --md "$out/summary.md" \
        "${src_note[@]}" "${notes[@]}" "${backend_args[@]}" "${policy[@]}" "${whole[@]}" \
        >"$out/summary.txt" || src_rc=$?
    # mlacheck run's exit code is the gate's; the summary re-derives it from the file.
    MATRIX_RC=$rc
    case $rc in
        0 | 1 | 3 | 6) ;;
        *)
            printf '%s: error: mlacheck run ended with exit %s (not a verdict; see %s)\n' \
                "$CI_NAME" "$rc" "$out/run.log" >&2
            MATRIX_RC=2
            ;;
    esac
    if [[ $src_rc -eq 2 ]]; then MATRIX_RC=2; fi
    if [[ $MATRIX_RC -eq 0 && $src_rc -ne 0 ]]; then MATRIX_RC=$src_rc; fi
    return 0
}

# Load a KEY=value shell file (ci/nightly.env): what the environment already sets to a
# non-empty value wins (an empty one, e.g. an unset CI variable passed through, does not).
load_env_file() {
    local file=$1 name
    [[ -f $file ]] || return 0
    local -A saved=()
    for name in $(compgen -e); do
        if [[ -n ${!name-} ]]; then saved[$name]=${!name}; fi
    done
    # shellcheck source=/dev/null
    source "$file" || die "cannot load $file"
    for name in "${!saved[@]}"; do
        if [[ ${!name-} != "${saved[$name]}" ]]; then printf -v "$name" '%s' "${saved[$name]}"; fi
    done
    say "config: $file"
}
