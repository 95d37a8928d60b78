#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (a lent GPU's time is short): the CUDA tests, the CUDA benchmarks,
# then the whole suite on that machine's torch. Each part has its own time limit, so one that hangs leaves the rest.
#
# Reproduce (repository root, python3 with a CUDA torch and pytest; transformers, timm and torchvision for the
# convert rows; pytest-xdist for the CUDA tests and the last part):   bash benchmarks/gpu.sh
# Writes logs, convert_cuda_check_cuda.txt and the *_cuda.json results to $OUT (default benchmarks/results/gpu_run);
# the JSON files are also left in benchmarks/results/, where the other results are. With SUITE_S=0, 420 s on an H200
# (2026-11-30, the CUDA tests in 4 processes: 103 s) before bn_rebuild_time.py, bn_rebuild_kernels.py and
# convert_cuda_graph.py were added (parts of at most 75, 75, 40 and 150 s);
# every part at its limit is more than one command's 10 minutes.
# SUITE_S=0 leaves the full suite out (its limit in seconds; 180 by default). BUDGET_S=N ends the run N seconds after
# its start: each part's limit is cut to what is left, and a part with under 20 s left is skipped (a lease's last minutes
# go to the parts first in the order below). CUDA_WORKERS=N runs the CUDA tests in N processes (4 by default; 1: in turn).
set -u
OUT=${OUT:-$PWD/benchmarks/results/gpu_run}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  $PY -m pip list 2>/dev/null | grep -iE "^(torch|transformers|timm|torchvision|numpy|pytest|pytest-xdist) "
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

part() {  # part SECONDS LOG COMMAND...: run with a time limit, append to LOG, print its status and tail
  local limit=$1 log=$2
  shift 2
  local left=$(( ${BUDGET_S:-100000} - SECONDS ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then echo "== skipped (budget spent): $*" | tee -a "$log"; return; fi
  echo "== $* (limit ${limit}s)" >>"$log"
  local start=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1
  echo "== rc=$? after $((SECONDS - start))s: $*" | tee -a "$log"
}

workers=${CUDA_WORKERS:-4}
[ "$workers" -gt 1 ] && xdist="-n $workers" || xdist=""
part 150 "$OUT/cuda_tests.log" $PY -m pytest -m cuda -q -rA -p no:cacheprovider -p no:benchmark $xdist tests  # results/cuda_tests_cuda.log
tail -n 25 "$OUT/cuda_tests.log"
cd benchmarks
# what the one-pass BatchNorm + ReLU rebuild saves where the GPU is busy (batch 128), and where it is used
for model in resnet18 resnet50; do
  part 75 "$OUT/bench.log" $PY bn_rebuild_time.py --model $model --batch 128 --rounds 7
done
grep -E "step_ms_plain|rc=" "$OUT/bench.log" | tail -n 4
# ConvNeXt at batch 16 and the CNNs at batch 32, whose eager steps wait on the host, with each step captured in a
# CUDA graph and replayed; then in bfloat16 (every eager bfloat16 step waits on the host) the models whose plain step has no host wait to
# capture (HF GPT-2's and Llama's have one: transformers' own)
part 150 "$OUT/bench.log" $PY convert_cuda_graph.py --rounds 7
grep -E "graphs|rc=" "$OUT/bench.log" | tail -n 5
part 90 "$OUT/bench.log" $PY convert_cuda_graph.py --rounds 7 --dtype bfloat16 --only hf_bert hf_vit tv_resnet18
grep -E "graphs|rc=" "$OUT/bench.log" | tail -n 4
# the README's step-time table (new measurements first: a run cut short by a lease's time keeps them)
part 150 "$OUT/bench.log" $PY convert_zoo_time.py --wide --device cuda --batch-mult 16 --rounds 7
grep -E "converted|rc=" "$OUT/bench.log" | tail -n 9
# which CUDA kernels the one-pass rebuild matches bit for bit, and its speed, at a ResNet's shapes at batch 128
part 40 "$OUT/bench.log" $PY bn_rebuild_kernels.py --device cuda
part 90 "$OUT/bench.log" $PY convert_waits.py --rounds 7 --batch-mult 16  # what converted Llama's waits cost
grep -E "step_ms_plain|rc=" "$OUT/bench.log" | tail -n 2
part 150 "$OUT/bench.log" $PY convert_zoo_time.py --wide --device cuda --batch-mult 16 --rounds 7 --dtype bfloat16
grep -E "converted|rc=" "$OUT/bench.log" | tail -n 9
# the ResNets at batch 128 (batch 32 waits on the host: 9-26 ms a plain step), where a GPU is busy as in training
part 150 "$OUT/bench.log" $PY convert_zoo_time.py --wide --device cuda --batch-mult 64 --rounds 5 --only tv_resnet18 tv_resnet50 --suffix _bm64
grep -E "converted|rc=" "$OUT/bench.log" | tail -n 3
part 60 "$OUT/bench.log" $PY cuda_tracker_check.py
grep -E "^(mlp|gpt) " "$OUT/bench.log"
part 60 "$OUT/bench.log" $PY step_memory.py --device cuda
PROFILE=tv_resnet18 part 150 "$OUT/convert_cuda_check_cuda.txt" $PY convert_cuda_check.py
grep -E "claims|ms/step" "$OUT/convert_cuda_check_cuda.txt"
cp results/*_cuda.json "$OUT/"
cd ..
# one torch thread per worker: 14 workers of 16 threads each on 16 cores ran half the suite in 240 s (2026-11-28);
# 180 s since convert_waits.py was added, to stay within a command's 10 minutes
[ "${SUITE_S:-180}" -gt 0 ] && OMP_NUM_THREADS=1 part "${SUITE_S:-180}" "$OUT/full_suite.log" $PY -m pytest -v -rf -n 14 -p no:cacheprovider -p no:benchmark -m "not cuda" tests
[ "${SUITE_S:-180}" -gt 0 ] && grep -E "FAILED|ERROR|passed|failed" "$OUT/full_suite.log" | tail -n 30
