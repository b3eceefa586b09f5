#!/usr/bin/env bash
# One lent GPU, one call: the acceptance check, the digits runs in each GPU mode, test_net.py's
# reproduction of the logged top-1, and the ResNet-50 benchmark; logs and a summary under $OUT.
#
#   OUT=/tmp/gpu bash docs/scripts/gpu_session.sh            # on a machine with one CUDA GPU
#   GPU_SESSION_EPOCHS=1 GPU_SESSION_BENCH_OPTS="MODEL.ARCH resnet18 TRAIN.IM_SIZE 32 TRAIN.BATCH_SIZE 16 \
#     DATA.DUMMY_SIZE 512" OUT=/tmp/gpu bash docs/scripts/gpu_session.sh   # a dry run on a CPU
#   GPU_SESSION_STAGES=steady OUT=/tmp/gpu bash docs/scripts/gpu_session.sh   # the batched path's steady state, ~6 min
#   GPU_SESSION_STAGES=steady GPU_SESSION_DRY=1 OUT=/tmp/gpu bash docs/scripts/gpu_session.sh   # its dry run on a CPU
#
# The machine of this workplace has torch and torchvision but not yacs, webdataset or wids: their
# wheels travel in .whl/ (see the device tool's README); elsewhere `pip install -e ".[data]"` first.
# The digits runs share the GPU and the CPU cores, so their images/s are not throughput figures:
# only the benchmark, which runs alone at the end, is.
set -u
OUT=${OUT:-/tmp/gpu_session}
EPOCHS=${GPU_SESSION_EPOCHS:-10}
STAGES=${GPU_SESSION_STAGES:-check,digits,bench}  # also: steady (the batched GPU path's steady state: 8.),
# compile (the benchmark compiled), data (data path),
# gpudata (DATA.DECODER batched at batch 256 from JPEGs: loaders alone, ResNet-50 from JPEGs vs synthetic),
# gloo2 (two ranks sharing the GPU over gloo: gpu_check, DDP, a mid-epoch SIGTERM and its resume, fsdp;
# gpu_check on one rank beside them), modes (compiled ResNet-50 with CUDA graphs, with max-autotune)
has() { [[ ",$STAGES," == *",$1,"* ]]; }
W=$(mktemp -d /tmp/gpu_session.XXXXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2  # 7 runs share the cores
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
START=$SECONDS
stamp() { echo "[$((SECONDS - START)) s] $*" | tee -a "$OUT/summary.txt"; }
logged() { # LOG COMMAND...: run it, its output and exit status in LOG
  local log=$1
  shift
  "$@" >"$log" 2>&1
  echo "exit $?" >>"$log"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, torchvision, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "torchvision", torchvision.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())'
  echo "$(nproc --all) CPU cores"
} 2>&1 | tee -a "$OUT/summary.txt"

# 1. The acceptance check, alone on the GPU.
if has check; then
stamp "gpu_check"
timeout 240 torchrun --standalone --nproc_per_node=1 tools/gpu_check.py >"$OUT/gpu_check.log" 2>&1
echo "gpu_check exit $?" >>"$OUT/gpu_check.log"
grep -E "^gpu_check|PASS|FAIL|SKIP|exit" "$OUT/gpu_check.log" | tee -a "$OUT/summary.txt"
fi

# 2. The digits runs, side by side (README's command with one process, then each mode).
if has digits; then
python3 tools/pack_dataset.py data/digits "$W/packed_jpeg" --quality 95 >"$W/pack.log" 2>&1 || cat "$W/pack.log"
stamp "digits runs: $EPOCHS epochs each"
declare -A RUNS=(
  [fp32]=""
  [bf16]="TRAIN.PRECISION bf16"
  [fp16]="TRAIN.PRECISION fp16"
  [cl_compile]="TRAIN.CHANNELS_LAST True TRAIN.COMPILE True"
  [fsdp]="DIST.STRATEGY fsdp"
  [batched]="DATA.DECODER batched TRAIN.DATASET $W/packed_jpeg TEST.DATASET $W/packed_jpeg"
  [recipe_bf16]="--cfg config/digits_recipe.yaml TRAIN.PRECISION bf16 TRAIN.CHANNELS_LAST True"
)
for name in "${!RUNS[@]}"; do
  # shellcheck disable=SC2086  # the options are words
  timeout 300 torchrun --standalone --nproc_per_node=1 tools/train_net.py ${RUNS[$name]} \
    OUT_DIR "$W/$name" OPTIM.MAX_EPOCH "$EPOCHS" TRAIN.WORKERS 2 >"$OUT/run_$name.log" 2>&1 &
