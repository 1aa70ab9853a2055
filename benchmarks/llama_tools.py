"""llama.cpp's own benchmark tools (`llama-bench`, `llama-batched-bench`) and its server
(`llama-server`, for serving.py), built once for this machine from the llama.cpp tree vendored
in llama-cpp-python's sdist (../shared/PEERS.md).

    python benchmarks/llama_tools.py          # prints the folder of the tools, building them if absent
    python benchmarks/llama_tools.py --isa avx2   # the same built for AVX2-only CPUs (Zen 2/3)

The wheel ships no tools, so they are built with the machine's native flags (`-DGGML_NATIVE=ON`),
into `<jaxllm cache root>/llama.cpp/<version>/build/bin` (about 15 minutes on two cores, once);
with `isa="avx2"` for AVX2 + FMA + F16C only, into `build-avx2/bin` (the peer of
`benchmarks/as_avx2.sh`).
Needs cmake, ninja and a C++ compiler, and pip's access to the package index.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

from jaxllm.utils import default_cache_root

VERSION = "0.3.36"  # llama-cpp-python, whose vendored llama.cpp the tools are built from
TOOLS = ("llama-bench", "llama-batched-bench")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",  # the server's web page: not built, nor fetched (no network needed)
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)


# -DGGML_NATIVE=ON's replacement for `isa="avx2"`: what Zen 2 / Zen 3 have, nothing wider.
AVX2_OPTIONS = tuple(
    f"-DGGML_{flag}={'ON' if on else 'OFF'}"
    for flag, on in [("NATIVE", False), ("AVX", True), ("AVX2", True), ("FMA", True), ("F16C", True)]
    + [("BMI2", True), ("AVX512", False), ("AVX512_VNNI", False), ("AVX512_BF16", False), ("AVX512_VBMI", False)]
    + [("AVX_VNNI", False)]
)


def tools_dir(root: str | None = None, isa: str = "native") -> str:
    build = "build" if isa == "native" else f"build-{isa}"
    return os.path.join(root or default_cache_root(), "llama.cpp", VERSION, build, "bin")


def ensure_tools(root: str | None = None, log=print, tools: tuple[str, ...] = TOOLS, isa: str = "native") -> str:
    """The folder holding `tools` built for `isa` ("native" or "avx2"), built there first if any
    is missing."""
    if isa not in ("native", "avx2"):
        raise ValueError(f"isa must be 'native' or 'avx2', not {isa!r}")
    bin_dir = tools_dir(root, isa)
    if all(os.access(os.path.join(bin_dir, t), os.X_OK) for t in tools):
        return bin_dir
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp's tools needs {tool} (e.g. `apt install {tool}`)")
    home = os.path.dirname(os.path.dirname(bin_dir))
    os.makedirs(home, exist_ok=True)
    source = os.path.join(home, "source")
    if not os.path.isdir(source):
        log(f"downloading llama-cpp-python {VERSION}'s sdist for its llama.cpp tree")
        with tempfile.TemporaryDirectory(dir=home) as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
                + [f"llama-cpp-python=={VERSION}", "-d", tmp],
                check=True,
            )
            (sdist,) = glob.glob(os.path.join(tmp, "*.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            os.rename(os.path.join(tmp, f"llama_cpp_python-{VERSION}", "vendor", "llama.cpp"), source)
    build = os.path.dirname(bin_dir)
    log(f"building {', '.join(tools)} with {isa} flags into {bin_dir} (about 15 minutes on two cores)")
    options = CMAKE_OPTIONS if isa == "native" else (*CMAKE_OPTIONS[:1], *AVX2_OPTIONS, *CMAKE_OPTIONS[2:])
    subprocess.run(["cmake", "-S", source, "-B", build, "-G", "Ninja", *options], check=True)
    subprocess.run(["cmake", "--build", build, "-j", str(os.cpu_count() or 2), "--target", *tools], check=True)
    return bin_dir


if __name__ == "__main__":
    isa = sys.argv[sys.argv.index("--isa") + 1] if "--isa" in sys.argv else "native"
    print(ensure_tools(log=lambda m: print(m, file=sys.stderr), isa=isa))
