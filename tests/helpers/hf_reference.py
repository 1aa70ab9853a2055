"""HF transformers as the reference: the tiny random models of every family (`MODELS`,
`build_hf_model`), HF's beam search, transformers reading a GGUF (`from_gguf`), and how close a
GGUF's logits come to transformers' own."""

from __future__ import annotations

import os

import torch
import transformers


COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


# Families whose configs take other names than Llama's get their own keys (a config saves
# every attribute it is given, so COMMON's names would land in their config.json).
SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
}


MODELS = {
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_theta=500.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),  # head_dim != hidden / heads
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            sliding_window=6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=GEMMA3_ROPE,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[1]),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(SMALL, ffn_dim=128, word_embed_proj_dim=64, pad_token_id=1, init_std=0.1),
    ),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(SMALL, intermediate_size=128)),  # rotary on 1/4
    "gpt_neox_sequential": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            SMALL,
            intermediate_size=128,
            use_parallel_residual=False,
            attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
        ),
    ),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(SMALL, ffn_hidden_size=128)),  # multi-query, parallel
    "falcon_new": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(SMALL, ffn_hidden_size=128, new_decoder_architecture=True, num_kv_heads=2, bias=True),
    ),
    "falcon_sequential": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(SMALL, ffn_hidden_size=128, parallel_attn=False, multi_query=False),
    ),
}


def build_hf_model(kind: str, path, **overrides) -> "torch.nn.Module":
    """The tiny random HF model `kind` of MODELS (with config `overrides`), saved at `path`."""
    config_cls, model_cls, extra = MODELS[kind]
    keys = {**(extra if "vocab_size" in extra else {**COMMON, **extra}), **overrides}
    config = getattr(transformers, config_cls)(**keys, architectures=[model_cls])
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norms and biases away from their trivial init (ones, zeros)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def hf_beam_search(model, prompt_ids, *, width, max_tokens, eos, early_stopping, length_penalty):
    """[(generated token ids, sequences_score)] best first, as HF returns them."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=eos,
            pad_token_id=eos,
            early_stopping=early_stopping,
            length_penalty=length_penalty,
            output_scores=True,
            return_dict_in_generate=True,
        )
    beams = []
    for seq, score, beam_indices in zip(out.sequences, out.sequences_scores, out.beam_indices):
        num_generated = int((beam_indices >= 0).sum())
        beams.append((seq[len(prompt_ids) : len(prompt_ids) + num_generated].tolist(), float(score)))
    return beams


# Max |logit diff| against transformers on the same dequantized weights: measured 1.6e-4
# (logits up to ~30); both sides compute in float32 with different summation orders.
GGUF_LOGITS_TOL = 1e-3


# The last GGUF file `from_gguf` parsed: (path, size, mtime) -> its gguf.GGUFReader.
_READER: dict = {}


def from_gguf(auto_class, path: str):
    """`auto_class.from_pretrained` on the GGUF file `path`: a transformers Auto class (a model's:
    dequantized to float32, in eval mode; or AutoTokenizer). transformers parses the file's
    metadata with `gguf.GGUFReader` for the config, the tokenizer and the weights, each time
    anew: 2-18 s a parse for vocabularies of 49k-262k tokens, most of a GGUF test's time. Here
    the parse of the last file read is kept (read-only: a memory map and its fields) and given to
    transformers again, so a file read by several tests in a row is parsed once."""
    import gguf

    real = gguf.GGUFReader
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)

    def parsed_once(file, mode="r"):
        if os.path.realpath(file) != key[0] or mode != "r":
            return real(file, mode)
        if key not in _READER:
            _READER.clear()
            _READER[key] = real(file, mode)
        return _READER[key]

    folder, name = os.path.split(path)
    gguf.GGUFReader = parsed_once
    try:
        if auto_class is transformers.AutoTokenizer:
            return auto_class.from_pretrained(folder, gguf_file=name)
        return auto_class.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    finally:
        gguf.GGUFReader = real
