"""gRPC ingress: validation, tokenization, admission control and streaming (see router.py)."""
