"""Two parts of `ModelRunner` kept apart: a dispatched step's record (`InFlight`), and the
steps over several processes, where process 0 announces each step and the others follow."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm import parallel
from jaxllm.core.outputs import SchedulerOutput
from jaxllm.runner.input_batch import BucketBuffers


@dataclasses.dataclass
class InFlight:
    """A dispatched step (`ModelRunner.dispatch`): what `collect` needs to read its outputs."""

    scheduler_output: SchedulerOutput
    seqs: np.ndarray | None
    first: np.ndarray | None       # each scheduled request's first sampled row (see `prepare_step`)
    count: np.ndarray | None
    buffers: BucketBuffers | None
    outs: tuple | None             # the step's device outputs, less the KV cache
    t0: float
    t1: float = 0.0


class ProcessGroupSteps:
    """`ModelRunner`'s steps over several processes (a mixin: it uses the runner's buffers,
    `_padding`, `_call` and `copy_pages`)."""

    def _announce(self, buffers: BucketBuffers | None, packed, copies) -> None:
        src = [p for s, _ in copies for p in s]
        dst = [p for _, d in copies for p in d]
        groups = [g for g, (s, _) in enumerate(copies) for _ in s]
        # Which side inputs are sent (host arrays), not the cached -1s: bit 0 penalties, bit 1 mask.
        side = [isinstance(x, np.ndarray) for x in packed[2:]] if packed is not None else [False, False]
        bucket = self.buckets.index(buffers.bucket) if buffers is not None else -1
        self.channel.send_header(parallel.StepChannel.STEP, bucket, len(src), side[0] | side[1] << 1)
        if len(src):
            self.channel.arrays(np.asarray(src, np.int32), np.asarray(dst, np.int32), np.asarray(groups, np.int32))
        if packed is not None:
            self.channel.arrays(*packed[:2], *(x for x, sent in zip(packed[2:], side) if sent))

    def follow(self) -> None:
        """On a process other than 0: run the steps process 0 announces until it stops."""
        while True:
            op, bucket, num_copies, side = self.channel.receive_header()
            if op == parallel.StepChannel.STOP:
                return
            if num_copies:
                src, dst, groups = self.channel.arrays(*(np.zeros(num_copies, np.int32) for _ in range(3)))
                self.copy_pages([(list(src[groups == g]), list(dst[groups == g]))
                                 for g in range(len(self.config.cache.group_windows))])
            if bucket >= 0:
                _, ints, floats, *defaults = self._padding(self.buckets[bucket])
                # One broadcast, as the leader sends it: the packed inputs, then the side inputs sent.
                sent = [i for i in range(len(defaults)) if side >> i & 1]
                ints, floats, *got = self.channel.arrays(ints, floats,
                                                         *(np.zeros(defaults[i].shape, np.int32) for i in sent))
                side_inputs = [dict(zip(sent, got)).get(i, x) for i, x in enumerate(defaults)]
                self.kv_cache = self._call(self.buckets[bucket], ints, floats, *side_inputs)[-1]

    def stop_followers(self) -> None:
        """On process 0: let the other processes' `follow` return."""
        if self.channel is not None and self.channel.is_leader:
            self.channel.send_header(parallel.StepChannel.STOP)
            self.channel = None
