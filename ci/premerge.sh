#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# mlacheck pre-merge job: the premerge matrix on every usable backend, pytest-xdist workers
# sharing the GPUs; JUnit XML, JSON lines and an HTML report in $ARTIFACTS; a one-screen summary.
#
#   ci/premerge.sh                      # ROCm/CUDA runner, or CPU fallback
#   MATRIX=smoke BACKENDS=torch ci/premerge.sh
#
# GPU node: MATRIX=premerge on the platform's backends, each required: ROCm aiter,
# aiter-nonpersistent, aiter-triton, torch; CUDA aiter-triton, torch, and flashinfer,
# flashinfer-fa3, flashmla when installed (optional by default). A required backend that
# `mlacheck list --json` does not call usable ends the job with exit 6 and one line naming it
# and why; OPTIONAL_BACKENDS makes one optional (run when usable), and the summary says so at
# its top. CPU machine (no GPU seen by torch): the smoke matrix on mlacheck's embedded
# default backend, so a CPU CI can run this script as is.
#
# Exit (README "Exit codes"): 0 everything requested ran and passed (SKIP with reasons and
# KNOWN allowed); 1 some FAIL, CRASH or strict XPASS; 3 a suite error; 5 nothing selected;
# 6 not enough ran (a required backend is not usable here or executed no case, REQUIRE_OPS /
# MIN_EXECUTED not met, an incomplete run); 2 bad environment or usage (one line on stderr: REQUIRE_GPU=1 without a
# GPU, GPUs torch cannot see, unknown backend, bad matrix, nothing recorded).
#
# Artifacts ($ARTIFACTS): results.jsonl, junit.xml, report.md, report.html, summary.txt,
# summary.md (the markdown CI posts as a step summary), run.log, report.log, backends.json
# (`mlacheck list --json`), backends.log (what the backends' libraries printed meanwhile).
set -euo pipefail

# ---- knobs (environment variables) ---------------------------------------------------------
MATRIX=${MATRIX:-}                      # matrix name or YAML path; default premerge (GPU) / smoke (CPU)
BACKENDS=${BACKENDS:-}                  # space/comma separated; default: the platform's (see above)
OPTIONAL_BACKENDS=${OPTIONAL_BACKENDS:-} # of those, the ones that may be missing (run when usable)
DEVICE=${DEVICE:-auto}                  # auto | cpu | cuda (ROCm GPUs are "cuda" to torch)
WORKERS=${WORKERS:-}                    # xdist workers; default 1 on CPU, on GPUs mlacheck run's (2 cores each, <= 8 per GPU)
ARTIFACTS=${ARTIFACTS:-./mlacheck-artifacts}
REQUIRE_GPU=${REQUIRE_GPU:-0}           # 1: no GPU is an error (exit 2), not a CPU fallback
VISIBLE_DEVICES=${VISIBLE_DEVICES:-}    # e.g. 0,1,2,3: exported as HIP_/CUDA_VISIBLE_DEVICES
MARKERS=${MARKERS:-}                    # pytest -m expression, e.g. "not large_kv"
SHARD=${SHARD:-}                        # K/N: only the K-th of N shards (join them with mlacheck merge)
SEED=${SEED:-}                          # another draw of the same matrix (mlacheck run --seed); default 0
MERGE=${MERGE:-}                        # shard results files or globs: merge them instead of running (mlacheck merge)
TIMEOUT=${TIMEOUT:-600}                 # seconds per case (pytest-timeout); a hang is a failure
REQUIRE_OPS=${REQUIRE_OPS:-}            # e.g. mla_decode,mla_prefill: each backend must run one
MIN_EXECUTED=${MIN_EXECUTED:-}          # least executed fraction per backend x op (0..1)
ALLOW_XPASS=${ALLOW_XPASS:-0}           # 1: a known failure that passes does not fail the job
PYTHON=${PYTHON:-python3}               # the interpreter that has mlacheck and torch
MLACHECK=${MLACHECK:-}                  # mlacheck command; default "$PYTHON -m mlacheck.cli"
# ---------------------------------------------------------------------------------------------

CI_NAME=premerge
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

main() {
    local start=$SECONDS
    setup_python
    detect_gpus
    if [[ -z $MATRIX ]]; then
        MATRIX=smoke
        if [[ $MODE == gpu ]]; then MATRIX=premerge; fi
    fi
    mkdir -p "$ARTIFACTS" || die "cannot create ARTIFACTS=$ARTIFACTS"
    ARTIFACTS=$(cd "$ARTIFACTS" && pwd)
    choose_backends "$ARTIFACTS"
    local n
    for n in "${NOTES[@]}"; do say "$n"; done
    local name=${MATRIX##*/}
    run_matrix "$ARTIFACTS" "mlacheck premerge: ${name%.yaml}"
    echo
    if [[ -s "$ARTIFACTS/summary.txt" ]]; then cat "$ARTIFACTS/summary.txt"; fi
    local f files=()
    for f in junit.xml results.jsonl report.html report.md summary.md; do
        if [[ -s "$ARTIFACTS/$f" ]]; then files+=("$f"); fi
    done
    say "artifacts in $ARTIFACTS: ${files[*]:-none}"
    say "done in $((SECONDS - start)) s, exit $MATRIX_RC"
    return "$MATRIX_RC"
}

main "$@"
