#!/usr/bin/env bash
# One call on a lent GPU machine: install the wheels it lacks from the carried .whl/ folder, run every section
# of the GPU check and the snapshot experiments, each part within its time budget, and write the whole log
# (and each part's) under $OUT. docs/benchmarks.md, "The prepared GPU check", says what the parts measure.
#
#   in the checkout, once:  mkdir -p .whl && cp ../shared/wheels/*.whl .whl/ && echo '*' > .whl/.gitignore
#   the device call:        run(command="bash benchmarks/gpu_check/on_device.sh", carry=[".whl"], timeout_s=600)
#
# Parts, in order, with their budgets in seconds (540 together: 9 minutes, within the 10 one command may run).
# A part's timeout is its budget plus what the parts before it left unused: a slow part cannot take the time
# of the parts after it.
#   setup      20  the wheels (torchdata for train.py, py-spy for section 7), the machine's line
#   overhead  300  python -m benchmarks.gpu_check --only 2 (interleaved rounds, then the in-process A/B
#                  with and without checkpoint.copy_graph)
#   checks    145  python -m benchmarks.gpu_check --only 1,3,4,5,6,7
#   stage16b   75  python -m benchmarks.gpu_check.stage_snapshot (a 16B-shaped stage at Algorithm 1's W
#                  against --dry-run's arithmetic)
#
# Environment: OUT (the log folder, default outputs/gpu_check), PYTHON (default python, else python3),
# WHEELS (the carried wheels, default .whl). Without CUDA every part after setup says SKIP in one line and
# the script exits 0. Exit status: 0 when every part passed or was skipped, 1 otherwise.
set -u
cd "$(dirname "$0")/../.." || exit 1

OUT=${OUT:-outputs/gpu_check}
WHEELS=${WHEELS:-.whl}
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
PARTS=(overhead checks stage16b)
declare -A BUDGET=([setup]=20 [checks]=145 [overhead]=300 [stage16b]=75)
declare -A COMMAND=(
    [checks]="-m benchmarks.gpu_check --only 1,3,4,5,6,7"
    [overhead]="-m benchmarks.gpu_check --only 2"
    [stage16b]="-m benchmarks.gpu_check.stage_snapshot"
)
mkdir -p "$OUT" || exit 1
LOG="$OUT/on_device.log"
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }

STARTED=$SECONDS
PLANNED=0 # the budgets of the parts begun so far
FAILED=0
CUDA=False # set by setup

# The carried wheels installed into $WHEELS/site (once per machine; pip within the setup budget) and put on
# PYTHONPATH and PATH; else what to do. False when train.py cannot import torchdata.
setup() {
    local site
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        site="$(cd "$WHEELS" && pwd)/site"
        if [ ! -d "$site/torchdata" ] || [ ! -x "$site/bin/py-spy" ]; then
            timeout "${BUDGET[setup]}" "$PYTHON" -m pip install --quiet --no-index --no-deps \
                --disable-pip-version-check --target "$site" "$WHEELS"/*.whl ||
                echo "setup: pip could not install $WHEELS/*.whl into $site"
        fi
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
        echo "setup: $(cd "$WHEELS" && echo *.whl) in $site"
    else
        echo "setup: no wheels in $WHEELS/ (train.py needs torchdata, section 7 py-spy). To carry them, in the" \
            "checkout: mkdir -p .whl && cp ../shared/wheels/*.whl .whl/ && echo '*' > .whl/.gitignore (git then" \
            "ignores the folder); then run(command=\"bash benchmarks/gpu_check/on_device.sh\", carry=[\".whl\"]," \
            "timeout_s=600)"
    fi
    mapfile -t INFO < <("$PYTHON" - <<'PY'
import importlib.util
import torch
cuda = torch.cuda.is_available()
print(cuda)
print("torchdata", "importable" if importlib.util.find_spec("torchdata") else "MISSING", "torch", torch.__version__,
      "CUDA", torch.version.cuda, "GPU:", torch.cuda.get_device_name() if cuda else "none")
PY
    )
    CUDA=${INFO[0]:-False}
    echo "setup: ${INFO[1]:-python cannot import torch}, $(py-spy --version 2>/dev/null || echo "py-spy MISSING")"
    echo "setup: commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u '+%Y-%m-%d %H:%M UTC')"
    [[ ${INFO[1]:-MISSING} != *MISSING* ]]
}

# Start part $1: its timeout is its budget plus what the parts before it left (nothing, if under 10 s).
begin() {
    PLANNED=$((PLANNED + BUDGET[$1]))
    LIMIT=$((PLANNED - (SECONDS - STARTED)))
    BEGUN=$SECONDS
    say "on_device: $1 starts, timeout ${LIMIT} s (budget ${BUDGET[$1]} s)"
}

# Part $1 ended with exit status $2.
ended() {
    local status
    case $2 in
    0) status=PASS ;;
    124 | 137) status="TIMEOUT after ${LIMIT} s" ;;
    *) status="FAIL (exit $2)" ;;
    esac
    [ "$2" = 0 ] || FAILED=1
    say "on_device: $1 $status in $((SECONDS - BEGUN)) s (budget ${BUDGET[$1]} s; log $OUT/$1.log)"
}

if [ -z "$PYTHON" ]; then
    say "on_device: error: no python on PATH (set PYTHON)"
    exit 1
fi
begin setup
setup >"$OUT/setup.log" 2>&1
rc=$?
tee -a "$LOG" <"$OUT/setup.log"
ended setup "$rc"
if [ "$CUDA" != True ]; then
    for name in "${PARTS[@]}"; do
        say "on_device: $name SKIP: no CUDA device (torch.cuda.is_available() is False)"
    done
    say "on_device: done in $((SECONDS - STARTED)) s: no CUDA device, nothing measured; log $LOG"
    exit 0
fi
for name in "${PARTS[@]}"; do
    begin "$name"
    if [ "$LIMIT" -lt 10 ]; then
        say "on_device: $name SKIP: ${LIMIT} s left of the 9 minutes"
        FAILED=1
        continue
    fi
    # shellcheck disable=SC2086 # the command's words
    timeout -k 10 "$LIMIT" "$PYTHON" ${COMMAND[$name]} 2>&1 | tee "$OUT/$name.log" | tee -a "$LOG"
    ended "$name" "${PIPESTATUS[0]}"
done
say "on_device: done in $((SECONDS - STARTED)) s, $([ $FAILED = 0 ] && echo 'every part passed' || echo 'a part failed'); log $LOG"
exit "$FAILED"
