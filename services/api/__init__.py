"""Generated protobuf and gRPC stubs of protos/dflash/v1 (see codegen.py)."""