done
wait
for name in "${!RUNS[@]}"; do
  python3 - "$W/$name" "$name" <<'EOF' | tee -a "$OUT/summary.txt"
import json, os, sys
out, name = sys.argv[1:]
path = os.path.join(out, "metrics.jsonl")
rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
val = [r for r in rows if r["split"] == "val" and r.get("weights", "model") == "model"]
if not val:
    print(f"{name:<12} no val line (see run_{name}.log)")
else:
    best = max(val, key=lambda r: r["top1"])
    train_s = sum(r["time_s"] for r in rows if r["split"] == "train")
    print(f"{name:<12} epochs {len(val)}  last top1 {val[-1]['top1']:.2f}  best {best['top1']:.2f} (ep {best['epoch']})  train {train_s:.0f} s")
EOF
done

# 3. test_net.py reproduces the logged top-1 (single file and the fsdp run's sharded best.dcp).
stamp "test_net"
for name in fp32 fsdp; do
  best=$(ls -d "$W/$name"/best.pth.tar "$W/$name"/best.dcp 2>/dev/null | head -1)
  timeout 120 torchrun --standalone --nproc_per_node=1 tools/test_net.py OUT_DIR "$W/$name" MODEL.WEIGHTS "$best" \
    >"$OUT/test_net_$name.log" 2>&1
  python3 - "$W/$name" "$name" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
out, name = sys.argv[1:]
rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
val = [r for r in rows if r["split"] == "val" and r.get("weights", "model") == "model"]
test = [r for r in rows if r["split"] == "test"]
best = max(val, key=lambda r: r["top1"])["top1"]
print(f"test_net {name}: test top1 {test[-1]['top1'] if test else 'missing'} vs logged best val {best}")
EOF
done
fi

# 4. Throughput, the GPU alone: resnet50 at 224 px, batch 256, bf16 + channels_last, synthetic data.
R50="MODEL.ARCH resnet50 MODEL.NUM_CLASSES 1000 TRAIN.BATCH_SIZE 256 TRAIN.IM_SIZE 224 TEST.IM_SIZE 224"
R50="$R50 TRAIN.PRECISION bf16 TRAIN.CHANNELS_LAST True MODEL.DUMMY_INPUT True DATA.DUMMY_SIZE 12800 TRAIN.WORKERS 8"
bench() {  # NAME TIMEOUT BENCHMARK-ARGS...: the GPU alone
  local name=$1 limit=$2
  shift 2
  stamp "benchmark $name"
  # shellcheck disable=SC2086
  timeout "$limit" python3 tools/benchmark.py --json "$OUT/benchmark.jsonl" "$@" OUT_DIR "$W/bench" \
    ${GPU_SESSION_BENCH_OPTS:-} >"$OUT/benchmark_$name.log" 2>&1
  echo "benchmark $name exit $?" >>"$OUT/benchmark_$name.log"
  grep -E "^(train|ratio|data|decode|decode_pipeline|worker_side|packed|eval) |exit" "$OUT/benchmark_$name.log" | tee -a "$OUT/summary.txt"
}
# shellcheck disable=SC2086
has bench && bench r50 150 --what train,plain --steps 20 --warmup 20 --repeats 7 $R50
# shellcheck disable=SC2086
has compile && bench r50_compile 170 --what train,plain --steps 20 --warmup 20 --repeats 5 $R50 TRAIN.COMPILE True
has data && bench decode 150 --what decode --photos 2048 --data-batches 120 --workers 15

