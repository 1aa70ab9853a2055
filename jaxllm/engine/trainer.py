"""What `LLMEngine` offers a trainer in the same process (docs/training.md): its weights out and
in (`get_weights`, `update_weights`, with requests in flight kept, awaited or aborted), and
memory back while the trainer runs (`sleep`, `wake_up`). A mixin: `LLMEngine` holds the state
(`_params`, `_updates`, `_form`, `weight_version`, `sleep_level`) and the replicas."""

from __future__ import annotations

import jax

from jaxllm import parallel
from jaxllm.outputs import RequestOutput
from jaxllm.weights.update import IN_FLIGHT, check_same_form, model_sharding, model_weights


class EngineSleepingError(RuntimeError):
    """A request reached an engine put to sleep (`LLMEngine.sleep`) before its `wake_up`."""


class TrainerMixin:
    def _check_awake(self) -> None:
        if self.sleep_level:
            raise EngineSleepingError(
                f"the engine is asleep (level {self.sleep_level}): call wake_up()"
                + (" after update_weights()" if self._params is None else "")
                + " before adding requests"
            )

    def get_weights(self) -> dict:
        """The model's parameter tree (decoder.py's layout: the tree `update_weights` takes and
        `jaxllm.models.training` differentiates), with the engine's shardings. Where the engine
        steps with a leaf as it is (float weights, not packed into C++ panels, not regrouped for
        tensor parallelism) the leaf is the engine's own array; otherwise a copy. An engine that
        stores integer codes raises (it has no float weights)."""
        if self._params is None:
            raise RuntimeError("the engine is asleep at level 2: it holds no weights")
        mesh = self._updates.mesh
        tree = model_weights(self._params, self.cfg, mesh)
        if mesh is None:
            return tree
        return jax.tree_util.tree_map_with_path(lambda path, x: jax.device_put(x, model_sharding(path, mesh)), tree)

    def update_weights(
        self, weights, *, version: int | str | None = None, in_flight: str = "keep"
    ) -> list[RequestOutput]:
        """Serve `weights` from the next step on: a model tree (`get_weights`' layout, e.g. a
        trainer's params) or a flat dict in HF checkpoint names (`"model.layers.0.mlp.up_proj.weight"`:
        `[out, in]` linears). Arrays already as the engine keeps them (dtype, shape, sharding) are
        taken without a copy; others are cast, fused, laid out for the mesh, quantized and packed
        by the loader's own code. Wrong names, shapes or dtypes raise `WeightUpdateError` naming
        the leaf, and the engine keeps its old weights. No step recompiles.

        in_flight: "keep" (requests in flight go on with the new weights from the next step),
        "wait" (run the engine's steps until every request has finished, then update), or
        "abort" (end them, finish reason "abort"). Returns the outputs those steps and aborts
        produced (with "keep", those of a step already in flight). The prefix cache is reset
        (its pages were computed with the old weights); each token's `weight_versions` entry
        says which weights computed it: `version`, by default the number of updates so far."""
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT}, not {in_flight!r}")
        tokenizer = self.tokenizer if self._updates.plan.smooth else None
        params, small_params = self._updates.engine_weights(weights, tokenizer=tokenizer)
        check_same_form((params, small_params), self._form)
        outputs = []
        if in_flight == "wait":
            while self.has_unfinished_requests():
                outputs += self.step()
        elif in_flight == "abort":
            outputs += self._abort_all()
        for replica in self.replicas:
            settled = replica.settle()
            if settled is not None:
                outputs += self._process(settled)
        self._params = params
        for replica, row in zip(self.replicas, parallel.replica_meshes(self._updates.mesh)):
            runner = replica.runner
            runner.params = params if row is None else parallel.replica_params(params, row)
            runner.small_params = small_params
            if runner.lora is not None:  # the adapters' slots beside the new weights
                runner.params, runner.small_params = runner.lora.adopt(runner.params, runner.small_params)
            replica.kv_cache_manager.reset_prefix_cache(held=True)
        self.num_weight_updates += 1
        self.weight_version = self.num_weight_updates if version is None else version
        for replica in self.replicas:
            replica.weight_version = self.weight_version
        return outputs

    def _abort_all(self) -> list[RequestOutput]:
        """End every request now: their last outputs, finish reason "abort"."""
        outputs = self.output_processor.abort_all()
        self._pending_choices.clear()
        self.engine_core.abort_requests([rid for replica in self.replicas for rid in list(replica.scheduler.requests)])
        for _ in outputs:
            self.stats.record_finished("abort")
        return outputs

    def sleep(self, level: int = 1) -> None:
        """Give memory back while a trainer runs: level 1 frees the KV pool (and the prefix cache
        with it); level 2 also drops the engine's weights (a trainer will send new ones with
        `update_weights` before `wake_up`; arrays the trainer shares stay the trainer's). The
        engine must have no requests (finish or abort them first). Nothing recompiles on wake-up."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level!r}")
        if self.has_unfinished_requests():
            raise RuntimeError(
                f"sleep: {self.get_num_unfinished_requests()} request(s) unfinished; finish or abort them first"
            )
        for replica in self.replicas:
            replica.settle()
            replica.kv_cache_manager.reset_prefix_cache()
            replica.runner.kv.free()
            if level == 2:
                replica.runner.params = replica.runner.small_params = None
        if level == 2:
            self._params = None
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        """Re-create the KV pool after `sleep` (same shapes: no step recompiles). After level 2
        the weights must have come back through `update_weights` first."""
        if self._params is None:
            raise RuntimeError("wake_up: the engine slept at level 2 and has no weights; call update_weights() first")
        for replica in self.replicas:
            replica.runner.kv.allocate()
        self.sleep_level = 0
