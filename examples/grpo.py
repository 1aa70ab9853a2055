"""GRPO with the engine and the trainer in one process: jaxllm samples, optax updates the very
parameter tree the engine serves, the engine takes it back without a reload.

    python examples/grpo.py                        # the tiny random Llama of the tests
    python examples/grpo.py --model path/to/model  # any float model (quantization="none")
    python examples/grpo.py --mesh 2x2             # 4 virtual CPU devices: trainer FSDP, engine TP x DP
    python examples/grpo.py --plot reward.png

The task ("answer with a given word"): a prompt, and a target token, the first answer the
untrained model gives with a probability closest to 0.1, so the reward (1 when the completion
starts with it) starts low but not at zero. Each iteration samples `--group` completions, scores them, takes
group-normalised advantages (GRPO's), and makes one clipped policy-gradient step on the
trainer's logprobs (`jaxllm.models.training`), which it first checks against the logprobs the
engine reported for the same tokens; then `update_weights` hands the new tree to the engine.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

PROMPT = "Answer with one word. What is the best fruit?"


def run(
    model: str | None = None,
    *,
    iterations: int = 30,
    group: int = 16,
    completion_tokens: int = 4,
    learning_rate: float = 3e-4,
    start_probability: float = 0.1,
    mesh: str | None = None,
    seed: int = 0,
    log=print,
    **engine_args,
) -> dict:
    """Train; returns {"rewards": mean reward per iteration, "target": the token, "max_logprob_diff":
    the largest |engine - trainer| logprob seen, "seconds": ...}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxllm import LLM, SamplingParams
    from jaxllm.models import training

    tp, dp = (1, 1) if mesh is None else map(int, mesh.split("x"))
    llm = LLM(
        model,
        dtype="float32",
        quantization="none",
        kv_cache_dtype="float32",
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        seed=seed,
        **engine_args,
    )
    engine, cfg = llm.engine, llm.engine.cfg
    prompt = engine.tokenize(PROMPT)
    params = engine.get_weights()
    if mesh is not None:  # the trainer's own layout: every matrix split over all devices by its rows
        fsdp = jax.make_mesh((len(jax.devices()),), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))

        def place(x):
            split = x.ndim == 2 and x.shape[0] % len(jax.devices()) == 0
            return jax.device_put(x, NamedSharding(fsdp, PartitionSpec("fsdp" if split else None)))

        params = jax.tree.map(place, params)
    first = np.asarray(jax.nn.softmax(training.forward(params, jnp.array(prompt), cfg)[-1]))
    likeliest = np.argsort(-first)[:20]
    target = int(likeliest[np.argmin(np.abs(first[likeliest] - start_probability))])
    log(f"target token {target} ({engine.tokenizer.decode([target])!r}), first-token probability {first[target]:.3f}")

    def policy_loss(params, tokens, old_logprobs, advantages):
        """GRPO's clipped objective over the completion tokens (one step per batch: ratio 1 at
        the start, its gradient the policy gradient)."""
        new = training.token_logprobs(params, tokens, cfg)[:, len(prompt) - 1 :]
        ratio = jnp.exp(new - old_logprobs)
        clipped = jnp.clip(ratio, 0.8, 1.2)
        return -jnp.mean(jnp.minimum(ratio * advantages[:, None], clipped * advantages[:, None]))

    optimizer = optax.adam(learning_rate)
    state = optimizer.init(params)

    @jax.jit
    def train_step(params, state, tokens, old_logprobs, advantages):
        loss, grads = jax.value_and_grad(policy_loss)(params, tokens, old_logprobs, advantages)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    trainer_logprobs = jax.jit(functools.partial(training.token_logprobs, cfg=cfg))
    rewards, worst, start = [], 0.0, time.perf_counter()
    for it in range(iterations):
        sampling = SamplingParams(
            n=group, temperature=1.0, max_tokens=completion_tokens, ignore_eos=True, logprobs=0, seed=seed + it
        )
        (out,) = llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)
        completions = [c.token_ids for c in out.outputs]
        reward = np.array([float(c[0] == target) for c in completions])
        rewards.append(float(reward.mean()))
        old = np.array([[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] for c in out.outputs], np.float32)
        tokens = jnp.array([prompt + c for c in completions])
        mine = np.asarray(trainer_logprobs(params, tokens))[:, len(prompt) - 1 :]
        worst = max(worst, float(np.abs(mine - old).max()))
        advantages = (reward - reward.mean()) / (reward.std() + 1e-4)
        params, state, loss = train_step(params, state, tokens, old, jnp.asarray(advantages, jnp.float32))
        engine.update_weights(params, version=it + 1)
        log(f"iteration {it:3d}: reward {rewards[-1]:.3f}  loss {float(loss):+.4f}  |engine - trainer| {worst:.1e}")
    return {
        "rewards": rewards,
        "target": target,
        "max_logprob_diff": worst,
        "seconds": time.perf_counter() - start,
        "weight_version": engine.weight_version,
    }


def plot(rewards: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(range(len(rewards)), rewards, marker="o", markersize=3)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward of the group")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the tests' tiny random Llama (built on first use)")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--learning-rate", type=float, default=3e-4)
    ap.add_argument("--mesh", default=None, help="TPxDP engine over TP*DP virtual CPU devices, e.g. 2x2")
    ap.add_argument("--plot", default=None, help="write the reward curve to this PNG")
    args = ap.parse_args()
    if args.mesh:
        tp, dp = map(int, args.mesh.split("x"))
        n = tp * dp
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    model = args.model
    if model is None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.helpers.tiny_model import build_tiny_model

        model = build_tiny_model(os.path.expanduser("~/.cache/jaxllm/examples/tiny-llama"))
    result = run(model, iterations=args.iterations, group=args.group, learning_rate=args.learning_rate, mesh=args.mesh)
    print(f"rewards {result['rewards'][0]:.2f} -> {result['rewards'][-1]:.2f} in {result['seconds']:.1f} s")
    if args.plot:
        where = f"engine TP x DP {args.mesh}, trainer FSDP" if args.mesh else "one device"
        plot(result["rewards"], args.plot, f"GRPO on jaxllm ({where}): group {args.group}, Adam {args.learning_rate}")


if __name__ == "__main__":
    main()
