"""Regenerate the protobuf/gRPC stubs in this package from protos/dflash/v1/*.proto.

    python -m dflash_serve.services.api.codegen

The stubs are committed (the Ray Serve proxy imports them outside any runtime env), and
tests/unit/test_protos.py fails when they are stale. grpcio-tools is pinned to the grpcio floor
(pyproject.toml): generated code refuses grpcio runtimes older than the tools that made it.
protoc writes absolute imports (`from dflash.v1 import ...`) and module names; both are rewritten
to this package.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
PACKAGE_DIR = Path(__file__).resolve().parent
PACKAGE = "dflash_serve.services.api"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "dflash" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for every proto under out_dir (mirroring dflash/v1); returns the files."""
    from grpc_tools import protoc

    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()]]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for path in sorted((out_dir / "dflash" / "v1").glob("*.py*")):
        if path.name.endswith("_pb2_grpc.py") and "Servicer" not in path.read_text():
            path.unlink()  # a proto with messages only (drafter.proto): nothing for gRPC
            continue
        text = re.sub(r"^from dflash\.v1 import", f"from {PACKAGE}.dflash.v1 import", path.read_text(), flags=re.M)
        # The module name protoc records is where pickled messages are looked up (the Ray proxy pickles them).
        text = text.replace("(DESCRIPTOR, 'dflash.v1.", f"(DESCRIPTOR, '{PACKAGE}.dflash.v1.")
        path.write_text(text)
        written.append(path)
    return written


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            target = PACKAGE_DIR / path.relative_to(tmp)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text())
            print(f"wrote {target.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
