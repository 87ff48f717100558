"""The gRPC frontend (`lmserve.v1.Generation`, lmserve.proto) beside the HTTP API; needs the `grpc` extra.

Importing this package needs nothing extra; `lmserve.entrypoints.grpc.server` needs grpcio.
"""

from __future__ import annotations

EXTRA_HINT = "gRPC needs the grpc extra: pip install 'lmserve[grpc]'"


def missing_grpc() -> str | None:
    """None when the grpc extra is importable, else the error to show (naming the extra)."""
    try:
        import grpc  # noqa: F401
        import grpc_health.v1.health  # noqa: F401
        import grpc_reflection.v1alpha.reflection  # noqa: F401
        from google.protobuf import runtime_version  # noqa: F401

        from lmserve.grpc_proto import lmserve_pb2, lmserve_pb2_grpc  # noqa: F401
    except ImportError as e:
        return f"{EXTRA_HINT} ({e})"
    except Exception as e:  # the stubs' version checks (protobuf / grpcio too old) raise other errors
        return f"{EXTRA_HINT} at the versions pyproject.toml names ({type(e).__name__}: {e})"
    return None
