"""A client that stops reading its stream: the server buffers at most --max-stream-backlog
outputs for it and then stops its request (the engine frees its pages), while the requests of
the other clients run on and answer exactly as before."""

from __future__ import annotations

import asyncio

from jaxllm import SamplingParams
from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.openai.serving_engine import ClientTooSlow, MergedOutputs

PROMPT = "Once upon a time"


def test_a_stalled_stream_is_stopped_at_its_backlog_and_the_others_run_on(llm):
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    engine = AsyncLLM(engine=llm.engine)

    async def run():
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        stalled = MergedOutputs([engine.generate(PROMPT, long, "stalled", output_kind="delta")], max_backlog=16)
        others = [
            MergedOutputs([engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), f"o{i}")])
            for i in range(3)
        ]
        texts = []
        for merged in others:  # (read to the end while the stalled one is never read)
            last = None
            async for _, out in merged:
                last = out
            texts.append(last.outputs[0].text)
        for _ in range(200):  # the stalled request ends in the engine once its backlog is full
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        backlog = stalled._queue.qsize()
        drained, error = [], None
        try:
            async for _, out in stalled:
                drained.append(out)
        except ClientTooSlow as e:
            error = e
        await stalled.close()
        return texts, backlog, drained, error

    try:
        texts, backlog, drained, error = asyncio.run(run())
    finally:
        engine.shutdown()
    assert texts == [want] * 3
    assert backlog <= 16 + 2 and isinstance(error, ClientTooSlow)  # (one output past the limit, the error)
    # What was buffered is the stalled request's first outputs, in order, then the error.
    assert len(drained) == backlog - 1 and all(not out.finished for out in drained)
    tokens = [t for out in drained for t in out.outputs[0].token_ids]
    assert 0 < len(tokens) < 400
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_cache_usage == 0
