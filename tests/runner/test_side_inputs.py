"""The step's side inputs of -1s ("no penalties", "every token allowed"): one host buffer's
memory for every bucket, never written, and penalties beside them against transformers."""

import numpy as np
import torch

from jaxllm import SamplingParams
from jaxllm.structured_output import mask_words


def test_every_bucket_reads_its_minus_ones_from_one_host_buffer(llm):
    builder = llm.engine.runner.builder
    for bucket in llm.engine.runner.buckets:  # (as warm-up makes each bucket's buffers)
        builder.bucket_buffers(bucket)
    L = llm.engine.config.scheduler.max_model_len
    words = mask_words(llm.engine.cfg.vocab_size)
    start = builder._minus_ones_host.ctypes.data
    assert len(builder._no_penalty_tokens) > 1
    for R, tokens in builder._no_penalty_tokens.items():
        allowed = builder._all_allowed[R]
        assert tokens.shape == (R, L) and allowed.shape == (R, words)
        # One CPU device: both alias the buffer's start (XLA:CPU takes aligned host arrays as they are).
        assert tokens.unsafe_buffer_pointer() == start == allowed.unsafe_buffer_pointer()
    assert builder._minus_ones_host.nbytes < sum(a.nbytes for a in builder._no_penalty_tokens.values())


def test_penalised_rows_beside_unpenalised_ones_match_transformers(llm, hf_model):
    """A batch mixing rows with a repetition penalty (their own [R, L] tokens) and rows without
    (the shared -1s): each as transformers' greedy search computes it, and the shared buffer
    still all -1s afterwards."""
    prompts = ["The the the the the", "Once upon a time", "1, 2, 1, 2, 1, 2,", "Hello, my name is"]
    ids = [llm.get_tokenizer()(p)["input_ids"] for p in prompts]
    penalty = [1.8, 1.0, 1.8, 1.0]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=r) for r in penalty]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    for prompt_ids, r, out in zip(ids, penalty, outs):
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=10,
                min_new_tokens=10,
                do_sample=False,
                repetition_penalty=r,
                pad_token_id=0,
            )[0, len(prompt_ids) :].tolist()
        assert out.outputs[0].token_ids == expected
    assert np.all(llm.engine.runner.builder._minus_ones_host == -1)
