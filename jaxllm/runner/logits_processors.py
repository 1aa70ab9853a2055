"""Custom logits processors (`sampling_params.LogitsProcessor`) in the runner: their per-row state
on the host (`ProcessorStates`, beside the input batch's rows) and their application inside the
step (`apply`).

The state arrays travel in `SamplingMetadata.custom`, keyed "<processor index>.<name>", in the
packed step inputs; `FLAG_CUSTOM` says whether any row of the step uses a processor, so a step
without one skips them all (a `lax.cond`)."""

from __future__ import annotations

import numpy as np


def specs(processors) -> dict[str, tuple[tuple[int, ...], np.dtype, object]]:
    return {
        f"{i}.{name}": (tuple(int(n) for n in shape), np.dtype(dtype), neutral)
        for i, p in enumerate(processors)
        for name, (shape, dtype, neutral) in p.state.items()
    }


def zeros(processors, rows: int) -> dict[str, np.ndarray]:
    """A step's `SamplingMetadata.custom`: every row neutral."""
    return {key: np.full((rows, *shape), neutral, dtype) for key, (shape, dtype, neutral) in specs(processors).items()}


class ProcessorStates:
    """Each input-batch row's processor state and whether each processor handles it."""

    def __init__(self, processors, rows: int):
        self.processors = processors
        self.specs = specs(processors)
        self.arrays = zeros(processors, rows)
        self.active = np.zeros((len(processors), rows), np.bool_)

    def grow(self, rows: int) -> None:
        old = self.active.shape[1]
        for key, (shape, dtype, neutral) in self.specs.items():
            grown = np.full((rows, *shape), neutral, dtype)
            grown[:old] = self.arrays[key]
            self.arrays[key] = grown
        active = np.zeros((len(self.processors), rows), np.bool_)
        active[:, :old] = self.active
        self.active = active

    def _views(self, i: int, row: int) -> dict[str, np.ndarray]:
        """Processor i's state of `row`, as arrays writable in place (0-d ones for scalars)."""
        views = {}
        for name in self.processors[i].state:
            key = f"{i}.{name}"
            views[name] = self.arrays[key][row : row + 1].reshape(self.specs[key][0])
        return views

    def add(self, row: int, params, prompt_token_ids, output_token_ids) -> None:
        """A request takes `row`: each processor's `row_state` (neutral where it returns None)."""
        for i, p in enumerate(self.processors):
            for key, (_, _, neutral) in self.specs.items():
                if key.startswith(f"{i}."):
                    self.arrays[key][row] = neutral
            state = p.row_state(params, list(prompt_token_ids))
            self.active[i, row] = state is not None
            if state is not None:
                for name, value in state.items():
                    self.arrays[f"{i}.{name}"][row] = value
                if len(output_token_ids):
                    p.update_state(self._views(i, row), output_token_ids)

    def update(self, row: int, output_token_ids) -> None:
        """The row's output grew: each processor handling it updates its state."""
        for i, p in enumerate(self.processors):
            if self.active[i, row]:
                p.update_state(self._views(i, row), output_token_ids)

    def fill(self, out: dict[str, np.ndarray], rows: np.ndarray) -> bool:
        """The step's rows' states into `out` (the rest neutral); whether any row is handled."""
        n = len(rows)
        for key, (_, _, neutral) in self.specs.items():
            out[key][:n] = self.arrays[key][rows]
            out[key][n:] = neutral
        return bool(self.active[:, rows].any()) if n else False


def apply(logits, custom: dict, processors):
    """Inside the step: each processor's `apply` on the logits with its [S, ...] state arrays."""
    for i, p in enumerate(processors):
        logits = p.apply(logits, {name: custom[f"{i}.{name}"] for name in p.state})
    return logits
