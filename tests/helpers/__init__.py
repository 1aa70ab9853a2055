"""What several test modules share: the tiny model, the live server, the GPU lowering helpers,
reference implementations and the subprocess workers (docs/testing.md lists them)."""

import os

# The repository's root (tests/helpers/ is two levels down).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
