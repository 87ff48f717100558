"""Regenerate the committed gRPC stubs of src/lmserve/grpc_proto/lmserve.proto (needs grpcio-tools):

    python scripts/gen_grpc.py

which runs `python -m grpc_tools.protoc -I src --python_out=src --pyi_out=src --grpc_python_out=src
src/lmserve/grpc_proto/lmserve.proto`. The generated code checks at import that the protobuf and grpcio
installed are at least the versions it was generated with: keep the `grpc` extra's lower bounds in
pyproject.toml at or below what the header of lmserve_pb2.py / lmserve_pb2_grpc.py names.
"""

from __future__ import annotations

import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PROTO = "lmserve/grpc_proto/lmserve.proto"


def main() -> int:
    from grpc_tools import protoc

    args = ["grpc_tools.protoc", f"-I{SRC}", f"--python_out={SRC}", f"--pyi_out={SRC}", f"--grpc_python_out={SRC}"]
    return protoc.main([*args, str(SRC / PROTO)])


if __name__ == "__main__":
    sys.exit(main())
