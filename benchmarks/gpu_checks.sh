#!/usr/bin/env bash
# Every GPU check of one short lease on a GPU machine, in the order that tells the most if it is
# cut short: the machine, the kernels' timings (benchmarks/gpu.py), the kernels' numerics tests
# compiled for the GPU (tests/cuda_lowering.py's INTERPRET is false there), then the engine.
#
#   OUT=/some/dir bash benchmarks/gpu_checks.sh          # logs and JSON land in $OUT
#
# Each part has its own time limit (KERNELS_S, TESTS_S, ENGINE_S seconds), so one that hangs
# still leaves the others' results; PARTS picks the parts and their order (default
# "kernels tests engine"), TESTS_K the tests (a pytest -k expression). It needs what the GPU
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
    timeout "${KERNELS_S:-150}" python3 benchmarks/gpu.py --skip-engine --contexts "${CONTEXTS:-1024,8192,32768}" \
        --repeat 10 --out "$OUT/gpu-kernels.json" 2>&1 | tee "$OUT/kernels.log"
}

tests() {
    timeout "${TESTS_S:-180}" python3 -m pytest -p no:cacheprovider -q -rfE --timeout 120 \
        tests/test_paged_attention.py tests/test_paged_attention_mgpu.py \
        tests/test_quantization.py::test_pallas_quantized_matmul_matches_numpy_and_lowers_for_cuda \
        tests/test_models.py -k "${TESTS_K:-not cpu and not reference}" 2>&1 | tee "$OUT/tests.log"
}

engine() {
    timeout "${ENGINE_S:-180}" python3 benchmarks/gpu.py --skip-kernels --skip-quant --layers "${LAYERS:-4}" \
        --out "$OUT/gpu-engine.json" 2>&1 | grep -v "Delay kernel timed out" | tee "$OUT/engine.log"
}

for part in ${PARTS:-kernels tests engine}; do
    "$part"
done
