"""Benchmarking jaxllm the way vLLM is benchmarked: `jaxllm bench throughput | latency | serve`
(commands.py), over vLLM's random dataset (datasets.py), with the serving client that
benchmarks/serving.py uses too (serve.py). The fuller comparisons with other engines live in
the repository's benchmarks/ folder."""

from __future__ import annotations

import os
import platform


def machine_info() -> dict:
    """The CPU (model name, family and model number: AMD's Zen 3 and Zen 4 share family 25 and the
    name "AMD EPYC"; the SIMD flags that pick code paths), cores, memory, OS."""
    cpu = platform.processor() or platform.machine()
    mem_gib, family, model, flags = None, None, None, []
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        cpu, family, model = fields.get("model name", cpu), fields.get("cpu family"), fields.get("model")
        flags = fields.get("flags", "").split()
        with open("/proc/meminfo") as f:
            mem_gib = round(int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) / 2**20, 1)
    except OSError:
        pass
    simd = " ".join(sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))))
    return {
        "cpu": cpu,
        "cpu_family": family,
        "cpu_model": model,
        "simd": simd,
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "platform": platform.platform(),
    }
