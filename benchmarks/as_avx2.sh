#!/usr/bin/env bash
# Runs a command with jaxllm as it runs on an AVX2-only CPU (Zen 2/3), on any newer x86 host:
# its C++ kernels built for -march=znver3 (AVX2 + FMA + F16C, no AVX-512), in their own cache
# entry (the compiler wrapper below names itself in `--version`, which the cache key reads),
# and XLA's code capped at AVX2. The engine still reads the host's CPU flags, so pass dtype
# float32 and int8_activations (what dtype auto gives a GGUF without AVX512_BF16); every kernel
# path below AVX-512 then runs as on such a CPU, at this host's clock and memory speed (not Zen
# 2/3's).
#
#   benchmarks/as_avx2.sh python benchmarks/real_models.py \
#       --engine-args '{"dtype": "float32", "int8_activations": true}' \
#       --llama-bin "$(python benchmarks/llama_tools.py --isa avx2)"
set -euo pipefail
wrapper_dir=$(mktemp -d)
trap 'rm -rf "$wrapper_dir"' EXIT
cxx=$(command -v "${CXX:-c++}")
cat > "$wrapper_dir/c++" <<WRAP
#!/usr/bin/env bash
if [ "\${1:-}" = "--version" ]; then "$cxx" --version; echo "jaxllm as_avx2.sh: -march=znver3"; exit 0; fi
args=()
for a in "\$@"; do [ "\$a" = "-march=native" ] && a="-march=znver3"; args+=("\$a"); done
exec "$cxx" "\${args[@]}"
WRAP
chmod +x "$wrapper_dir/c++"
export CXX="$wrapper_dir/c++"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_max_isa=AVX2"
"$@"
