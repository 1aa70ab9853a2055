"""The engines throughput.py compares, each behind one `Engine` interface (load, generate,
extra, close), and the peers' model files made from the bundled GGUF (a dequantized GGUF for
llama.cpp, an HF directory for transformers and vLLM). Each engine runs alone in a subprocess:
throughput.py starts `python benchmarks/engines.py SPEC.json`, and `worker` loads, generates,
verifies the token counts and writes the result JSON that SPEC names.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np

# workload.py sits beside this file. benchmarks/ is put on sys.path only for this import: as the
# worker, kernels.py there would shadow HF's `kernels` package (transformers imports it when it
# probes for it), and vLLM's engine process (multiprocessing's spawn, which re-runs this file as
# `__mp_main__` with the worker's sys.path) finds workload.py only this way.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workload import versions  # noqa: E402

del sys.path[0]
if __name__ == "__main__":  # Python put the script's folder first as well
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]


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
            writer.add_tensor(
                t.name,
                gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16),
                raw_dtype=gguf.GGMLQuantizationType.BF16,
            )
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


def offline_generate(llm, sampling_params_cls, workload: list[dict]) -> list[int]:
    """Every request greedy with `ignore_eos` through vLLM's offline `LLM.generate` (which jaxllm's
    mirrors), given that engine's `SamplingParams`; each request's number of generated tokens."""
    prompts = [{"prompt_token_ids": w["prompt_token_ids"]} for w in workload]
    params = [sampling_params_cls(temperature=0, ignore_eos=True, max_tokens=w["max_tokens"]) for w in workload]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [len(o.outputs[0].token_ids) for o in outputs]


class JaxllmEngine(Engine):
    def load(self, workload):
        from jaxllm import LLM

        self.llm = LLM(
            self.opts["model"],
            dtype=self.dtype,
            max_num_seqs=self.opts["max_num_seqs"],
            max_num_batched_tokens=self.opts["max_num_batched_tokens"],
            **self.opts.get("engine_args", {}),
        )
        self.llm.engine.wait_compiled()  # (compiled or loaded in the background: count it as start-up)

    def generate(self, workload):
        from jaxllm import SamplingParams

        return offline_generate(self.llm, SamplingParams, workload)

    def extra(self):
        engine = self.llm.engine
        s = engine.stats
        return {
            "warmup_s": engine.warmup_seconds,
            "max_num_seqs": self.opts["max_num_seqs"],
            "max_num_batched_tokens": self.opts["max_num_batched_tokens"],
            "profile": {
                "num_steps": s.num_steps,
                "num_preemptions": s.num_preemptions,
                "schedule_s": s.time_schedule,
                "prepare_s": s.time_prepare,
                "device_s": s.time_device,
                "update_s": s.time_update,
                "prompt_tokens": s.prompt_tokens,
                "generation_tokens": s.generation_tokens,
            },
        }


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
            batch = workload[start : start + size]
            width = max(len(w["prompt_token_ids"]) for w in batch)
            new = max(w["max_tokens"] for w in batch)
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, w in enumerate(batch):  # left padding: every row's last prompt token is at the end
                p = w["prompt_token_ids"]
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=self.pad,
                )
            made = out.shape[1] - width
            self.generated += made * len(batch)
            counts += [min(made, w["max_tokens"]) for w in batch]
        return counts

    def extra(self):
        return {
            "batch_size": self.opts["hf_batch_size"],
            "threads": self.torch.get_num_threads(),
            "tokens_generated_incl_padding": self.generated,
        }


class HFContinuousEngine(Engine):
    def load(self, workload):
        from transformers import GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        self.torch, torch_dtype = _torch_setup(self.opts)
        self.model = hf_from_pretrained(self.opts["model"], torch_dtype).eval()
        max_new = max(w["max_tokens"] for w in workload)
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new, eos_token_id=-1, pad_token_id=self.model.config.pad_token_id or 0
        )
        hints = WorkloadHints(
            max_prompt_length=max(len(w["prompt_token_ids"]) for w in workload),
            max_generated_length=max_new,
            num_requests=len(workload),
        )
        self.manager = self.model.init_continuous_batching(generation_config=config, workload_hints=hints)
        self.manager.warmup()
        self.manager.start()

    def generate(self, workload):
        ids = [f"r{i}" for i in range(len(workload))]
        with self.torch.inference_mode():
            for rid, w in zip(ids, workload):
                self.manager.add_request(
                    w["prompt_token_ids"], request_id=rid, max_new_tokens=w["max_tokens"], eos_token_id=-1
                )
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
        fed = [0] * len(workload)  # prompt tokens already in the cache
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
            entries = []  # (token, position, sequence, wants logits)
            for s in active:  # decodes first: one token each
                if fed[s] == len(prompts[s]) and len(entries) < self.n_batch:
                    entries.append((outputs[s][-1], len(prompts[s]) + len(outputs[s]) - 1, s, True))
            for s in active:  # then prompt chunks in the remaining budget
                while fed[s] < len(prompts[s]) and len(entries) < self.n_batch:
                    fed[s] += 1
                    entries.append((prompts[s][fed[s] - 1], fed[s] - 1, s, fed[s] == len(prompts[s])))
            n = len(entries)
            for i, (token, pos, s, logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
                batch.seq_id[i][0] = seq_id[s]
            rows = [s for _, _, s, logits in entries if logits]  # logits come back in batch order
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
        return {
            "threads": self.opts["threads"],
            "n_batch": self.n_batch,
            "n_ctx": self.n_ctx,
            "parallel": self.n_seq_max,
            "kv_cache_dtype": self.dtype,
            "gguf": os.path.basename(self.opts["model"]),
        }


class VllmEngine(Engine):
    def load(self, workload):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import LLM

        self.llm = LLM(model=self.opts["model"], dtype=self.dtype, seed=0)

    def generate(self, workload):
        from vllm import SamplingParams

        return offline_generate(self.llm, SamplingParams, workload)

    def extra(self):
        return {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}

    def close(self):
        self.llm.llm_engine.engine_core.shutdown()  # its busy-polling engine-core process


ENGINES = {
    "jaxllm": JaxllmEngine,
    "hf-static": HFStaticEngine,
    "hf-cb": HFContinuousEngine,
    "llama.cpp": LlamaCppEngine,
    "vllm": VllmEngine,
}


def worker(spec_path: str) -> None:
    """Subprocess entry: load, generate, verify; write the result JSON to job['result']."""
    with open(spec_path) as f:
        job = json.load(f)
    with open(job["workload"]) as f:
        workload = json.load(f)
    engine = ENGINES[job["engine"]](job)
    t0 = time.perf_counter()
    engine.load(workload)
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    counts = engine.generate(workload)
    wall = time.perf_counter() - t0
    wanted = [w["max_tokens"] for w in workload]
    wrong = [(i, c, m) for i, (c, m) in enumerate(zip(counts, wanted)) if c != m]
    result = {
        "startup_s": startup,
        "wall_s": wall,
        "output_tokens": sum(counts),
        "verified": not wrong,
        "wrong_counts": wrong[:10],
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "versions": versions(),
        "extra": engine.extra(),
    }
    with open(job["result"], "w") as f:
        json.dump(result, f)
    try:
        engine.close()
    except Exception as e:  # the parent still kills the worker's process group
        print(f"closing {job['engine']} failed: {e!r}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip slow or hanging interpreter teardown (engine threads, thread pools)


if __name__ == "__main__":
    worker(sys.argv[1])