# 5. DATA.DECODER batched, about 5 minutes: 500x375 JPEGs from an ImageFolder and from packed shards,
# the loader alone (batched resample, the per-sample transforms after the batched decode, the CPU
# path) at 2, 4 and 15 workers, then compiled ResNet-50 bf16 channels_last trained from the JPEGs
# (4 workers) and from synthetic data. GPU_SESSION_DATA_* shrink it for a dry run; stage 6's
# gpu_check holds the batched path's sync check.
PHOTOS=${GPU_SESSION_DATA_PHOTOS:-1024} COPIES=${GPU_SESSION_DATA_COPIES:-12}
BATCH=${GPU_SESSION_DATA_BATCH:-256} WORKERS=${GPU_SESSION_DATA_WORKERS:-2,4,15}
STEPS=${GPU_SESSION_DATA_STEPS:-15} ARCH=${GPU_SESSION_DATA_ARCH:-resnet50}
DATA="MODEL.NUM_CLASSES 1000 TRAIN.BATCH_SIZE $BATCH TRAIN.IM_SIZE 224 TEST.IM_SIZE 256"
# End to end with 4 workers, the few-cores goal: the batched path's workers read bytes and headers.
E2E="--what train --steps $STEPS --warmup 15 --repeats 3 MODEL.ARCH $ARCH TRAIN.PRECISION bf16"
E2E="$E2E TRAIN.CHANNELS_LAST True TRAIN.COMPILE True TRAIN.WORKERS ${GPU_SESSION_DATA_E2E_WORKERS:-4} $DATA"
SYNTHETIC="MODEL.DUMMY_INPUT True DATA.DUMMY_SIZE $((BATCH * (STEPS + 16)))"
GPU_SESSION_MODES=${GPU_SESSION_MODES:-default,cudagraphs,max_autotune}
if has gpudata; then
  stamp "gpudata: $PHOTOS photos x $COPIES links, batch $BATCH"
  # Unique photos, hard-linked COPIES times: decoding costs the same, and 15 workers x 2 batches of
  # 256 in flight need 46 batches of 256 before the first timed one.
  python3 - "$W/photos" "$PHOTOS" "$COPIES" <<'EOF' || exit 1
import os, sys
sys.path.insert(0, "tools")
from benchmark import make_photo_folder
root, photos, copies = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
make_photo_folder(root, photos)
for d, _, files in os.walk(os.path.join(root, "train")):
    for f in [f for f in files if f.endswith(".jpg")]:
        for k in range(1, copies):
            os.link(os.path.join(d, f), os.path.join(d, f"{k}_{f}"))
EOF
  python3 tools/pack_dataset.py "$W/photos" "$W/photos_packed" >"$OUT/gpudata_pack.log" 2>&1 || tail -3 "$OUT/gpudata_pack.log"
  for source in ${GPU_SESSION_DATA_SOURCES:-photos photos_packed}; do  # the ImageFolder, the packed shards
    for path in batched batched_per_sample auto; do
      case $path in
        batched) opts="DATA.DECODER batched" ;;
        batched_per_sample) opts="DATA.DECODER batched DATA.BATCHED_AUGMENT False" ;;
        auto) opts="DATA.DECODER auto" ;;
      esac
      # shellcheck disable=SC2086
      bench "data_${source}_$path" 100 --what data --workers "$WORKERS" --data-batches 4 --repeats 1 \
        TRAIN.DATASET "$W/$source" TEST.DATASET "$W/$source" $DATA $opts
    done
  done
  # shellcheck disable=SC2086
  bench r50_jpeg 150 $E2E TRAIN.DATASET "$W/photos" TEST.DATASET "$W/photos" DATA.DECODER batched
  # shellcheck disable=SC2086
  bench r50_synthetic 120 $E2E $SYNTHETIC
fi

