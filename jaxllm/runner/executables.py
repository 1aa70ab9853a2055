"""Each bucket's compiled step (`CompiledSteps`), kept on disk as an executable
(`ExecutableStore`), so a warm start neither traces nor lowers.

JAX's persistent compilation cache (runner/compile.py) saves XLA's work, but it is keyed by the
lowered program: every start still traces and lowers the 30-layer step once per bucket (about
two thirds of a warm start's warm-up). `ExecutableStore` keeps each bucket's compiled step
(`jax.experimental.serialize_executable`) under a key computed without tracing: the versions
of jax, jaxlib and jaxllm's own sources (Python and C++), the device and its CPU flags,
XLA_FLAGS, the step's static arguments (model config, attention backend, mesh, packed layout)
and the shape, dtype and sharding of every argument. Anything that could change the program
changes the key; a stale or unreadable file is skipped (and rewritten).

Loading executes code from the file (pickle): the store reads only its own directory, under
jaxllm's cache root or the user's `compilation_cache_dir`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax

from jaxllm.runner.compile import Bucket, CompilationCounter, pick_bucket
from jaxllm.platforms import cpu_flags
from jaxllm.utils import release_freed_memory

logger = logging.getLogger("jaxllm")

_FORMAT = b"jaxllm-executable-1"


@functools.cache
def _sources_digest() -> bytes:
    """Hash of jaxllm's sources (every .py file and the C++ kernels), names and bytes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".cc", ".h")):
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    h.update(os.path.relpath(path, root).encode() + b"\0" + f.read() + b"\0")
    return h.digest()


def _environment() -> bytes:
    device = jax.devices()[0]
    parts = [
        _FORMAT,
        jax.__version__,
        jax.lib.__version__,
        device.platform,
        device.client.platform_version,
        str(jax.device_count()),
        str(jax.process_count()),
        " ".join(sorted(cpu_flags())),
        os.environ.get("XLA_FLAGS", ""),
        str(jax.config.jax_enable_x64),
        str(jax.config.jax_default_matmul_precision),
    ]
    return b"\0".join(p if isinstance(p, bytes) else p.encode() for p in parts) + _sources_digest()


def _describe(x) -> str:
    sharding = getattr(x, "sharding", None)
    devices = sorted(d.id for d in sharding.device_set) if sharding is not None else None
    return f"{x.shape}:{x.dtype}:{sharding}:{devices}"  # (a sharding's repr leaves its devices out)


# A step file: this magic, the SHA-256 of the rest, then the pickled serialized executable. The
# reader checks both before unpickling: a file a crash or a full disk cut short, or any other
# damage, is found before it reaches pickle or XLA.
MAGIC = b"JXLLMEX1"


