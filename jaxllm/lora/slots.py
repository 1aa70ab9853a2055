"""`LoRASlots`: which adapter each of the device's `max_loras` slots holds (the runner's).

Before each step the runner calls `activate` with the step's requests: each adapter among them
not in a slot is written into a free one, or into the least recently used one no request of the
step needs (the scheduler admits at most `max_loras` adapters among running requests, so there
is always one). Writing a slot is one call that updates every stack in place (`layers.write_slot`):
the steps' shapes never change, nothing recompiles, and the other requests' steps wait for one
copy of the adapter at most.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.lora import layers
from jaxllm.lora.adapter import LoRAAdapter, LoRAGeometry
from jaxllm.models import layout

NO_SLOT = -1


class LoRASlots:
    def __init__(
        self,
        cfg,
        *,
        max_loras: int,
        max_rank: int,
        dtype,
        device,
        cpp_gemm: bool,
        tp: int = 1,
        pp: int = 1,
        sharding_of=None,
    ):
        """`max_loras` empty slots for the adaptable matrices of a model of `cfg`, each block
        `rank` wide: max_rank rounded up to 16 (the C++ GEMM's panels; adapters of a lower rank
        are padded with zeros). `cpp_gemm`: the stacks go into the C++ GEMM's panels where they
        fit (lora/layers.py). On a mesh, `sharding_of(matrix, "a" | "b")` places each stack
        (parallel.py `lora_spec`): b in one block-diagonal part, its columns regrouped per shard
        as the matrix's are (models/layout.py `tp_layout`); with `pp` pipeline stages, each layer
        slot's stacks are stacked [pp, ...] as its weights are (`shard_layout`)."""
        self.cfg, self.max_loras, self.dtype, self.tp, self.pp = cfg, max_loras, jnp.dtype(dtype), tp, pp
        self.on_mesh = sharding_of is not None
        self.rank = -(-max_rank // layers.PANEL) * layers.PANEL
        self.geometry = LoRAGeometry.of(cfg)
        self.stacks, self.panel_parts, shardings = {}, {}, []
        for i, layer in enumerate(self.geometry.layers[: cfg.num_layers // pp]):  # (a stage's layer slots)
            for name, slot in layer.items():
                packed = cpp_gemm and tp == 1 and layers.can_pack(slot, self.rank, self.dtype)
                self.panel_parts[i, name] = layers.panel_part(slot) if packed else None
                if sharding_of is not None:
                    slot = slot._replace(parts=(self._regroup(name, np.zeros((1, sum(slot.parts)))).shape[1],))
                    where = (sharding_of(name, "a"), (sharding_of(name, "b"),))
                else:
                    where = device
                stack = layers.empty_stack(slot, num_slots=max_loras, rank=self.rank, dtype=self.dtype, packed=packed)
                if pp > 1:
                    stack = jax.tree.map(lambda x: np.stack([x] * pp), stack)
                self.stacks[i, name] = jax.device_put(stack, where)
                shardings.append(jax.tree.map(lambda x: x.sharding, self.stacks[i, name]))
        self._write_slot = (
            layers.write_slot
            if sharding_of is None
            else jax.jit(layers.write_slot_values, donate_argnums=(0,), static_argnums=(3, 4), out_shardings=shardings)
        )
        self.trees: tuple = ()
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> slot, LRU first
        self._resident: list[LoRAAdapter | None] = [None] * max_loras  # what each slot holds
        self.num_loads = 0

    def adopt(self, params: dict, small_params: dict | None) -> tuple[dict, dict | None]:
        """The runner's params trees (the big steps', the small steps' or None) with the slots
        beside their adaptable matrices: what the steps take from now on (new base weights, the
        same slots)."""
        self.trees = tuple(
            layers.wrap(tree, self.stacks, self.max_loras, self.panel_parts) for tree in (params, small_params)
        )
        return self.trees

    def slot_of(self, lora_int_id: int) -> int:
        """The slot of an active adapter (NO_SLOT for the base model, id 0)."""
        return self._slot_of[lora_int_id] if lora_int_id else NO_SLOT

    def activate(self, adapters: list[LoRAAdapter | None]) -> None:
        """Make every adapter of a step's requests resident (see the module doc)."""
        needed = {a.lora_int_id: a for a in adapters if a is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step needs {len(needed)} adapters, more than max_loras={self.max_loras}")
        for lora_int_id, adapter in needed.items():
            if lora_int_id in self._slot_of and self._resident[self._slot_of[lora_int_id]] is adapter:
                self._slot_of.move_to_end(lora_int_id)
                continue
            slot = self._slot_of.pop(lora_int_id, None)  # (an id removed and added again: the new adapter)
            if slot is None:
                free = [s for s in range(self.max_loras) if s not in self._slot_of.values()]
                slot = free[0] if free else self._slot_of.pop(next(i for i in self._slot_of if i not in needed))
            self._write(slot, adapter)
            self._resident[slot] = adapter
            self._slot_of[lora_int_id] = slot

    def evict(self, lora_int_id: int) -> None:
        """Forget an adapter's slot (it is read again from the host if it is asked for later)."""
        self._slot_of.pop(lora_int_id, None)

    def prepare(self, adapter: LoRAAdapter) -> None:
        """Lay the adapter out as a slot holds it (`adapter.slot_values`): packed into panels,
        regrouped for the mesh, stacked over stages, in the stacks' dtype. Thread-safe (it
        reads only the layout), so the host's share of loading runs where the adapter is read."""
        per_stage = self.cfg.num_layers // self.pp
        values = []
        for i, name in self.stacks:
            packed = self.panel_parts[i, name] is not None
            stage_values = [self._values(adapter, s * per_stage + i, name, packed) for s in range(self.pp)]
            values.append(stage_values[0] if self.pp == 1 else jax.tree.map(lambda *v: np.stack(v), *stage_values))
        adapter.slot_values = values

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        if adapter.slot_values is None:
            self.prepare(adapter)
        packed = tuple(p is not None for p in self.panel_parts.values())
        written = self._write_slot(
            list(self.stacks.values()), np.int32(slot), adapter.slot_values, packed, int(self.pp > 1)
        )
        self.stacks = dict(zip(self.stacks, written))
        for tree in self.trees:  # the runner's trees, in place
            for (i, name), (a, b) in self.stacks.items():
                if tree is not None:
                    tree["layers"][i][name].a, tree["layers"][i][name].b = a, b
        self.num_loads += 1

    def _values(self, adapter: LoRAAdapter, layer: int, name: str, packed: bool) -> tuple:
        """One layer's matrix's slot values (`layers.slot_values`) from the adapter (zeros where
        it leaves the matrix alone)."""
        geometry = self.geometry.layers[layer][name]
        width = geometry.blocks * self.rank
        a, b = adapter.layers[layer].get(name) or (
            np.zeros((geometry.in_dim, width), np.float32),
            np.zeros((width, sum(geometry.parts)), np.float32),
        )
        parts = (self._regroup(name, b),) if self.on_mesh else geometry.split(b, self.rank)
        return layers.slot_values(a, parts, self.dtype, packed)

    def _regroup(self, name: str, b: np.ndarray) -> np.ndarray:
        """b's output columns as the tensor-parallel layout regroups the matrix's."""
        return layout.tp_layout({"layers": [{name: b}]}, self.cfg, self.tp)["layers"][0][name]
