#!/usr/bin/env bash
# One call on a GPU machine: every test (GPU ones included), compute-sanitizer
# over each kernel family, the demo, the planner's calibration, tuning and
# model-accuracy runs, then the benchmarks. Full logs and JSON go under $OUT
# (default ./gpu_check_out); a short summary is printed last. Runs from a
# checkout with no install and no network: PYTHONPATH points at the repository.
#
#   STAGES       which stages run, in this order (default: all of them):
#                tests sanitize demo calibrate tune accuracy grnn models host compile regret scaling dtypes tf32
#                dynamic serve resident training figure3 runs onnx targets sync recurrence profile (models is the real-models suite;
#                tf32 is grnn-table with torch's fp32 matmul precision 'high', written as tf32.*;
#                host, compile and regret come after grnn and models, whose tuning leaves every case's plan in the
#                cache; figure3 is the ReLU RNN 1152 training sweep with its memory, runs the char-LM and SST training
#                runs, onnx the imported GRU and LSTM of the import issue's targets against ONNX Runtime, resident
#                one stream's latency with captured batches and in resident mode, and the bare resident tick, profile
#                where a step's time goes in each case's planned configuration)
#   PYTEST_ARGS  narrows the tests (default: the whole suite, the concurrency and failure tests included)
#   ACCURACY_ARGS, BENCH_ARGS, DTYPES_ARGS, TF32_ARGS, PROFILE_ARGS  narrow model-accuracy, the recurrence bench, dtypes, tf32
#                and the step profile (e.g. PROFILE_ARGS="--case lstm:256:1")
#   REGRET_ARGS  e.g. "--suites grnn-table" for the planner-regret suite
#   DYNAMIC_ARGS, SERVE_ARGS  narrow the treelstm/tagger and serve suites (e.g. DYNAMIC_ARGS="--batch 1 16")
#   DYNET_WHEEL  a dynet38 wheel for this Python, installed (no dependencies) before the dynamic suites, whose
#                DyNet peer is otherwise absent
#   TRAINING_ARGS  the training suite's arguments (default: --inputs padded packed)
#   PACK=1       pack everything under $OUT into $OUT/results.tgz at the end
#   HOST_ARGS, COMPILE_ARGS  narrow the host-time and torch.compile suites (e.g. HOST_ARGS="--batch 1",
#                COMPILE_ARGS="--cases lstm-2x128-b1 --no-torch-compile")
#   PERSISTRNN_COMMIT  names the commit where the copy has no .git, or one older than its files (each run's
#                files otherwise name git's HEAD, marked "with uncommitted changes" where tracked files differ)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PERSISTRNN_CACHE_DIR=${PERSISTRNN_CACHE_DIR:-/tmp/persistrnn-cache}
PY=${PYTHON:-python3}
STAGES=${STAGES:-tests sanitize demo calibrate tune accuracy grnn models host compile regret scaling dtypes tf32 dynamic serve resident training figure3 runs onnx targets sync recurrence profile}
declare -A RC
SUMMARY=()

# The concurrency and failure tests are GPU tests in files of their own; the
# summary gives their counts apart, so that a run that left them out (a
# narrowing PYTEST_ARGS, or a file not written yet) says so.
OWN_COUNTS=(tests/test_concurrency.py tests/test_failure.py)

