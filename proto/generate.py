"""Regenerate the committed Python for proto/meshpipe.proto: `python -m proto.generate`."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
OUTPUTS = ("meshpipe_pb2.py", "meshpipe_pb2_grpc.py", "meshpipe_pb2.pyi")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    args = ["protoc", f"-I{HERE}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(HERE / "meshpipe.proto")]
    if protoc.main(args) != 0:
        raise SystemExit("proto.generate: error: protoc failed")
    # protoc writes a top-level import; the generated code lives in the `proto` package.
    grpc_file = out_dir / "meshpipe_pb2_grpc.py"
    text = grpc_file.read_text().replace(
        "import meshpipe_pb2 as meshpipe__pb2", "from proto import meshpipe_pb2 as meshpipe__pb2")
    grpc_file.write_text(text)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
