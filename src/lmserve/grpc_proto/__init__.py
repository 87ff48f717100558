"""The gRPC wire protocol: lmserve.proto and its generated stubs (server and clients)."""
