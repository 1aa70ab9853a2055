"""LLMEngine's LoRA adapters (vLLM's `add_lora` / `remove_lora` / `list_loras`): read and
checked on the host when first asked for (`AdapterCache`, `max_cpu_loras` kept), written into a
device slot by the runner when a step needs them (lora/slots.py)."""

from __future__ import annotations

from jaxllm.lora.adapter import AdapterCache, LoRAAdapter
from jaxllm.lora.request import LoRAError, LoRARequest


class LoRAMixin:
    def _init_lora(self) -> None:
        lora, slots = self.config.lora, self.runner.lora
        self.adapters = (
            None
            if lora is None
            else AdapterCache(slots.geometry, lora.max_lora_rank, slots.rank, lora.max_cpu_loras, slots.prepare)
        )

    def _lora_adapter(self, lora_request: LoRARequest | None) -> LoRAAdapter | None:
        """The adapter a request runs under (None: the base model); LoRAError if it cannot be served."""
        if lora_request is None:
            return None
        if self.adapters is None:
            raise LoRAError("a LoRA adapter was asked for, but this engine was started without enable_lora")
        return self.adapters.get(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now (LoRAError if it cannot be served), so that its first
        request does not wait for the disk. True once it is known."""
        self._lora_adapter(lora_request)
        return True

    def update_lora(self, lora_request: LoRARequest, tensors, config: dict | None = None) -> list:
        """Serve new weights for an adapter from the next step, without a file: `tensors` in
        PEFT's names (`{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": [r,
        in], ...}`, numpy or JAX arrays: a trainer's LoRA parameters), with the adapter's config
        (`lora_alpha`, `r`, ...; a new adapter needs `config`). Requests running under it go on
        with the new weights; pages its old weights computed are never reused. LoRAError, and
        nothing changed, if they do not fit. Returns the outputs of a step already in flight."""
        return self._serve_updated_lora(self._updated_lora(lora_request, tensors, config))

    def _updated_lora(self, lora_request: LoRARequest, tensors, config: dict | None) -> LoRAAdapter:
        """`update_lora`'s host work (reading the tensors, laying them out): any thread."""
        if self.adapters is None:
            raise LoRAError("update_lora needs an engine started with enable_lora")
        return self.adapters.update(lora_request, tensors, config)

    def _serve_updated_lora(self, adapter: LoRAAdapter) -> list:
        """`update_lora`'s engine work: the requests under the adapter take its new weights."""
        outputs = []
        for replica in self.replicas:
            settled = replica.settle()
            if settled is not None:
                outputs += self._process(settled)
        waiting_choices = [c for _, choices in self._pending_choices.values() for c in choices]
        for request in [*self.scheduler.requests.values(), *waiting_choices]:
            if request.lora is not None and request.lora.lora_int_id == adapter.lora_int_id:
                request.lora = adapter
        return outputs

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: its slot is freed once no running request uses it (those running
        finish under it). False if it was not known."""
        if self.adapters is None or not self.adapters.remove(lora_int_id):
            return False
        if not any(r.lora_int_id == lora_int_id for r in self.scheduler.requests.values()):
            self.runner.lora.evict(lora_int_id)
        return True

    def list_loras(self) -> set[int]:
        """The ids of the adapters added and not removed."""
        return set() if self.adapters is None else {r.lora_int_id for r in self.adapters.requests()}

    def lora_adapters_in_use(self) -> tuple[list[str], list[str]]:
        """The names of the adapters of running requests, and of waiting ones (for the metrics;
        safe from another thread: each list is copied whole under the GIL)."""
        running, waiting = list(self.scheduler.running), list(self.scheduler.waiting)
        return (
            sorted({r.lora.request.lora_name for r in running if r.lora is not None}),
            sorted({r.lora.request.lora_name for r in waiting if r.lora is not None}),
        )

    def lora_requests(self) -> list[LoRARequest]:
        """The adapters added and not removed, in the order they were added."""
        return [] if self.adapters is None else self.adapters.requests()
