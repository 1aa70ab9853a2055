"""`jaxllm` with faults injected into its model runner, for the server lifecycle tests:

    python tests/helpers/fault_server.py [--step-delay S] [--fail-at-step N] [--unrecoverable] -- serve ...

--step-delay sleeps S seconds in every engine step (long-running requests on a tiny model);
--fail-at-step makes the N-th step (counting from 1 after start-up) raise; with --unrecoverable
the runner's recovery raises too, so the engine cannot go on. The rest runs `jaxllm` unchanged.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxllm.entrypoints import cli
from jaxllm.runner.model_runner import ModelRunner


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--fail-at-step", type=int, default=0)
    parser.add_argument("--unrecoverable", action="store_true")
    args, rest = parser.parse_known_args()
    rest = rest[1:] if rest[:1] == ["--"] else rest
    dispatch, recover = ModelRunner.dispatch, ModelRunner.recover
    steps = 0

    def faulty_dispatch(self, scheduler_output, *ahead):
        nonlocal steps
        steps += 1
        time.sleep(args.step_delay)
        if steps == args.fail_at_step:
            raise RuntimeError("injected fault in the model runner")
        return dispatch(self, scheduler_output, *ahead)

    def faulty_recover(self, force=False):
        if args.unrecoverable:
            raise RuntimeError("injected fault: the device cannot be recovered")
        return recover(self, force)

    # Warm-up runs before any request and does not go through dispatch(), which every step does
    # (a step dispatched ahead by async scheduling too): steps count requests' steps.
    ModelRunner.dispatch, ModelRunner.recover = faulty_dispatch, faulty_recover
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())
