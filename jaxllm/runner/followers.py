"""A dispatched step's record (`InFlight`), and the steps over several processes, where
process 0 announces each step and the others follow (`ProcessGroup`)."""

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
    first: np.ndarray | None  # each scheduled request's first sampled row (see `prepare_step`)
    count: np.ndarray | None
    buffers: BucketBuffers | None
    outs: tuple | None  # the step's device outputs, less the KV cache
    t0: float
    t1: float = 0.0


class ProcessGroup:
    """A runner's steps over several processes: process 0 (the leader) announces each step on
    the `parallel.StepChannel` (its bucket, page copies and packed inputs), and every other
    process runs the same step on its own devices (`follow`)."""

    def __init__(self, channel: parallel.StepChannel):
        self.channel = channel

    def announce(self, bucket: int, packed, copies) -> None:
        """On the leader: the step of `bucket` (its index, -1 for none) with `packed` inputs, and
        the page copies to run before it."""
        src = [p for s, _ in copies for p in s]
        dst = [p for _, d in copies for p in d]
        groups = [g for g, (s, _) in enumerate(copies) for _ in s]
        # Which side inputs are sent (host arrays), not the cached -1s: bit 0 penalties, bit 1 mask.
        side = [isinstance(x, np.ndarray) for x in packed[2:]] if packed is not None else [False, False]
        self.channel.send_header(parallel.StepChannel.STEP, bucket, len(src), side[0] | side[1] << 1)
        if len(src):
            self.channel.arrays(np.asarray(src, np.int32), np.asarray(dst, np.int32), np.asarray(groups, np.int32))
        if packed is not None:
            self.channel.arrays(*packed[:2], *(x for x, sent in zip(packed[2:], side) if sent))

    def follow(self, runner) -> None:
        """On a process other than 0: run the steps the leader announces on `runner` until it stops."""
        while True:
            op, bucket, num_copies, side = self.channel.receive_header()
            if op == parallel.StepChannel.STOP:
                return
            if num_copies:
                src, dst, groups = self.channel.arrays(*(np.zeros(num_copies, np.int32) for _ in range(3)))
                runner.kv.copy_pages(
                    [
                        (list(src[groups == g]), list(dst[groups == g]))
                        for g in range(len(runner.config.cache.group_windows))
                    ]
                )
            if bucket >= 0:
                _, ints, floats, *defaults = runner.builder.padding(runner.buckets[bucket])
                # One broadcast, as the leader sends it: the packed inputs, then the side inputs sent.
                sent = [i for i in range(len(defaults)) if side >> i & 1]
                ints, floats, *got = self.channel.arrays(
                    ints, floats, *(np.zeros(defaults[i].shape, np.int32) for i in sent)
                )
                side_inputs = [dict(zip(sent, got)).get(i, x) for i, x in enumerate(defaults)]
                runner.kv.pages = runner.call(runner.buckets[bucket], ints, floats, *side_inputs)[-1]

    def stop(self) -> None:
        """On the leader: let the other processes' `follow` return."""
        self.channel.send_header(parallel.StepChannel.STOP)
