#!/usr/bin/env bash
# The GPU measurements behind bench/RESULTS.md, as named parts:
#   bash bench/device_pending.sh trainer_1p5b trainer_sac     # 1 GPU (cold compile: minutes)
#   bash bench/device_pending.sh trainer_vary                 # 1 GPU
#   bash bench/device_pending.sh fp8_test trainer_fp8         # 1 Hopper GPU (torchao from .whl-ray)
#   bash bench/device_pending.sh serving                      # 1 GPU
#   bash bench/device_pending.sh fsdp_test fsdp_throughput    # 2 GPUs
#   bash bench/device_pending.sh rl                           # 2 GPUs
#   bash bench/device_pending.sh fsdp_scale1 fsdp_scale2 fsdp_scale4 fsdp_7b   # 1, 2, 4 GPUs
#   bash bench/device_pending.sh trainer_lora                 # 1 GPU
#   bash bench/device_pending.sh fsdp_cp2                     # 2 GPUs (context parallelism)
#   bash bench/device_pending.sh multi_server                 # 4 GPUs
#   bash bench/device_pending.sh trainer_7b_offload           # 1 GPU of a machine with >= 256 GB RAM
#   bash bench/device_pending.sh megatron                     # 1 GPU (megatron-core wheel in .whl/)
#   bash bench/device_pending.sh megatron_tp2 megatron_pp2    # 2 GPUs (the same)
#   bash bench/device_pending.sh megatron_cp2                 # 2 GPUs (the same; context parallelism)
#   bash bench/device_pending.sh megatron_ep2                 # 2 GPUs (the same; Qwen3-MoE experts over EP=2)
#   bash bench/device_pending.sh megatron_rl                  # 2+ GPUs: refractor train, Megatron TP=2 vs FSDP2
#   bash bench/device_pending.sh lora_sync                    # 1 GPU (LoRA adapter vs merged vs full push)
#   bash bench/device_pending.sh rl_from_scratch              # 4 GPUs (Ray wheel without its jars, pyzmq)
#   bash bench/device_pending.sh rl_from_scratch_1gpu         # 1 GPU, then rl_from_scratch_resume x 2-3
#                                                             # (the next calls on the same warm machine)
#   bash bench/device_pending.sh rl_from_scratch_segment      # 1 GPU, one call, any machine: see the part
# Each part writes its output under $OUT/<part>/, and the next part runs even when one fails; a part that
# runs past its limit (seconds, second argument of `part`) is killed. Every part name given runs in order,
# so the sum of their limits bounds one invocation. Two 2-GPU parts share a 4-GPU machine side by side:
#   CUDA_VISIBLE_DEVICES=0,1 bash bench/device_pending.sh rl & CUDA_VISIBLE_DEVICES=2,3 bash \
#     bench/device_pending.sh megatron_rl; wait
# (torchrun runs --standalone, on a free rendezvous port, so two of them do not collide). Wheels in .whl/
# and .whl-ray/ (for a machine that has torch but neither Ray nor the server dependencies) are installed
# into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
[ $# -gt 0 ] || { echo "usage: bash bench/device_pending.sh PART... (see run_part)" >&2; exit 2; }
if [ -f .site.tar.xz ] && [ ! -e /tmp/site/.refractor-wheels ]; then  # bench/device_site.sh's bundle
  # Python's own lzma: the image need not have xz
  python3 -c "import tarfile; tarfile.open('.site.tar.xz').extractall('/tmp/site', filter='data')" \
    || echo "site bundle unpack failed"
fi
if { [ -d .whl ] || [ -d .whl-ray ]; } && [ ! -e /tmp/site/.refractor-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $(ls .whl/*.whl .whl-ray/*.whl 2>/dev/null) >/dev/null 2>&1 \
    && touch /tmp/site/.refractor-wheels \
    || echo "wheel install failed (cp312 wheels; continuing)"  # parts started side by side install once
fi
export PYTHONPATH=/tmp/site:src:bench NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  mkdir -p "$OUT/$name"
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" --out "$OUT/$name" >"$OUT/$name/log.txt" 2>&1
  echo "=== $name: exit $? after $((SECONDS - start)) s"
  tail -n 25 "$OUT/$name/log.txt"
}

run_part() {
  case "$1" in
    trainer_1p5b)
      part trainer_1p5b 300 python bench/bench_trainer.py --sizes 1.5b --variants default,full,sac,noac \
        --warmup 2 --steps 3 ;;
    trainer_sac)
      part trainer_sac 280 python bench/bench_trainer.py --sizes 0.5b --variants default,full,sac,noac \
        --warmup 2 --steps 3 ;;
    trainer_vary)
      part trainer_vary 420 python bench/bench_trainer.py --sizes 0.5b --variants default,full,sac --vary \
        --warmup 4 --steps 3 ;;
    fp8_test)  # 1 Hopper GPU: fp8 steps against bf16, scales after each update, offload, plain export
      mkdir -p "$OUT/fp8_test"
      echo "=== fp8_test"
      timeout 200 python -m pytest tests/trainer/test_fp8_gpu.py -m gpu -q -s -x >"$OUT/fp8_test/log.txt" 2>&1
      echo "=== fp8_test: exit $?"; tail -n 15 "$OUT/fp8_test/log.txt" ;;
    trainer_fp8)  # 1 Hopper GPU: default vs fp8; 0.5B over 50 steps at lr 1e-5 (throughput and loss curves)
      part trainer_fp8 300 python bench/bench_trainer.py --sizes 0.5b --variants default,fp8 --warmup 2 \
        --steps 48 --learning-rate 1e-5 --no-baseline
      part trainer_fp8_1p5b 240 python bench/bench_trainer.py --sizes 1.5b --variants default,fp8 --warmup 2 \
        --steps 3 --no-baseline ;;
    serving)
      part serving 300 python bench/bench_serving.py --model 0.5b --concurrency 384 --prompt-len 128 \
        --gen-len 512 --requests 768 ;;
    fsdp_test)  # 2 GPUs
      mkdir -p "$OUT/fsdp_test"
      echo "=== fsdp_test"
      timeout 250 python -m pytest tests/trainer/test_fsdp_gpu.py -m gpu -q -x >"$OUT/fsdp_test/log.txt" 2>&1
      echo "=== fsdp_test: exit $?"; tail -n 15 "$OUT/fsdp_test/log.txt" ;;
    fsdp_throughput)  # 2 GPUs
      part fsdp_throughput 320 torchrun --standalone --nproc-per-node 2 bench/bench_trainer.py --sizes 0.5b \
        --tokens 32768 --variants default,full,sac --warmup 2 --steps 3 ;;
    rl)  # 2 GPUs
      part rl 420 python bench/bench_rl.py --steps 6 --warmup 2 \
        --modes 0,2,0+dispatch_only_needed_groups=true ;;
    fsdp_scale1 | fsdp_scale2 | fsdp_scale4)  # FSDP2 scaling: 16k tokens per GPU, weak scaling
      local n=${1#fsdp_scale}
      part "$1" 240 torchrun --standalone --nproc-per-node "$n" bench/bench_trainer.py --sizes 0.5b,1.5b \
        --tokens $((16384 * n)) --variants default,full,sac --no-baseline --warmup 2 --steps 3 ;;
    fsdp_7b)  # 4 GPUs: a 7B shape with fp32 master weights and AdamW state, no offload
      part fsdp_7b 300 torchrun --standalone --nproc-per-node 4 bench/bench_trainer.py --sizes 7b --tokens 65536 \
        --variants default --no-baseline --warmup 2 --steps 3 ;;
    trainer_7b_offload)  # 1 GPU, but ~150 GB of host RAM: run it on a machine of several GPUs
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} part trainer_7b_offload 400 python bench/bench_trainer.py \
        --sizes 7b --variants offload --no-baseline --warmup 2 --steps 3 ;;
    trainer_lora)  # 1 GPU: LoRA rank 64 vs full fine-tuning, 0.5B and a 7B shape (full FT of 7B does not fit)
      part trainer_lora 300 python bench/bench_trainer.py --sizes 0.5b --variants default,lora --no-baseline \
        --warmup 2 --steps 3
      part trainer_lora_7b 300 python bench/bench_trainer.py --sizes 7b --variants lora --no-baseline \
        --warmup 2 --steps 3 ;;
    fsdp_cp2)  # 2 GPUs: 32k-token rows shared by 2 context-parallel ranks vs each rank holding whole rows
      part fsdp_cp2 300 torchrun --standalone --nproc-per-node 2 bench/bench_trainer.py --sizes 0.5b --seq-len 32768 \
        --tokens 65536 --variants default --no-baseline --warmup 2 --steps 3 --context-parallel 2
      part fsdp_cp1 300 torchrun --standalone --nproc-per-node 2 bench/bench_trainer.py --sizes 0.5b --seq-len 32768 \
        --tokens 65536 --variants default --no-baseline --warmup 2 --steps 3 ;;
    multi_server)  # 4 GPUs: 3 servers + 1 trainer rank (one of them an eval server), then 2 + 2
      part multi_server 420 python bench/bench_rl.py --steps 6 --warmup 2 --modes \
        "2+inference_num_workers=3+eval_num_servers=1+evals=[{name: countdown, eval_every: 2, num_samples: 64, kwargs: {dataset_name: procedural}}],2+inference_num_workers=2+trainer_num_workers=2" ;;
    megatron)  # 1 GPU: Megatron TP=1/PP=1 vs FSDP2 on the same weights and batch (parity, throughput, MFU)
      part megatron_100m 240 python bench/bench_megatron.py --size 100m
      part megatron 540 python bench/bench_megatron.py --size 0.5b ;;
    megatron_tp2 | megatron_pp2)  # 2 GPUs: TP=2 (PP=2) vs FSDP2 over the same 2 GPUs, and vs the 1-GPU
      # rows of the `megatron` part when its JSON is in $OUT/megatron (same size and tokens)
      local layout=${1#megatron_} reference=()
      [ -f "$OUT/megatron/bench_megatron.json" ] && reference=(--reference "$OUT/megatron/bench_megatron.json")
      part "$1" 420 torchrun --standalone --nproc-per-node 2 bench/bench_megatron.py --size 0.5b "--${layout%2}" 2 \
        "${reference[@]}" ;;
    megatron_cp2)  # 2 GPUs: 32k-token rows shared by 2 Megatron CP ranks vs FSDP2 ranks each holding whole
      # rows (parity and throughput, bf16 rows: float32 attention over a 32k row takes a dense mask), then
      # the Megatron trainer with each rank holding whole rows (DP 2)
      part megatron_cp2 240 torchrun --standalone --nproc-per-node 2 bench/bench_megatron.py --size 0.5b --cp 2 \
        --seq-len 32768 --tokens 65536 --rows fsdp_bf16,megatron_bf16
      local cp2=()
      [ -f "$OUT/megatron_cp2/bench_megatron.json" ] && cp2=(--reference "$OUT/megatron_cp2/bench_megatron.json")
      part megatron_cp1 180 torchrun --standalone --nproc-per-node 2 bench/bench_megatron.py --size 0.5b \
        --seq-len 32768 --tokens 65536 --rows megatron_bf16 "${cp2[@]}" ;;
    megatron_ep2)  # 2 GPUs: a Qwen3-MoE shape (32 experts, 4 per token) with its experts split over the two
      # GPUs (EP=2) vs on both (EP=1), DP=2 in both, same weights and batch: parity and throughput
      part megatron_ep2 480 torchrun --standalone --nproc-per-node 2 bench/bench_megatron.py --size moe-0.7b --ep 2 ;;
    megatron_rl)  # 2+ GPUs: one native server and a Megatron TP=2 trainer (every weight sync gathers the TP
      # shards), then the FSDP2 trainer over the same 2 ranks (DP 2); async 2, the same workload. On two
      # GPUs `colocate: auto` puts the server beside trainer rank 0 (three GPUs: each on its own)
      part megatron_rl 540 python bench/bench_rl.py --steps 8 --warmup 2 --mode-timeout 240 --modes \
        "2+ray_address=''+trainer_num_workers=2+train_backend=megatron+megatron_tensor_parallel_size=2,2+ray_address=''+trainer_num_workers=2" ;;
    lora_sync)  # 1 GPU: trainer and native server on one card (CUDA IPC); full, merged and adapter pushes of
      # LoRA rank 64, Qwen2.5-0.5B and 7B shapes; expected peak ~50 GB (7B: fp32 full trainer + bf16 server)
      part lora_sync 540 python bench/bench_weight_sync.py colocated --lora-rank 64 --sizes 0.5b,7b --repeats 5 ;;
    rl_from_scratch)  # 4 GPUs: SFT bases side by side, then GRPO / lr-0 control / Dr. GRPO / CISPO side by side
      # from the base nearest 25% held-out accuracy; only the report, the PNG and the logs are kept in $OUT
      # (the run stores are too large to bring back)
      mkdir -p "$OUT/rl_from_scratch"
      echo "=== rl_from_scratch"
      timeout 585 python bench/rl_from_scratch.py all --out /tmp/rfs --gpus 0,1,2,3 --sft-steps 1200 --sft-minutes 3.2 \
        --rl-minutes 5.6 --overrides '{"ray_address": "", "learning_rate": 5e-5, "trainer_compile": false}' \
        >"$OUT/rl_from_scratch/log.txt" 2>&1
      echo "=== rl_from_scratch: exit $?"; tail -n 20 "$OUT/rl_from_scratch/log.txt"
      cp /tmp/rfs/rl_report.md /tmp/rfs/rl_report.json /tmp/rfs/rl_from_scratch.png /tmp/rfs/sft_candidates.json \
        "$OUT/rl_from_scratch/" 2>/dev/null
      (cd /tmp/rfs && tar czf "$OUT/rl_from_scratch/logs.tgz" logs) ;;
    rl_from_scratch_1gpu | rl_from_scratch_resume)  # 1 GPU, ~30 minutes in segments on one warm machine:
      # the first part trains the SFT base (a 4.2-minute limit: a fresh machine imports slowly), then
      # GRPO / lr-0 control / Dr. GRPO side by side on the card, each ending with a checkpoint; every
      # `rl_from_scratch_resume` call right after it (while the machine is still held) continues the
      # three runs for 8.5 more minutes; each segment's final eval is a point of the held-out curve.
      # RFS_RUNS picks the runs (default three; two share the card faster)
      mkdir -p "$OUT/$1"
      local runs=${RFS_RUNS:-grpo,control,dr_grpo} gpus
      gpus=$(echo "$runs" | sed 's/[^,]*/0/g')
      local common=(--out /tmp/rfs --gpus "$gpus" --runs "$runs" --rl-steps 2000
        --overrides '{"ray_address": "", "kv_cache_memory_gb": 4, "trainer_compile": false}')
      echo "=== $1"
      if [ "$1" = rl_from_scratch_1gpu ]; then
        timeout 585 python bench/rl_from_scratch.py all "${common[@]}" --candidates std --sft-steps 1200 \
          --sft-minutes 4.2 --rl-minutes 5.0 >"$OUT/$1/log.txt" 2>&1
      else
        timeout 585 python bench/rl_from_scratch.py rl "${common[@]}" --rl-minutes 9.4 --resume \
          >"$OUT/$1/log.txt" 2>&1
      fi
      echo "=== $1: exit $?"; tail -n 12 "$OUT/$1/log.txt"
      cp /tmp/rfs/rl_report.md /tmp/rfs/rl_report.json /tmp/rfs/rl_from_scratch.png /tmp/rfs/sft_candidates.json \
        "$OUT/$1/" 2>/dev/null ;;
    rl_from_scratch_segment)  # 1 GPU, one self-contained call on whichever machine comes (a warm one is
      # not needed): with a hand-off carried in .rfs/ (bench/rl_from_scratch.py --handoff: a run's policy,
      # or the base) every run of RFS_RUNS continues from it, else the SFT base is trained here first.
      # The call ends by handing back every run's policy (and a base trained here) as
      # $OUT/rl_from_scratch_segment/handoff.tar.part-*; the next call carries one model of it (the 64 MiB
      # a call carries holds the site bundle and one model; a reply's 8 files, base and policy): one run
      # per call, RFS_RUNS=grpo, then the control and other algorithms from the base, one call each:
      #   bash bench/device_site.sh .site.tar.xz                                 # once
      #   mkdir -p .rfs-all && cat /work/.device/N/rl_from_scratch_segment/handoff.tar.part-* | tar -x -C .rfs-all
      #   rm -rf .rfs && mkdir .rfs && cp -r .rfs-all/grpo .rfs/                  # carry [".site.tar.xz", ".rfs"]
      mkdir -p "$OUT/$1"
      local runs=${RFS_RUNS:-grpo} gpus
      gpus=$(echo "$runs" | sed 's/[^,]*/0/g')
      # a step's ~60k tokens in one forward pass instead of four: at 12.8M parameters a pass is host overhead
      local overrides='{"ray_address": "", "kv_cache_memory_gb": 4, "trainer_compile": false,
        "trainer_max_tokens_per_forward": 65536}'
      overrides=${RFS_OVERRIDES:-$overrides}
      local common=(--out /tmp/rfs --gpus "$gpus" --runs "$runs" --rl-steps 5000 --handoff /tmp/rfs/handoff
        --call-minutes 9.4 --overrides "$overrides")
      echo "=== $1"
      if [ -d .rfs ]; then
        timeout 590 python bench/rl_from_scratch.py rl "${common[@]}" --continue-from .rfs --rl-minutes 9 \
          >"$OUT/$1/log.txt" 2>&1
      else
        timeout 590 python bench/rl_from_scratch.py all "${common[@]}" --candidates std \
          --sft-steps "${RFS_SFT_STEPS:-1200}" --sft-minutes 4.2 --rl-minutes 9 >"$OUT/$1/log.txt" 2>&1
      fi
      echo "=== $1: exit $?"; tail -n 12 "$OUT/$1/log.txt"
      cp /tmp/rfs/rl_report.md /tmp/rfs/rl_report.json /tmp/rfs/rl_from_scratch.png "$OUT/$1/" 2>/dev/null
      [ -d /tmp/rfs/handoff ] && (cd /tmp/rfs/handoff && tar -cf - .) | split -b 15m - "$OUT/$1/handoff.tar.part-"
      ls -l "$OUT/$1" ;;
    *)
      echo "unknown part $1: trainer_1p5b trainer_sac trainer_vary fp8_test trainer_fp8 serving fsdp_test" \
        "fsdp_throughput rl fsdp_scale1 fsdp_scale2 fsdp_scale4 fsdp_7b multi_server trainer_7b_offload" \
        "trainer_lora fsdp_cp2 megatron megatron_tp2 megatron_pp2 megatron_cp2 megatron_ep2 megatron_rl" \
        "lora_sync rl_from_scratch rl_from_scratch_1gpu rl_from_scratch_resume rl_from_scratch_segment" >&2 ;;
  esac
}

for name in "$@"; do
  run_part "$name"
done
