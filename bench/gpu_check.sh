#!/usr/bin/env bash
# GPU check (issue: Triton kernels): kernel tests on CUDA, kernel benchmarks, then the engine end to
# end with Gemma 3 270M at 32K (exact and selective decode tokens/s, pool MiB), SmolLM2 on its GGUF
# blocks through the Triton dequantize-in-register kernel beside float32, then the tensor-parallel
# path at world size 1 under torchrun with NCCL (one GPU; two ranks need two GPUs). Prints one table per
# part. On a machine without CUDA it runs what the CPU can: the kernel tests under the Triton
# interpreter, and says that the GPU parts were skipped.
#   bash bench/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/kvpage-gpu-check}}
mkdir -p "$out"
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  cuda=1
  python -c "import torch; print('device:', torch.cuda.get_device_name(0))"
else
  cuda=0
  export TRITON_INTERPRET=1
  echo "no CUDA: kernel tests run under the Triton interpreter; GPU benchmarks skipped"
fi
status=0
echo "== kernel tests"
python -m pytest tests/test_kernels.py -q -x 2>&1 | tail -3 || status=1
echo "== kernel benchmarks (decode attention GB/s vs copy bandwidth and SDPA; copy/compute overlap)"
python bench/kernels_bench.py --json "$out/kernels.json" || status=1
if [ "$cuda" = 1 ]; then
  echo "== engine end to end: Gemma 3 270M, 32K context, exact and selective (1/8 pool)"
  python bench/decode.py --model gemma3-270m --device cuda --lengths 32768 --new-tokens 64 \
    --policies quest,draft --json "$out/engine.json" || status=1
  echo "== quantized weights on the Triton kernels (SmolLM2's GGUF blocks) beside float32: decode tok/s, answers"
  for w in float32 gguf; do
    kvpage ask samples/contract.pdf "Which law governs this agreement?" --device cuda --weights "$w" \
      --max-new-tokens 64 --no-cache --json > "$out/weights-$w.json" || status=1
    python -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], d['stats']['decode_tokens_per_s'], 'tok/s', \
      d['stats']['weight_bytes'] // 2**20, 'MiB weights:', d['answer'][:80])" "$out/weights-$w.json" "$w" || status=1
  done
  echo "== tensor-parallel path at world size 1 with NCCL (torchrun): the answer equals the plain run's"
  q="Which law governs this agreement?"
  kvpage ask samples/contract.pdf "$q" --device cuda --max-new-tokens 24 --no-cache --json > "$out/tp-plain.json" || status=1
  torchrun --standalone --nproc-per-node 1 "$(command -v kvpage)" ask samples/contract.pdf "$q" --device cuda \
    --max-new-tokens 24 --no-cache --json --tp 1 > "$out/tp-nccl.json" || status=1
  python -c "import json,sys; a,b=(json.load(open(f))['answer'] for f in sys.argv[1:]); print('same answer:', a==b); sys.exit(a!=b)" \
    "$out/tp-plain.json" "$out/tp-nccl.json" || status=1
fi
exit $status