own_counts() {
    $PY - "$OUT/tests.xml" "${OWN_COUNTS[@]}" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

xml, files = Path(sys.argv[1]), sys.argv[2:]
counts = {f: {"passed": 0, "failed": 0, "skipped": 0} for f in files}
for case in (ET.parse(xml).getroot().iter("testcase") if xml.exists() else []):
    module = case.get("classname", "")  # tests.test_failure, or tests.test_failure.TestClass
    for f in files:
        name = f.removesuffix(".py").replace("/", ".")
        if module == name or module.startswith(name + "."):
            kind = "failed" if case.find("failure") is not None or case.find("error") is not None else (
                "skipped" if case.find("skipped") is not None else "passed")
            counts[f][kind] += 1
for f in files:
    c = counts[f]
    if not Path(f).exists():
        print(f"  {f}: absent")
    elif not sum(c.values()):
        print(f"  {f}: not run (PYTEST_ARGS left it out, or it did not collect: see tests.log)")
    else:
        print(f"  {f}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
EOF
}

stage_tests() {
    $PY -m pytest ${PYTEST_ARGS:-tests} -q -rfEs -p no:cacheprovider --junitxml="$OUT/tests.xml" 2>&1 \
        | tee "$OUT/tests.log" | tail -n 3
    RC[tests]=${PIPESTATUS[0]}
    SUMMARY+=("tests: exit ${RC[tests]}: $(tail -n 1 "$OUT/tests.log")")
    SUMMARY+=("$(own_counts)")
}

stage_sanitize() {
    RC[sanitize]=0
    for tool in memcheck racecheck; do
        compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 $PY scripts/sanitize_recurrence.py \
            >"$OUT/sanitizer-$tool.log" 2>&1 || RC[sanitize]=$?
        SUMMARY+=("sanitizer $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|FAIL' "$OUT/sanitizer-$tool.log" | tr '\n' ' ')")
    done
}

stage_demo() {
    $PY -m persistrnn >"$OUT/demo.log" 2>&1
    RC[demo]=$?
    SUMMARY+=("demo: exit ${RC[demo]}" "$(cat "$OUT/demo.log")")
}

# The cost model's micro-benchmarks, measured afresh on this GPU.
stage_calibrate() {
    $PY - "$OUT/calibration.json" >"$OUT/calibrate.log" 2>&1 <<'EOF'
import sys, time
from persistrnn.plan import model
t0 = time.perf_counter()
cal = model.calibration(progress=False, refresh=True)
open(sys.argv[1], "w").write(cal.to_json())
print(f"calibration of {cal.device}: {time.perf_counter() - t0:.1f} s")
EOF
    RC[calibrate]=$?
    SUMMARY+=("calibrate: exit ${RC[calibrate]}: $(tail -n 1 "$OUT/calibrate.log")")
}

# First-call tuning cost for new shapes (K=5), then the same in a new process,
# which must reuse the cached choice.
stage_tune() {
    RC[tune]=0
    for args in "--cell lstm --input-size 256 --hidden-size 256 --batch 1 8" \
                "--cell gru --input-size 1024 --hidden-size 1024 --batch 20" \
                "--cell lstm --input-size 128 --hidden-size 128 --layers 3 --batch 1 10" \
                "--cell lstm --input-size 256 --hidden-size 256 --dtype bfloat16 --batch 8" \
                "--cell gru_reset_before --input-size 256 --hidden-size 256 --batch 1" \
                "--cell lstm --input-size 1024 --hidden-size 4096 --batch 1"; do
        for pass in first cached; do
            echo "## $pass: tune $args" >>"$OUT/tune.log"
            $PY -m persistrnn tune $args >>"$OUT/tune.log" 2>&1 || RC[tune]=$?
        done
    done
    $PY -m persistrnn explain --cell lstm --input-size 256 --hidden-size 256 --batch 1 >>"$OUT/tune.log" 2>&1 || RC[tune]=$?
    SUMMARY+=("tune: exit ${RC[tune]}" "$(grep -E '^##|tuning took|: (persistent|fallback|cudnn)' "$OUT/tune.log")")
}

stage_accuracy() {
    $PY -m persistrnn.bench model-accuracy ${ACCURACY_ARGS:-} --json "$OUT/model-accuracy.json" \
        --markdown "$OUT/model-accuracy.md" >"$OUT/bench_accuracy.log" 2>&1
    RC[accuracy]=$?
    SUMMARY+=("model-accuracy: exit ${RC[accuracy]}" "$(cat "$OUT/model-accuracy.md" 2>/dev/null || tail -n 20 "$OUT/bench_accuracy.log")")
}

# The comparison suites (persistrnn beside cuDNN, the CPU and ONNX Runtime),
# then the speed targets judged over all of their results.
compare_suite() {  # suite, stage, the files' name, then the suite's options
    local suite=$1 stage=$2 name=$3
    shift 3
    $PY -m persistrnn bench "$suite" --no-progress "$@" --json "$OUT/$name.json" --csv "$OUT/$name.csv" \
        --markdown "$OUT/$name.md" --plot "$OUT/$name.png" >"$OUT/bench_$name.log" 2>&1
    RC[$stage]=$?
    if [ -f "$OUT/$name.md" ]; then
        SUMMARY+=("bench $name: exit ${RC[$stage]}" "$(sed -n '/^| model/,/^$/p' "$OUT/$name.md" | cut -c1-160)")
    else
        SUMMARY+=("bench $name: exit ${RC[$stage]}" "$(tail -n 30 "$OUT/bench_$name.log")")
    fi
}

stage_grnn() { compare_suite grnn-table grnn grnn-table; }
stage_models() { compare_suite real-models models real-models; }
stage_scaling() { compare_suite scaling scaling scaling; }
stage_dtypes() { compare_suite dtypes dtypes dtypes ${DTYPES_ARGS:-}; }
# fp32 with TF32 allowed (torch's matmul precision 'high'): the layers where the planner may pick TF32 kernels.
stage_tf32() {
    compare_suite grnn-table tf32 tf32 --matmul-precision high ${TF32_ARGS:---cells lstm gru --hidden 256 1024 --batch 8 16 20 64}
}

# Host time per call, and torch.compile beside eager: their tables (each
# case's targets met or missed) and the count of targets met go in the summary.
own_suite() {
    local suite=$1 stage=$2
    shift 2
    $PY -m persistrnn bench "$suite" --no-progress "$@" --json "$OUT/$suite.json" --markdown "$OUT/$suite.md" \
        >"$OUT/bench_$suite.log" 2>&1
    RC[$stage]=$?
    if [ -f "$OUT/$suite.md" ]; then
        SUMMARY+=("bench $suite: exit ${RC[$stage]}" "$(sed -n '/^| model\|^| inputs\|^| cell/,/^$/p;/ met, .* missed, of /p;/^Mean regret/p' "$OUT/$suite.md" | cut -c1-220)")
    else
        SUMMARY+=("bench $suite: exit ${RC[$stage]}" "$(tail -n 30 "$OUT/bench_$suite.log")")
    fi
}

stage_host() { own_suite host host ${HOST_ARGS:-}; }
stage_compile() { own_suite compile compile ${COMPILE_ARGS:-}; }
stage_regret() { own_suite planner-regret regret ${REGRET_ARGS:-}; }

# Dynamic networks and the serving engine: each suite writes its own files.
stage_dynamic() {
    RC[dynamic]=0
    if [ -n "${DYNET_WHEEL:-}" ]; then
        $PY -m pip install -q --no-deps "$DYNET_WHEEL" >"$OUT/dynet_install.log" 2>&1 || RC[dynamic]=$?
    fi
    for suite in treelstm tagger; do
        $PY -m persistrnn bench "$suite" ${DYNAMIC_ARGS:-} --out "$OUT" >"$OUT/bench_$suite.log" 2>&1 || RC[dynamic]=$?
        SUMMARY+=("bench $suite: $(sed -n '/^| batch/,/^$/p' "$OUT/$suite.md" 2>/dev/null | cut -c1-200 || tail -n 5 "$OUT/bench_$suite.log")")
    done
}
stage_serve() { own_suite serve serve ${SERVE_ARGS:-}; }
stage_resident() {
    $PY scripts/resident_latency.py >"$OUT/resident_latency.log" 2>&1
    RC[resident]=$?
    SUMMARY+=("resident latency: exit ${RC[resident]}" "$(grep -E '^(engine|resident)' "$OUT/resident_latency.log")")
}
stage_training() { own_suite training training ${TRAINING_ARGS:---inputs padded packed}; }

# The Persistent RNNs paper's Figure 3 (ReLU RNN 1152, useful TFLOP/s against the batch) with the memory a step keeps.
stage_figure3() {
    $PY -m persistrnn bench training --no-progress --cell rnn_relu --hidden 1152 --batch 1 2 4 8 16 32 64 --memory \
        --json "$OUT/training-rnn-relu.json" --markdown "$OUT/training-rnn-relu.md" \
        --plot "$OUT/training-rnn-relu.png" >"$OUT/bench_training-rnn-relu.log" 2>&1
    RC[figure3]=$?
    SUMMARY+=("bench training, ReLU RNN 1152: exit ${RC[figure3]}" \
              "$(sed -n '/^| cell/,/^$/p' "$OUT/training-rnn-relu.md" 2>/dev/null | cut -c1-220)")
}

# Real training runs beside PyTorch: the char-LM on PTB and the Tree-LSTM on SST, each writing its own files.
stage_runs() {
    RC[runs]=0
    for suite in charlm sst; do
        $PY -m persistrnn bench "$suite" --no-progress --out "$OUT" >"$OUT/bench_$suite.log" 2>&1 || RC[runs]=$?
        SUMMARY+=("bench $suite: $(grep -E '^\| |^Losses|^Target' "$OUT/$suite.md" 2>/dev/null | cut -c1-220 \
                                   || tail -n 5 "$OUT/bench_$suite.log")")
    done
}

# The import issue's targets: an imported canonical GRU (T=100, batch 1) and LSTM (batch 1 and 8), H=256, timed
# against ONNX Runtime's CPU provider and its CUDA provider where the installed build has one.
stage_onnx() {
    RC[onnx]=0
    $PY scripts/onnx_models.py "$OUT/onnx" >"$OUT/onnx_models.log" 2>&1 || RC[onnx]=$?
    for case in "gru256 1" "lstm256 1" "lstm256 8"; do
        set -- $case
        $PY -m persistrnn onnx "$OUT/onnx/$1.onnx" --batch "$2" --steps 100 >"$OUT/onnx-$1-b$2.txt" 2>&1 || RC[onnx]=$?
        SUMMARY+=("onnx $1, batch $2: $(grep -E '^persistrnn:|^ONNX Runtime|at batch' "$OUT/onnx-$1-b$2.txt" | cut -c1-200)")
    done
}

stage_targets() {
    local results=()
    for suite in grnn-table real-models host compile scaling dtypes; do
        [ -f "$OUT/$suite.json" ] && results+=("$OUT/$suite.json")
    done
    $PY -m persistrnn bench targets "${results[@]}" --markdown "$OUT/targets.md" >"$OUT/bench_targets.log" 2>&1
    RC[targets]=$?
    SUMMARY+=("bench targets: exit ${RC[targets]}" "$(cat "$OUT/bench_targets.log")")
}

stage_sync() {
    $PY -m persistrnn.bench sync --json "$OUT/sync.json" --markdown "$OUT/sync.md" >"$OUT/bench_sync.log" 2>&1
    RC[sync]=$?
    SUMMARY+=("bench sync: exit ${RC[sync]}")
}

stage_recurrence() {
    $PY -m persistrnn.bench recurrence ${BENCH_ARGS:-} --json "$OUT/recurrence.json" --markdown "$OUT/recurrence.md" \
        >"$OUT/bench_recurrence.log" 2>&1
    RC[recurrence]=$?
    SUMMARY+=("bench recurrence: exit ${RC[recurrence]}" "$(cat "$OUT/recurrence.md" 2>/dev/null || tail -n 30 "$OUT/bench_recurrence.log")")
}

stage_profile() {
    $PY -m persistrnn bench step-profile ${PROFILE_ARGS:-} --json "$OUT/step-profile.json" \
        --markdown "$OUT/step-profile.md" >"$OUT/bench_step-profile.log" 2>&1
    RC[profile]=$?
    SUMMARY+=("bench step-profile: exit ${RC[profile]}" "$(sed -n '/^| case/,/^$/p' "$OUT/step-profile.md" 2>/dev/null | cut -c1-260 || tail -n 30 "$OUT/bench_step-profile.log")")
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader >"$OUT/nvidia-smi.txt" 2>&1
for stage in $STAGES; do "stage_$stage"; done

echo
echo "==== summary (commit ${PERSISTRNN_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null)}, $(cat "$OUT/nvidia-smi.txt")) ===="
printf '%s\n' "${SUMMARY[@]}"
status=0
for stage in $STAGES; do [ "${RC[$stage]}" -eq 0 ] || status=1; done
# PACK=1: everything under $OUT in one archive (a remote runner may return only a few files).
if [ "${PACK:-0}" = 1 ]; then
    tar czf "$PWD/results.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$PWD/results.tgz" "$OUT/"
fi
exit $status
