#!/usr/bin/env bash
# Every GPU check of one short lease on a GPU machine, in the order that tells the most if it is
# cut short: the machine, the attention kernels' timings (benchmarks/gpu.py), the quantized
# matmul's against a bf16 dot and its tiling search (benchmarks/gpu_quant.py), the kernels'
# numerics tests compiled for the GPU (tests/helpers/cuda_lowering.py's INTERPRET is false there), then
# the engine (bf16, and each of QUANTIZATION's entries, METHOD[:KV_CACHE_DTYPE]).
#
#   OUT=/some/dir bash benchmarks/gpu_checks.sh          # logs and JSON land in $OUT
#
# Each part has its own time limit (KERNELS_S, QUANT_S, TESTS_S, ENGINE_S seconds), so one that
# hangs still leaves the others' results; PARTS picks the parts and their order (default
# "kernels quant tests engine"), TEST_FILES and TESTS_K the tests (pytest paths, a -k
# expression), SWEEP the matrices the tiling search runs on (SWEEP_S seconds for it). It needs what the GPU
# image has (jax, numpy, safetensors, pytest, torch, transformers); packages it lacks (gguf)
# travel as wheels in .whl/ (see the device tool's README), installed first.
set -u
OUT=${OUT:-/tmp/jaxllm-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import sys, jax; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/machine.log"

kernels() {
    timeout "${KERNELS_S:-150}" python3 benchmarks/gpu.py --skip-engine --skip-quant \
        --contexts "${CONTEXTS:-1024,8192,32768}" --repeat 10 --out "$OUT/gpu-kernels.json" 2>&1 | tee "$OUT/kernels.log"
}

quant() {
    timeout "${QUANT_S:-300}" python3 benchmarks/gpu_quant.py --matrices "${MATRICES:-qkv,o,gate_up,down}" \
        --sweep "${SWEEP:-gate_up,down}" --sweep-rows "${SWEEP_ROWS:-16,128,1024}" --sweep-s "${SWEEP_S:-150}" --out "$OUT/gpu-quant.json" 2>&1 | tee "$OUT/quant.log"
}

tests() {
    timeout "${TESTS_S:-180}" python3 -m pytest -p no:cacheprovider -q -rfE --timeout 120 \
        ${TEST_FILES:-tests/quantization/test_quantization.py::test_pallas_quantized_matmul_matches_numpy_and_lowers_for_cuda \
        tests/quantization/test_quantization.py::test_pallas_quantized_matmul_tiles_agree_with_numpy \
        tests/kernels/test_paged_attention.py tests/kernels/test_paged_attention_mgpu.py tests/models/test_models.py} \
        -k "${TESTS_K:-not cpu and not reference}" 2>&1 | tee "$OUT/tests.log"
}

engine() {
    timeout "${ENGINE_S:-180}" python3 benchmarks/gpu.py --skip-kernels --skip-quant --layers "${LAYERS:-4}" \
        --quantization "none${QUANTIZATION:+,$QUANTIZATION}" \
        --out "$OUT/gpu-engine.json" 2>&1 | grep -v "Delay kernel timed out" | tee "$OUT/engine.log"
}

for part in ${PARTS:-kernels quant tests engine}; do
    "$part"
done
