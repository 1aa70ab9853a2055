"""Draft-model proposer: a smaller model with the target's vocabulary proposes drafts by
greedy decoding.

It runs its own `ModelRunner` (its own compiled steps and KV pool) on the target's page ids:
its pool has as many pages as the target's, and a request's draft KV lives in the same page
ids as its target KV, so the scheduler's page tables, allocation and freeing serve both.
Per request it keeps a shadow `Request` (greedy sampling params, the real request's tokens and
pages) with its own `num_computed_tokens`: after a step, the draft KV stays valid up to where
the shadow's tokens (the real ones plus its drafts) agree with the request's, so each round
first catches up on the tokens it has not seen (a whole prompt the first time, in chunks of
the token budget; then the target's newest token), then decodes up to k tokens.

The draft's codes factor their scales where the kernel can, or multiply int8 rows where the
draft's plan does (its numbers decide only which drafts are accepted): 4-bit codes quantized on
load too (in groups of 64 rows: `DRAFT_INT4_GROUP`), and 8-bit codes that span the whole byte
(Q8_0's: the 0.5B Qwen's LM head, and its fused QKV where V is Q8_0) rounded to 6 bits first
(`factored_draft`).

With `draft_vocab_size` the draft proposes only the first token ids (`first_ids_only`): its LM
head, a large part of a small model's bytes a step (the 0.5B Qwen's 137 of ~400 MB), cut to
those columns, as EAGLE-3's drafts keep a reduced vocabulary. A BPE vocabulary's ids follow its
merges, the most frequent first, so the first ids take most of the tokens of a text; a token past
them is never drafted, which only lowers the acceptance rate.

Drafts proposed greedily are a point mass for the verifier, so the target's rejection
sampling keeps its distribution exactly (runner/sampler.py). A draft that is wrong (stale KV
in a page the target copied on write, say) only lowers the acceptance rate.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxllm.core.outputs import SchedulerOutput
from jaxllm.core.request import Request
from jaxllm.models import linear
from jaxllm.quantization import QuantizedWeight
from jaxllm.quantization.activations import with_factored, with_int8_activations
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.proposer import Proposer
from jaxllm.utils import cdiv
from jaxllm.weights.plan import QUANTIZE_METHODS
from jaxllm.weights.prepare import PreparedModel, load_with_plan, prepare_weights

# Rows a group of a draft's int4 codes quantized on load (`"quantization": "int4"` in the config;
# the layers' matrices, 32 for a model's own): 4.5 bits a weight, where 32 rows take 5. The
# 0.5B Qwen drafting for the 1.5B on a Zen 4 (float32 + int8): its step reads 8% fewer bytes,
# one stream 1.05-1.07x as fast, acceptance unchanged (83% on code, 75-78% on chat); 128 rows
# lost some acceptance on chat (benchmarks/results/zen4/RESULTS.md).
DRAFT_INT4_GROUP = 64


def load_draft(
    speculative, args, target_cfg, max_model_len: int, platform, *, progress: bool, int8_activations: bool
) -> PreparedModel | None:
    """The draft model of draft-model speculative decoding (`speculative`: the engine's
    SpeculativeConfig; None or n-gram: no draft), checked against the target (`target_cfg`,
    `max_model_len`), its weights prepared by a plan of its own from the options asked
    (`args`): the target's, but a checkpoint method or small-step codes asked for the target are
    the draft's only where its checkpoint allows, int8 activations left to the plan (dtype
    auto's float32) follow the target's (`int8_activations`: its plan's outcome), also over codes
    quantized on load (`int4` in groups of DRAFT_INT4_GROUP rows), and the draft's codes factor
    their scales or multiply int8 rows unless small_step_factored is False or batch_invariant
    asked (its numbers decide only which drafts are accepted, never the output), Q8_0's codes
    too, rounded to 6 bits; `draft_vocab_size` cuts its LM head (`factored_draft`,
    `first_ids_only`)."""
    if speculative is None or speculative.method != "draft_model":
        return None
    asked = args.quantization if args.quantization in (*QUANTIZE_METHODS, "none") else None
    if speculative.quantization is not None:  # (asked for the draft itself)
        asked = speculative.quantization
    draft_args = dataclasses.replace(
        args,
        model=speculative.model,
        quantization=asked,
        small_step_codes=None if args.small_step_codes else args.small_step_codes,
        small_step_factored=None if args.small_step_factored else args.small_step_factored,
        speculative_config=None,
        int8_activations=int8_activations if args.int8_activations is None else args.int8_activations,
    )
    draft, plan = load_with_plan(draft_args, platform, None, one_device=True, progress=progress)
    plan = dataclasses.replace(plan, int4_group=DRAFT_INT4_GROUP)
    if draft.cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"the draft model {speculative.model!r} has a vocabulary of {draft.cfg.vocab_size} "
            f"tokens, the target {target_cfg.vocab_size}: they must share one"
        )
    if draft.cfg.max_position_embeddings < max_model_len:
        raise ValueError(
            f"the draft model's context ({draft.cfg.max_position_embeddings}) is shorter than "
            f"max_model_len ({max_model_len})"
        )
    tokenizer = draft.resolve_tokenizer() if plan.smooth else None
    weights = prepare_weights(draft.params, draft.cfg, plan, tokenizer=tokenizer, log=False)
    prepared = PreparedModel(draft.cfg, *weights)
    if draft_args.small_step_factored is not False and not draft_args.batch_invariant:
        prepared = factored_draft(prepared, int8=plan.int8_activations and plan.dtype == "float32")
    if speculative.draft_vocab_size is not None:
        prepared = first_ids_only(prepared, speculative.draft_vocab_size)
    return prepared


def factored_draft(model, int8: bool = False):
    """The draft `model` (a `weights.prepare.PreparedModel`) with each of its codes factoring
    its group scales out of its GEMM's sums where the kernel can (`with_factored`): its
    numbers decide only which drafts are accepted. Its plan factors a GGUF's codes already;
    here also codes quantized on load (`"quantization": "int4"` in the config: 4-bit codes that
    stream through the factored kernel where the unfactored one is bound by its conversions),
    and 8-bit codes x bf16 rows past [-64, 63] (Q8_0's, `int8_weight_only`'s) rounded to codes
    in [-32, 31] and four times the scale first (6-bit blocks where the build has them: three
    quarters of the bytes). With `int8` (the draft's plan multiplies int8 rows, under float32)
    its float-row codes multiply int8 rows instead where the kernel can
    (`with_int8_activations`, 8-bit ones past [-32, 31] rounded into it first), else factor. A
    weight both trees hold is converted once."""
    done: dict[int, QuantizedWeight] = {}

    def factored(w):
        if not isinstance(w, QuantizedWeight) or w.layout != "panels" or w.factored:
            return w
        key = id(w)
        if key not in done:
            to_int8 = int8 and w.activations == "float"
            if (w.activations == "bf16" or to_int8) and w.bits == 8 and w.super_scale is None:
                codes = np.asarray(w.codes, np.float32)
                wide = codes.min() < -64 or codes.max() > 63
                if wide or (to_int8 and (codes.min() < -32 or codes.max() > 31)):
                    div = 4 if wide else 2
                    codes = np.clip(np.rint(codes / div), -32, 31).astype(np.int8)
                    codes, scale = jax.device_put((codes, np.asarray(w.scale) * div))
                    w = dataclasses.replace(w, codes=codes, scale=scale)
            q = with_int8_activations(w, six_bit=True) if to_int8 else w
            done[key] = q if q is not w else with_factored(w) if w.activations in ("bf16", "float") else w
        return done[key]

    def tree(params):
        if params is None:
            return None
        return jax.tree.map(factored, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))

    return model._replace(params=tree(model.params), small_params=tree(model.small_params))


def first_ids_only(model, n: int):
    """The draft `model` (a `weights.prepare.PreparedModel`) proposing among the first `n` token
    ids only, `n` rounded up to whole panels of 16: its LM head cut to those columns in each
    params tree (a tied table's head becomes its own), its vocabulary `n`. The embedding table
    stays whole: the target's tokens, which the draft reads, may be any."""
    cfg = model.cfg
    n = cdiv(n, 16) * 16
    if n >= cfg.vocab_size:
        return model
    key = "embed" if cfg.tie_word_embeddings else "lm_head"

    def cut(tree):
        if tree is None:
            return None
        head = tree[key]
        if key == "embed" and not hasattr(head, "apply"):  # a float table [vocab, hidden]
            return {**tree, "lm_head": head[:n].T}
        return {**tree, "lm_head": linear.first_columns(head, n)}

    cfg = dataclasses.replace(cfg, vocab_size=n, tie_word_embeddings=False)
    return model._replace(cfg=cfg, params=cut(model.params), small_params=cut(model.small_params))


@dataclasses.dataclass(eq=False)
class _Shadow:
    request: Request  # the draft model's view: greedy, its own computed count
    source: Request  # the real request
    num_preemptions: int


class DraftModelProposer(Proposer):
    def __init__(self, config, runner, num_speculative_tokens: int, confidence_threshold: float = 0.0):
        """`runner`: the draft model's own `ModelRunner` (its compiled steps and KV pool);
        `confidence_threshold`: SpeculativeConfig.draft_confidence_threshold."""
        self.num_speculative_tokens = num_speculative_tokens
        self.min_logprob = float(np.log(confidence_threshold)) if confidence_threshold > 0 else -np.inf
        self.runner = runner
        self.budget = config.scheduler.max_num_batched_tokens
        self.max_chunks = config.scheduler.max_num_prefill_seqs
        self.max_model_len = config.scheduler.max_model_len
        self.shadows: dict[str, _Shadow] = {}

    def warmup(self, progress: bool, background: bool) -> float:
        return self.runner.warmup(progress, background)

    def _shadow(self, request: Request) -> Request:
        """The request's shadow, its computed count cut back to what still matches."""
        entry = self.shadows.get(request.request_id)
        fresh = entry is None or entry.source is not request or entry.num_preemptions != request.num_preemptions
        if fresh:  # new, or preempted since (its pages changed): compute it all
            shadow = Request(
                request.request_id,
                request.prompt_token_ids,
                SamplingParams(temperature=0.0, max_tokens=self.max_model_len),
            )
            entry = self.shadows[request.request_id] = _Shadow(shadow, request, request.num_preemptions)
        shadow = entry.request
        # Draft KV is valid where the shadow's tokens (the real ones and its drafts) agree with the
        # request's now; the newest token always remains to compute.
        have = np.asarray(shadow.output_token_ids[: len(request.output_token_ids)])
        agree = np.flatnonzero(have != np.asarray(request.output_token_ids[: len(have)]))
        same = request.num_prompt_tokens + (int(agree[0]) if len(agree) else len(have))
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, same, request.num_tokens - 1)
        shadow.output_token_ids = list(request.output_token_ids)
        shadow.page_ids = request.page_ids
        return shadow

    def propose_batch(self, requests: list[Request], rooms: list[int]) -> None:
        finished = [i for i, entry in self.shadows.items() if entry.source.status.finished]
        for request_id in finished:
            del self.shadows[request_id]
        self.runner.input_batch.remove(finished)
        shadows = [self._shadow(r) for r in requests]
        for shadow in shadows:  # its row's tokens past what still matches are rewritten
            self.runner.input_batch.truncate(shadow.request_id, shadow.num_computed_tokens)
        drafts: list[list[int]] = [[] for _ in requests]
        wanted = [min(room, self.num_speculative_tokens) for room in rooms]
        # Catch up (each shadow's tokens but the newest may be several prompt chunks), then
        # decode: each step gives every shadow whose query reached its end one more draft. A
        # decode whose input is the draft in flight is dispatched before that step's tokens are
        # read (the device takes them from its output, `ModelRunner.dispatch`'s `ahead`), so the
        # host prepares each step while the one before it runs.
        in_flight = None  # ([(shadow index, tokens)], InFlight): dispatched, not yet collected
        while True:
            ahead = None if in_flight is None else self._ahead(in_flight[0], shadows, drafts, wanted)
            if ahead:
                scheduled, step = in_flight
                rows = np.array([step.first[j] for j in ahead], np.int64)
                next_step = [(scheduled[j][0], 1) for j in ahead]
                chained = self.runner.dispatch(SchedulerOutput([(shadows[i], n) for i, n in next_step]), rows, step)
                self._collect(in_flight, shadows, drafts, wanted)
                in_flight = next_step, chained
                continue
            if in_flight is not None:
                self._collect(in_flight, shadows, drafts, wanted)
            scheduled = self._schedule(shadows, drafts, wanted)
            if not scheduled:
                break
            in_flight = scheduled, self.runner.dispatch(SchedulerOutput([(shadows[i], n) for i, n in scheduled]))
        for request, tokens in zip(requests, drafts):
            request.spec_token_ids = tokens

    def _schedule(self, shadows: list[Request], drafts: list[list[int]], wanted: list[int]) -> list[tuple[int, int]]:
        """The next step's (shadow index, tokens): every shadow with tokens to compute and drafts
        to make, within the token budget and the prompt chunks a step takes."""
        budget, chunks, scheduled = self.budget, 0, []
        for i, shadow in enumerate(shadows):
            todo = shadow.num_tokens - shadow.num_computed_tokens
            if len(drafts[i]) >= wanted[i] or budget == 0 or todo == 0:
                continue
            if todo > 1:
                if chunks == self.max_chunks:
                    continue
                chunks += 1
            n = min(todo, budget)
            scheduled.append((i, n))
            budget -= n
        return scheduled

    @staticmethod
    def _ahead(scheduled, shadows, drafts, wanted) -> list[int] | None:
        """Positions in the step in flight (`scheduled`) of the shadows whose next step decodes
        the draft it samples, or None where the next step is not only those: a shadow of it
        that stops short of its query's end (a prompt chunk), or one outside it with work left."""
        inside = {i for i, _ in scheduled}
        for i, shadow in enumerate(shadows):
            if i not in inside and len(drafts[i]) < wanted[i] and shadow.num_tokens > shadow.num_computed_tokens:
                return None
        if any(shadows[i].num_computed_tokens + n < shadows[i].num_tokens for i, n in scheduled):
            return None
        return [j for j, (i, _) in enumerate(scheduled) if len(drafts[i]) + 1 < wanted[i]] or None

    def _collect(self, in_flight, shadows: list[Request], drafts: list[list[int]], wanted: list[int]) -> None:
        """Read the step's drafts into `drafts` and its shadows; a shadow whose draft falls below
        the confidence threshold wants no more (a step dispatched ahead for it still adds one)."""
        scheduled, step = in_flight
        out = self.runner.collect(step)
        offset = 0
        for (i, n), count in zip(scheduled, out.num_sampled):
            shadows[i].num_computed_tokens += n
            if count:
                token = int(out.sampled_token_ids[offset])
                drafts[i].append(token)
                shadows[i].output_token_ids.append(token)
                if out.logprobs[offset] < self.min_logprob:
                    wanted[i] = min(wanted[i], len(drafts[i]))
            offset += count