# 6. Two ranks sharing the one GPU over gloo (NCCL refuses that), about 2 minutes, correctness only:
# gpu_check's rows with two ranks (SyncBatchNorm across them, fsdp's shards on CUDA); DDP on the
# digits with deterministic kernels, uninterrupted and SIGTERMed mid-epoch on both ranks then
# resumed, the last checkpoints compared; fsdp's best.dcp of 2 ranks read by 1 (test_net.py). And
# gpu_check on one rank (NCCL) beside them: the check that nothing regressed.
if has gloo2; then
  stamp "gloo2: two ranks on one GPU over gloo; gpu_check on one rank beside them"
  TWO="torchrun --standalone --nproc_per_node=2"
  G="DIST.BACKEND gloo TRAIN.WORKERS 2 MODEL.ARCH resnet18 CUDNN.DETERMINISTIC True CUDNN.BENCHMARK False"
  DDP="$G OPTIM.MAX_EPOCH 3 TRAIN.PRINT_FREQ 5"  # 22 steps an epoch: the SIGTERM after step 30 is in epoch 2
  logged "$OUT/gpu_check.log" timeout 240 torchrun --standalone --nproc_per_node=1 tools/gpu_check.py &
  # shellcheck disable=SC2086
  logged "$OUT/gpu_check_gloo2.log" timeout 240 $TWO tools/gpu_check.py --backend gloo &
  # shellcheck disable=SC2086
  logged "$OUT/run_ddp_straight.log" timeout 240 $TWO tests/scripts/tiny_train.py $DDP OUT_DIR "$W/ddp_straight" &
  # shellcheck disable=SC2086
  logged "$OUT/run_ddp_stopped.log" env FAULT_SIGNAL_AT_STEP=30 FAULT_SIGNAL_RANK=all \
    timeout 240 $TWO tests/scripts/tiny_train.py $DDP OUT_DIR "$W/ddp_resumed" &
  # shellcheck disable=SC2086
  logged "$OUT/run_fsdp2.log" timeout 240 $TWO tools/train_net.py $G DIST.STRATEGY fsdp OPTIM.MAX_EPOCH 2 \
    OUT_DIR "$W/fsdp2" &
  wait
  # shellcheck disable=SC2086
  logged "$OUT/run_ddp_resumed.log" timeout 200 $TWO tests/scripts/tiny_train.py $DDP OUT_DIR "$W/ddp_resumed" &
  logged "$OUT/test_net_fsdp2.log" timeout 120 torchrun --standalone --nproc_per_node=1 tools/test_net.py \
    OUT_DIR "$W/fsdp2" MODEL.WEIGHTS "$W/fsdp2/best.dcp" &
  wait
  for log in gpu_check gpu_check_gloo2; do
    grep -E "^gpu_check|PASS|FAIL|SKIP|^exit" "$OUT/$log.log" | sed "s/^/$log: /" | tee -a "$OUT/summary.txt"
  done
  for run in ddp_straight ddp_stopped ddp_resumed fsdp2; do
    said=$(grep -oE "exitcode *: *-?[0-9]+|preempted at epoch [0-9]+, step [0-9]+|resumed from .* at epoch [0-9]+, step [0-9]+|^exit [0-9]+" "$OUT/run_$run.log")
    echo "run_$run: $(echo "$said" | sort -u | tr '\n' ';')" |
      tee -a "$OUT/summary.txt"
  done
  python3 docs/scripts/gloo2_report.py "$W" 3 2>&1 | tee -a "$OUT/summary.txt"
fi

# 7. Compile modes, the GPU alone, about 5 minutes: stage 5's synthetic run with torch's default
# mode, with CUDA graphs (inductor's triton.cudagraphs, what mode "reduce-overhead" turns on) and
# with max-autotune (without CUDA graphs: mode "max-autotune-no-cudagraphs"), each within
# GPU_SESSION_MODE_LIMIT seconds, compile included (GPU_SESSION_MODES picks them).
if has modes; then
  for mode in ${GPU_SESSION_MODES//,/ }; do
    case $mode in
      cudagraphs) export TORCHINDUCTOR_CUDAGRAPHS=1 ;;
      max_autotune) export TORCHINDUCTOR_MAX_AUTOTUNE=1 ;;
    esac
    # shellcheck disable=SC2086
    bench "r50_compile_$mode" "${GPU_SESSION_MODE_LIMIT:-200}" $E2E $SYNTHETIC
    unset TORCHINDUCTOR_CUDAGRAPHS TORCHINDUCTOR_MAX_AUTOTUNE
    grep -iE "skipping cudagraphs|overwritten" "$OUT/benchmark_r50_compile_$mode.log" | sort | uniq -c | head -3 |
      tee -a "$OUT/summary.txt"
  done
