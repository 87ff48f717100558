"""The grpc extra stays optional: without grpcio, `lmserve serve --grpc-port` refuses at once, naming the extra,
and the HTTP-only server never imports it."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules["grpc"] = None  # as if grpcio were not installed: importing it raises ImportError
from lmserve.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_grpc_port_without_the_extra_names_it() -> None:
    cmd = [sys.executable, "-c", CODE, "serve", "--grpc-port", "50051", "--model", "/nonexistent/model"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--grpc-port" in r.stderr and "pip install 'lmserve[grpc]'" in r.stderr, r.stderr


def test_http_server_modules_do_not_import_grpc() -> None:
    code = (
        "import sys; import lmserve.entrypoints.openai.serve_cli, lmserve.entrypoints.openai.server, "
        "lmserve.bench.loadgen; print('grpc' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