class ExecutableStore:
    """Compiled steps in `directory`, one file per key (`key`, `load`, `save`), each written to a
    temporary name and renamed into place, and checked when read (`MAGIC`)."""

    def __init__(self, directory: str, static: str, devices, max_bytes: int = 2 << 30):
        """`static`: a description of everything the step closes over (cfg, backend, mesh);
        `devices`: the devices the step runs on, in the mesh's order (or the one device);
        `max_bytes`: the most the directory keeps (least recently used steps go first)."""
        self.directory = directory
        self.max_bytes = max_bytes
        self.devices = list(devices)
        static += f"\0devices {[d.id for d in self.devices]}"
        self._base = hashlib.sha256(_environment() + b"\0" + static.encode()).digest()
        self._digests: dict[int, tuple] = {}
        self.num_damaged = 0  # files found unreadable (recompiled and written again)
        self.num_unsaved = 0  # steps that could not be written (a full or read-only disk)

    def key(self, layout, args) -> str:
        """Key of the step compiled for packed layout `layout` and arguments `args` (a tuple)."""
        h = hashlib.sha256(self._base + repr(layout).encode())
        for arg in args:
            h.update(self._digest(arg))
        return h.hexdigest()[:32]

    def _digest(self, tree) -> bytes:
        """A digest of one argument's structure, shapes, dtypes and shardings; remembered for the
        large trees that every bucket passes as the same object (the params: ~500 leaves)."""
        hit = self._digests.get(id(tree))
        if hit is not None and hit[0] is tree:
            return hit[1]
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        h = hashlib.sha256(str(treedef).encode())
        for part in map(_describe, leaves):
            h.update(part.encode() + b"\0")
        if len(leaves) > 16:
            self._digests[id(tree)] = (tree, h.digest())
        return h.digest()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"step-{key}.bin")

    def has(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def load(self, key: str):
        """The `jax.stages.Compiled` saved under `key`, or None (missing or unreadable)."""
        from jax.experimental import serialize_executable

        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            return self._damaged(path, f"it cannot be read ({e.strerror})")
        body = data[len(MAGIC) + 32 :]
        if data[: len(MAGIC)] != MAGIC or hashlib.sha256(body).digest() != data[len(MAGIC) : len(MAGIC) + 32]:
            return self._damaged(path, "its checksum does not match (cut short or damaged)")
        try:
            payload, in_tree, out_tree = pickle.loads(body)
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=self.devices
            )
        except Exception as e:  # intact, but XLA refuses it: compile afresh and overwrite it
            return self._damaged(path, f"XLA could not load it ({type(e).__name__}: {e})")
        with contextlib.suppress(OSError):
            os.utime(path)  # its mtime is its last use: `_evict` drops the least recently used
        return compiled

    def _damaged(self, path: str, why: str) -> None:
        """One warning for the first unreadable file of this store (the rest at debug level):
        it is compiled afresh and written again."""
        self.num_damaged += 1
        log = logger.warning if self.num_damaged == 1 else logger.debug
        log(
            "compiled step %s is unreadable: %s; compiling it again and overwriting it%s",
            os.path.basename(path),
            why,
            " (other unreadable steps of this run are logged at debug level)" if self.num_damaged == 1 else "",
        )
        return None

    def save(self, key: str, compiled) -> bool:
        """Write `compiled` under `key` (atomically; failures are logged, not raised); whether
        it was written."""
        from jax.experimental import serialize_executable

        tmp = None
        try:
            body = pickle.dumps(serialize_executable.serialize(compiled))
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + hashlib.sha256(body).digest() + body)
            os.replace(tmp, self._path(key))
            tmp = None
            self._evict()
            return True
        except Exception as e:  # a step that cannot be serialized still runs; the next start recompiles
            # (once a store: a full or read-only disk fails every step alike)
            self.num_unsaved += 1
            log = logger.warning if self.num_unsaved == 1 else logger.debug
            log(
                "could not save the compiled step (%s: %s); it runs, and the next start compiles it again%s",
                type(e).__name__,
                e,
                " (other steps of this run that cannot be saved are logged at debug level)"
                if self.num_unsaved == 1
                else "",
            )
            return False
        finally:
            if tmp is not None:  # nothing partial is left behind (a full disk, say)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _evict(self) -> None:
        """Keep the directory under `max_bytes`, dropping the least recently used steps (every
        change to jaxllm's sources or the settings leaves the old keys' files unused)."""
        entries = []
        for name in os.listdir(self.directory):
            if name.endswith(".tmp"):  # a writer's, or one a killed writer left: stale after an hour
                with contextlib.suppress(OSError):
                    if time.time() - os.stat(os.path.join(self.directory, name)).st_mtime > 3600:
                        os.unlink(os.path.join(self.directory, name))
            if name.startswith("step-") and name.endswith(".bin"):
                with contextlib.suppress(OSError):
                    st = os.stat(os.path.join(self.directory, name))
                    entries.append((st.st_mtime, st.st_size, name))
        total = sum(size for _, size, _ in entries)
        for _, size, name in sorted(entries):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.directory, name))
            total -= size


