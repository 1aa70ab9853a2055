"""A check on N virtual CPU devices, in a subprocess: XLA's --xla_force_host_platform_device_count
must be set before JAX starts, and the test process keeps its one device. The `run_on_virtual_devices`
fixture (tests/conftest.py) calls `run`; the subprocess is this module:

    python -m tests.helpers.virtual_devices N CHECK WORKDIR OUT.json [ARGS_JSON]

which sets the flag, runs `CHECK(WORKDIR, *ARGS)` of tests/helpers/sharded_checks.py and writes
what it returns to OUT.json. The tests assert on that result; the checks only generate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import ROOT


def run(n: int, check: str, *args, workdir: str, timeout: float = 1200):
    """What `check(workdir, *args)` returns, run on `n` virtual CPU devices in a subprocess."""
    out = os.path.join(workdir, "result.json")
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.virtual_devices", str(n), check, workdir, out, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{check} on {n} virtual devices failed:\n{proc.stderr[-4000:]}"
    with open(out) as f:
        return json.load(f)


def main() -> int:
    n, check, workdir, out, *rest = sys.argv[1:]
    args = json.loads(rest[0]) if rest else []
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    import jax

    from tests.helpers import sharded_checks

    assert len(jax.devices("cpu")) == int(n), jax.devices("cpu")
    result = getattr(sharded_checks, check)(workdir, *args)
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
