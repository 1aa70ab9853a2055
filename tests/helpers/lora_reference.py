"""PEFT as the reference for LoRA: random adapters on the tiny HF models (`build_adapter`), saved
in PEFT's format, and the merged model they make (what the engine's outputs must equal)."""

from __future__ import annotations

import copy

import torch


def build_adapter(base, path, *, r: int, targets, alpha: float = 16, seed: int = 0, **config):
    """Save a LoRA adapter of rank `r` over `targets` (module names) of the HF model `base`, with
    random A and B (PEFT starts B at zero), to `path`; return the merged HF model it makes."""
    import peft

    torch.manual_seed(seed)
    lora = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **config)
    model = peft.get_peft_model(copy.deepcopy(base), lora)
    with torch.no_grad():  # adapters that change greedy outputs, but not beyond recognition
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p) / r**0.5)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def logprobs_of(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """The log-probability the model gives each of `tokens` after `prompt` and the tokens before it."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]