class CompiledSteps:
    """The step compiled per bucket: loaded from `store` or compiled (and saved there), on one
    thread per core (XLA compiles and loads with the GIL released), up front or in the background.

    A loaded step stays resident (tens of MiB for a 1.5B model on XLA:CPU: its HLO module,
    buffer assignment and code), so only the steps in use are held: with a store, the smallest
    step of each kind (a request's first shapes) is loaded at start-up and the rest stay on disk
    (`stored`) until a demand first needs them (`pick` loads one in the background, a larger
    ready step serving meanwhile; `get` loads it at once); steps compiled at a first start
    are dropped once saved. `wait` loads them all.

    `jitted(*args, layout=...)` is the step; `abstract_args(bucket) -> (layout, args)` gives a
    bucket's static layout and abstract arguments (called on the caller's thread only)."""

    def __init__(
        self, jitted, buckets: list[Bucket], store: ExecutableStore | None, abstract_args, own_kind: bool = False
    ):
        self.jitted, self.buckets, self.store = jitted, buckets, store
        # With `own_kind` a bucket serves only steps of its own kind, logits for every token
        # (verification) or not: where verification steps take other weights than the rest
        # (`ModelRunner.check_path`). The buckets a demand may take, by its all_logits.
        self._serving = {
            wanted: [b for b in buckets if b.all_logits == wanted] if own_kind else buckets for wanted in (False, True)
        }
        self._abstract_args = abstract_args
        self.ready: dict[Bucket, jax.stages.Compiled] = {}
        self.pending: dict[Bucket, Future] = {}  # compiling or loading on `_pool`
        self.stored: dict[Bucket, str] = {}  # in the store, not loaded: bucket -> key
        self._pool: ThreadPoolExecutor | None = None
        self._hold_all = False  # `wait` was called (or `start(hold=True)`): compiled steps stay loaded
        self._lock = threading.Lock()  # over `pending` and `stored` (a pool thread moves steps)
        self.loaded = 0  # steps taken from the store (the rest were compiled)

    def compile(self, layout, args, key: str | None = None, keep: bool = True):
        """The step for `layout` and `args` (store key `key`, if already known): from the store,
        else traced, compiled and saved. Returns it (None where it was compiled, saved and not
        `keep`: it is loaded when first needed) and whether it was loaded. Safe to call from
        several threads at once."""
        if key is None and self.store is not None:
            key = self.store.key(layout, args)
        compiled = self.store.load(key) if key is not None else None
        if compiled is not None:
            return compiled, True
        with CompilationCounter(cache_hits=True) as hits:  # (hits on any thread: at worst a save skipped)
            compiled = self.jitted.lower(*args, layout=layout).compile()
        # An executable that JAX's persistent cache loaded (a caller may have turned it on) runs,
        # but serialized again it fails to run (jax 0.10.2: "Function ... not found").
        if key is not None and not hits.count and self.store.save(key, compiled) and not (keep or self._hold_all):
            return None, False
        return compiled, False

    def start(self, progress: bool = True, hold: bool = False) -> bool:
        """Start compiling (or loading) the buckets' steps on the pool and return: `pick` then
        prefers ready buckets, `get` waits for (or compiles) the one asked for, `wait` waits
        for all. Where every step is in the store, only the smallest of each kind is loaded (the
        rest when first needed); `hold`: the steps compiled stay loaded (the caller waits for
        them all). Returns whether every step is in the store (loading takes 0.15-0.3 s a
        bucket, so a warm start need not wait)."""
        from tqdm.auto import tqdm

        self._hold_all |= hold

        todo = {
            b: self._abstract_args(b)
            for b in self.buckets
            if b not in self.ready and b not in self.pending and b not in self.stored
        }
        if not todo:
            return False
        keys = {b: self.store.key(*job) if self.store is not None else None for b, job in todo.items()}
        stored = self.store is not None and all(self.store.has(key) for key in keys.values())
        if stored:
            for bucket in [b for b in todo if not self.first_of_kind(b)]:
                self.stored[bucket] = keys.pop(bucket)
                del todo[bucket]
        bar = tqdm(total=len(todo), desc="compiling buckets", disable=None if progress else True, unit="bucket")

        left = [len(todo)]  # (a disabled bar does not count)

        def one_done(_):
            bar.update()
            left[0] -= 1
            if not left[0]:
                bar.close()
                release_freed_memory()  # compiling's garbage, in the pool threads' heap arenas

        # Compiling takes every core; loading takes one, leaving the rest to what a warm start
        # also waits for (the KV pages' first touch, the tokenizer's import): engine construction
        # took ~0.8 s less with one loader than with two on a 2-vCPU Zen 3 (4 interleaved pairs).
        workers = 1 if stored else len(os.sched_getaffinity(0))
        self._pool = self._pool or ThreadPoolExecutor(workers, thread_name_prefix="jaxllm-compile")
        for bucket in sorted(todo, key=self._first_needed):
            with self._lock:  # (in `pending` before the job can look for it there)
                future = self._pool.submit(self._compile_in_background, bucket, *todo[bucket], keys[bucket])
                self.pending[bucket] = future
            future.add_done_callback(one_done)
        return stored

    def _compile_in_background(self, bucket: Bucket, layout, args, key: str | None):
        """`compile` on the pool: a step compiled and saved that is not the smallest of its kind
        goes to `stored` (unless `get` already waits for it)."""
        step, loaded = self.compile(layout, args, key, keep=self.first_of_kind(bucket))
        if step is None:
            with self._lock:
                if self.pending.pop(bucket, None) is not None:
                    self.stored[bucket] = key
        return step, loaded

    def first_of_kind(self, bucket: Bucket) -> bool:
        """Whether `bucket` is the smallest of its kind (prompt chunks or decodes, logits for
        every token or not): a request's first shapes, loaded at start-up."""
        kind = (bucket.num_prefill_rows > 0, bucket.all_logits)
        smallest = min(
            (b for b in self.buckets if (b.num_prefill_rows > 0, b.all_logits) == kind), key=lambda b: b.num_tokens
        )
        return bucket == smallest

    def _first_needed(self, bucket: Bucket) -> tuple:
        """Compile order: the smallest bucket of each kind first (a request's first step is a
        prompt chunk, its next ones decodes), then the rest from the smallest."""
        return not self.first_of_kind(bucket), bucket.num_tokens

    def pick(self, demand) -> Bucket:
        """The smallest bucket that holds `demand` (tokens, decodes, prefill rows, sequences) and
        is ready, else the smallest that holds it (`get` then waits for it, or compiles it). The
        smallest, if it is in the store only, starts loading in the background."""
        buckets = self._serving[len(demand) > 4 and bool(demand[4])]
        fits = [b for b in buckets if b.fits(*demand)] or [pick_bucket(buckets, *demand)]  # (raises)
        with self._lock:
            key = self.stored.pop(fits[0], None)
        if key is not None:
            self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="jaxllm-compile")
            self.pending[fits[0]] = self._pool.submit(self.compile, *self._abstract_args(fits[0]), key)
        return next((b for b in fits if b in self.ready or (b in self.pending and self.pending[b].done())), fits[0])

    def get(self, bucket: Bucket, cancel: bool = True) -> jax.stages.Compiled:
        """The bucket's step: ready, or its background compilation's result (waiting if it is
        under way), or (`cancel`: if that has not started; or in the store only) loaded or
        compiled here and now."""
        step = self.ready.get(bucket)
        if step is not None:
            return step
        with self._lock:
            key, future = self.stored.pop(bucket, None), self.pending.pop(bucket, None)
        step = None
        if future is not None and not (cancel and future.cancel()):
            step, loaded = future.result()
        if step is None:  # (one compiled in the background was saved and dropped meanwhile)
            step, loaded = self.compile(*self._abstract_args(bucket), key)
        self.ready[bucket] = step
        self.loaded += loaded
        if not self.pending and self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        return step

    def stop(self) -> None:
        """Cancel the compilations that have not started: a shutdown waits for at most the ones
        under way (the pool's threads are joined at exit). A bucket asked for later compiles then."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def wait(self) -> None:
        """Return once every started bucket is ready (those in the store loaded too)."""
        self._hold_all = True
        for bucket in [*self.pending, *self.stored]:
            self.get(bucket, cancel=False)