fi
# 8. The batched GPU path's steady state, one call of under 10 minutes (about 6 expected):
# the model's ceiling (a batch resident on the device, CUDA events, batch 256 and 512, compiled),
# whole epochs of train_net.py from JPEGs (each window's img/s and data wait a step from its log,
# memory_reserved after each loader pass), the resample alone (fp32 / TF32 / bf16 / fp16 products,
# the shipped two-term fp16 whole and chunked), the worst cases (12 MP photos; one CMYK JPEG a
# batch) and a profiler trace of 20 steps. GPU_SESSION_DRY=1 shrinks every part to run on a CPU
# in a few minutes (the dry run). Results: steady.jsonl (one JSON line each), steady.log,
# epochs_log.txt (train_net.py's log), trace.json.gz and kernels.txt: 6 files with summary.txt.
if has steady; then
  if [[ ${GPU_SESSION_DRY:-0} == 1 ]]; then # a CPU: the smallest sizes that run every path
    ARCH=shufflenet_v2_x0_5 IM=32 EVAL_IM=36 CEILING_BATCHES=8,16 BATCH=8 PHOTOS=64 COPIES=2 PSIZE=48x64
    EPOCHS=2 STEPS=3 WARM=2 RSIZES=48x64,300x400 RBATCH=4 RBUDGET=0.001 SCALE=0.05 WORKERS=2 TRACE_STEPS=3 COMPILE=False
  else
    ARCH=resnet50 IM=224 EVAL_IM=256 CEILING_BATCHES=256,512 BATCH=256 PHOTOS=1024 COPIES=12 PSIZE=375x500
    EPOCHS=3 STEPS=30 WARM=10 RSIZES=375x500,3000x4000 RBATCH=256 RBUDGET=7 SCALE=1 WORKERS=4 TRACE_STEPS=20 COMPILE=True
  fi
  MODEL="MODEL.ARCH $ARCH MODEL.NUM_CLASSES 1000 TRAIN.IM_SIZE $IM TEST.IM_SIZE $EVAL_IM TRAIN.PRECISION bf16"
  MODEL="$MODEL TRAIN.CHANNELS_LAST True TRAIN.COMPILE $COMPILE LOG.PLOT False"
  JPEGS="TRAIN.DATASET $W/photos TEST.DATASET $W/photos DATA.DECODER batched TRAIN.WORKERS $WORKERS"
  JPEGS="$JPEGS TRAIN.BATCH_SIZE $BATCH TEST.BATCH_SIZE $BATCH"
  J=(--json "$OUT/steady.jsonl")
  steady() { # NAME TIMEOUT MODULE ARGS...: one measurement, its output appended to steady.log
    local name=$1 limit=$2
    shift 2
    stamp "steady: $name"
    echo "=== $name: $*" >>"$OUT/steady.log"
    timeout "$limit" python3 -m "$@" >>"$OUT/steady.log" 2>&1
    echo "=== $name exit $?" | tee -a "$OUT/steady.log" "$OUT/summary.txt"
  }
  # shellcheck disable=SC2086  # the options are words
  steady ceiling 150 benchmarks.ceiling "${J[@]}" --batches $CEILING_BATCHES --steps $STEPS --warmup $WARM $MODEL
  # One val batch: evaluation compiles one graph
  steady photos 30 benchmarks.photos "$W/photos" --photos $PHOTOS --copies $COPIES --size $PSIZE --val $BATCH
  # shellcheck disable=SC2086
  steady epochs 190 benchmarks.epochs "${J[@]}" OUT_DIR "$W/epochs" $JPEGS OPTIM.MAX_EPOCH $EPOCHS TRAIN.PRINT_FREQ 10 $MODEL
  cp "$W/epochs/log.txt" "$OUT/epochs_log.txt" 2>/dev/null
  # shellcheck disable=SC2086
  steady resample 50 benchmarks.resample "${J[@]}" --batch $RBATCH --sizes $RSIZES --budget-gib $RBUDGET --repeats 10
  # shellcheck disable=SC2086
  steady worst_cases 90 benchmarks.worst_cases "${J[@]}" --work "$W/worst" --batch $BATCH --batches 3 --scale $SCALE \
    TRAIN.WORKERS $WORKERS TRAIN.IM_SIZE $IM
  # shellcheck disable=SC2086
  steady trace 60 benchmarks.trace "${J[@]}" --out "$W/trace" --steps $TRACE_STEPS --warmup $WARM $JPEGS $MODEL
  cp "$W/trace/trace.json.gz" "$W/trace/kernels.txt" "$OUT/" 2>/dev/null
  python3 -c 'import json, sys
for line in open(sys.argv[1]):
    print(" ".join(f"{k}={v}" for k, v in json.loads(line).items() if k != "device"))' "$OUT/steady.jsonl" |
    tee -a "$OUT/summary.txt"
fi
stamp "done"
rm -rf "$W"
