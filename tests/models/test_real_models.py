"""The real Qwen2.5-Coder-0.5B-Instruct (`make models`; `make venv` fetches this one) against
transformers reading the same GGUF dequantized: every block type the file has (Q5_0, Q8_0,
Q4_K, Q6_K) kept quantized in jaxllm's float32 engine, the prompt's logprobs, greedy outputs
the chat template with tools, and the perplexity of the machine's default engine on the
shipped text."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.bench.perplexity import DEFAULT_TEXT, perplexity, text_windows
from jaxllm.models import catalog
from jaxllm.models.checkpoint import ModelNotFoundError
from jaxllm.quantization.weights import QuantizedWeight

from tests.helpers.hf_reference import GGUF_LOGITS_TOL, from_gguf

torch = pytest.importorskip("torch")

NAME = "qwen2.5-coder-0.5b"
PROMPTS = ["def quicksort(arr):", "# Read a CSV file and print the sum of its 'price' column\nimport"]


@pytest.fixture(scope="module")
def qwen_05b():
    try:
        return catalog.path_of(NAME)
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def reference(qwen_05b):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = from_gguf(AutoModelForCausalLM, qwen_05b)
    model.generation_config.eos_token_id = None
    return from_gguf(AutoTokenizer, qwen_05b), model


LONG = 1200  # the long prompt's tokens


@pytest.fixture(scope="module")
def kept(qwen_05b, tmp_path_factory):
    """The 0.5B in the float32 engine with every block type kept quantized; prompts go in chunks of 256."""
    return LLM(
        NAME,
        dtype="float32",
        quantization="gguf",
        max_model_len=LONG + 64,
        max_num_seqs=2,
        max_num_batched_tokens=256,
        kv_cache_memory=128 << 20,
        params_cache_dir=str(tmp_path_factory.mktemp("params")),
        warmup=False,
    )


@pytest.mark.slow
def test_qwen_05b_with_its_blocks_kept_matches_transformers(kept, reference):
    ref_tok, hf = reference
    llm = kept
    cfg = llm.engine.cfg
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "Qwen2ForCausalLM",
        24,
        896,
        14,
        2,
    )
    # Every matrix stays in its blocks' codes: Q5_0 / Q8_0 (and the Q5_0 + Q8_0 value halves of
    # a fused QKV) as 8-bit codes, the Q4_K down projections as 4-bit, the Q6_K ones as 8-bit.
    params = llm.engine.runner.params
    names = ("wqkv", "wo", "w_gate_up", "w_down")
    assert all(isinstance(layer[n], QuantizedWeight) for layer in params["layers"] for n in names)
    assert isinstance(params["lm_head"], QuantizedWeight)
    assert sorted({layer["w_down"].bits for layer in params["layers"]}) == [4, 8]
    tok = llm.get_tokenizer()
    text = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(12))
    ids = tok(text).input_ids
    assert ids == ref_tok(text).input_ids
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1], -1).numpy()
    out = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False
    )[0]
    entries = out.prompt_logprobs[1:]
    top = [next(t for t, lp in e.items() if lp.rank == 1) for e in entries]
    np.testing.assert_array_equal(top, want.argmax(-1))
    got = np.array([e[t].logprob for e, t in zip(entries, ids[1:])])
    diff = float(np.abs(got - want[np.arange(len(got)), ids[1:]]).max())
    print(f"Qwen2.5-Coder-0.5B GGUF vs transformers, {len(ids)} tokens: max |prompt logprob diff| {diff:.3g}")
    assert diff <= GGUF_LOGITS_TOL

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [tok(p).input_ids for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p) :].tolist()
        assert list(o.outputs[0].token_ids) == expected


@pytest.mark.slow
def test_qwen_chat_template_with_tools_renders_as_transformers(kept, reference):
    ref_tok, _ = reference
    llm = kept
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    conversations = [
        [{"role": "user", "content": "Write hello world in C."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": '{"temperature": 21}'},
        ],
    ]
    for messages in conversations:
        for kw in ({}, {"tools": tools}):
            want = ref_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
            got = llm.engine.apply_chat_template(messages, **kw)
            assert got == ref_tok.encode(want, add_special_tokens=False), (messages, kw)


@pytest.mark.slow
def test_qwen_05b_perplexity_with_the_defaults_within_one_percent_of_transformers(qwen_05b, reference, tmp_path):
    """The engine as a user gets it on this CPU (its default dtype and weight plan) against the
    GGUF dequantized in float32, on the first quarter of the text `jaxllm bench perplexity` ships
    (`benchmarks/real_models.py --perplexity` measures the whole of it)."""
    _, hf = reference
    llm = LLM(NAME, max_model_len=1024, max_num_seqs=2, kv_cache_memory=64 << 20, params_cache_dir=str(tmp_path))
    with open(DEFAULT_TEXT, encoding="utf-8") as f:
        text = f.read()
    text = text[: len(text) // 4]
    got = perplexity(llm, text)
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in text_windows(llm.get_tokenizer(), text):
            logprobs = torch.log_softmax(hf(torch.tensor([w])).logits[0, :-1].double(), -1)
            nll -= float(logprobs[torch.arange(len(w) - 1), w[1:]].sum())
            count += len(w) - 1
    want = math.exp(nll / count)
    print(f"Qwen2.5-Coder-0.5B perplexity: jaxllm {got['perplexity']:.4f}, transformers {want:.4f}")
    assert got["tokens"] == count
    assert abs(got["perplexity"] / want - 1) <= 0.01


@pytest.mark.slow
def test_qwen_05b_long_prompt_in_chunks_matches_transformers(kept, reference):
    """A 1,200-token prompt (600 tokens of the shipped text twice: the continuation reads keys
    600 tokens back) prefilled in 5 chunks through the paged cache: the greedy continuation and
    its logprobs are transformers' on the whole prompt at once."""
    ref_tok, hf = reference
    llm = kept
    (text,) = text_windows(llm.get_tokenizer(), window=1 << 20)
    ids = text[: LONG // 2] * 2
    assert len(ids) == LONG
    out = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )[0].outputs[0]
    with torch.no_grad():
        gen = hf.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    expected = gen.sequences[0, len(ids) :].tolist()
    assert list(out.token_ids) == expected
    want = [float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(gen.scores, expected)]
    got = [entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids)]
    diff = float(np.abs(np.array(got) - np.array(want)).max())
    print(f"Qwen2.5-Coder-0.5B, a {LONG}-token prompt in chunks: max |logprob diff| {diff:.3g}")
    assert diff <= GGUF_LOGITS_TOL
