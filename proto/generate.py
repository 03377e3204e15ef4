"""Regenerate the Python stubs of proto/pdserve/v1/*.proto (committed beside them).

    python -m proto.generate          # rewrite the stubs in place
    python -m proto.generate --check  # exit 1 if the committed stubs are stale

protoc names imports after the proto package (``pdserve.v1``); the stubs live in
the ``proto`` Python package, so their imports are rewritten to ``proto.pdserve.v1``.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROTO_DIR = ROOT / "pdserve" / "v1"
_IMPORT = re.compile(r"^from pdserve\.v1 import", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs under ``out_dir/pdserve/v1``; returns their paths."""
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(p.relative_to(ROOT).as_posix() for p in PROTO_DIR.glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    (out_dir / "pdserve" / "v1").mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = sorted((out_dir / "pdserve" / "v1").glob("*_pb2*.py*"))
    for path in written:
        path.write_text(_IMPORT.sub("from proto.pdserve.v1 import", path.read_text()))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed stubs, change nothing")
    args = parser.parse_args(argv)
    if not args.check:
        for path in generate(ROOT):
            print(f"wrote {path.relative_to(ROOT.parent)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_text() for p in generate(Path(tmp))}
    stale = sorted(name for name, text in fresh.items()
                   if not (PROTO_DIR / name).exists() or (PROTO_DIR / name).read_text() != text)
    stale += sorted(p.name for p in PROTO_DIR.glob("*_pb2*.py*") if p.name not in fresh)
    if stale:
        print("stale stubs (run `python -m proto.generate`): " + ", ".join(stale), file=sys.stderr)
        return 1
    print("stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
