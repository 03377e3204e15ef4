"""pdserve's own OpenAPI document and the field table against OpenAI's published one."""

from __future__ import annotations

from pathlib import Path

import httpx
from openapi_spec_validator import validate

from services.gateway.spec_fields import ENDPOINTS, REFUSED, markdown
from tests.openai_spec.validator import document

REPO = Path(__file__).resolve().parents[2]
SPEC_REQUESTS = {"POST /v1/chat/completions": "CreateChatCompletionRequest",
                 "POST /v1/completions": "CreateCompletionRequest", "POST /v1/responses": "CreateResponse"}


def _properties(name: str) -> set[str]:
    schemas = document()["components"]["schemas"]
    schema, out = schemas[name], set(schemas[name].get("properties", {}))
    for part in schema.get("allOf", []):
        out |= _properties(part["$ref"].split("/")[-1]) if "$ref" in part else set(part.get("properties", {}))
    return out


def _routes(routes):
    """The app's routes, those of included routers too (FastAPI wraps them)."""
    for route in routes:
        if hasattr(route, "original_router"):
            yield from _routes(route.original_router.routes)
        elif hasattr(route, "methods"):
            yield route


def test_every_request_field_of_openais_spec_is_honoured_or_refused():
    for endpoint, schema in SPEC_REQUESTS.items():
        assert set(ENDPOINTS[endpoint]) == _properties(schema), endpoint


def test_docs_page_lists_the_table():
    page = (REPO / "docs" / "openai-api.md").read_text()
    assert markdown() in page, "docs/openai-api.md is stale: paste services.gateway.spec_fields.markdown()"


def test_openapi_json_describes_what_the_gateway_serves(gateway):
    h = gateway()
    with httpx.Client(base_url=h.url, timeout=10) as http:
        doc = http.get("/openapi.json").json()
        html = http.get("/docs")
    validate(doc)  # a valid OpenAPI 3.1 document
    assert html.status_code == 200 and "/openapi.json" in html.text and "swagger" in html.text.lower()
    from services.gateway.app import create_app

    served = {(method, route.path.replace(":path}", "}")) for route in _routes(create_app(h.core).routes)
              for method in route.methods if method != "HEAD"}
    documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == served - {("GET", "/openapi.json"), ("GET", "/docs")}
    for endpoint, fields in ENDPOINTS.items():
        body = doc["paths"][endpoint.split()[1]]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(body["x-pdserve-refused"]) == {n for n, f in fields.items() if f.status == REFUSED}
        assert {n for n in fields if fields[n].status != REFUSED} <= set(body["properties"])
        assert not set(body["properties"]) & set(body["x-pdserve-refused"])


def test_each_refused_field_is_a_400_naming_it_and_its_default_is_accepted(gateway):
    h = gateway()
    bases = {"POST /v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
             "POST /v1/completions": {"prompt": "Hi"}, "POST /v1/responses": {"input": "Hi"}}
    with httpx.Client(base_url=h.url, timeout=10) as http:
        for endpoint, fields in ENDPOINTS.items():
            path = endpoint.split()[1]
            for name, spec in fields.items():
                if spec.status != REFUSED:
                    continue
                r = http.post(path, json={**bases[endpoint], name: {"something": "set"}})
                assert r.status_code == 400 and r.json()["error"]["param"] == name, (endpoint, name, r.text)
                for ok in spec.accepts:
                    r = http.post(path, json={**bases[endpoint], name: ok})
                    assert r.status_code == 200, (endpoint, name, ok, r.text)
