"""Cut the endpoints pdserve serves out of OpenAI's published OpenAPI document (openai/openai-openapi).

    python -m tests.openai_spec.vendor PATH/TO/openai-openapi/openapi.json COMMIT

writes ``openapi.json`` beside this file: the document's ``openapi``, ``info`` and
``servers``, the operations below, and every component they reference (schemas
and responses, followed transitively), each exactly as published except that the
``x-oaiMeta`` blocks (code samples for OpenAI's docs site) are dropped. SOURCE.md
records the commit; LICENSE is the repository's (MIT).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPERATIONS = {"/chat/completions": ["post"], "/completions": ["post"], "/models": ["get"],
              "/models/{model}": ["get"], "/responses": ["post"], "/responses/{response_id}": ["get"]}
EXTRA_SCHEMAS = ["ErrorResponse"]  # the error body every endpoint answers with (not referenced by them)


def _strip(node):
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "x-oaiMeta"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def _refs(node, out: set[str]) -> set[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out.add(value)
            else:
                _refs(value, out)
    elif isinstance(node, list):
        for value in node:
            _refs(value, out)
    return out


def cut(doc: dict) -> dict:
    paths = {p: {m: _strip(doc["paths"][p][m]) for m in methods} for p, methods in OPERATIONS.items()}
    todo = _refs(paths, {f"#/components/schemas/{name}" for name in EXTRA_SCHEMAS})
    components: dict[str, dict] = {}
    seen: set[str] = set()
    while todo:
        ref = todo.pop()
        if ref in seen:
            continue
        seen.add(ref)
        _, section, kind, name = ref.split("/")
        assert section == "components", ref
        node = _strip(doc["components"][kind][name])
        components.setdefault(kind, {})[name] = node
        todo |= _refs(node, set()) - seen
    return {"openapi": doc["openapi"], "info": doc["info"], "servers": doc.get("servers", []), "paths": paths,
            "components": {kind: dict(sorted(items.items())) for kind, items in sorted(components.items())}}


def main(argv: list[str]) -> int:
    source, commit = Path(argv[0]), argv[1]
    out = cut(json.loads(source.read_text()))
    (HERE / "openapi.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(out['paths'])} paths, {sum(len(v) for v in out['components'].values())} components from {commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
