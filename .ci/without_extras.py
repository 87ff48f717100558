"""Run pytest as on the README's plain install (`.[test]` only), whatever else this machine has installed:
the optional extras' modules are made unimportable first, as tests/server/test_grpc_optional.py does for grpc.

    python .ci/without_extras.py --collect-only -q
"""

from __future__ import annotations

import sys

import pytest

# the top-level modules of the extras in pyproject.toml: grpc, web-test, ray, eval
EXTRA_MODULES = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "playwright", "ray", "lm_eval")

for name in EXTRA_MODULES:
    sys.modules[name] = None  # importing it now raises ImportError, as if it were not installed

sys.exit(pytest.main(sys.argv[1:]))
