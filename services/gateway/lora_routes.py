"""LoRA adapters added and removed at run time (vLLM's endpoints; off unless ``--enable-lora-admin``):

    POST /v1/load_lora_adapter    {"lora_name": NAME, "lora_path": DIR}   200 "Success: ..."
    POST /v1/unload_lora_adapter  {"lora_name": NAME}                    200, or 404 for an unknown name

The adapter's config is checked here (services/engine/lora_config.py: PEFT files present, a LoRA
the workers serve) and it goes into Redis (services/lora_registry.py); each worker picks it up
at its next heartbeat and reads its tensors when a request first asks for it. A name already
served from another path, or the base model's name, is a 400. With API keys on, a key is needed.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from services.engine.lora_config import read_lora
from services.errors import InvalidRequestError, ModelNotFoundError
from services.gateway import protocol
from services.gateway.core import GatewayCore
from services.lora_registry import add_lora, remove_lora


def lora_admin_router(core: GatewayCore) -> APIRouter:
    router = APIRouter()

    async def body_of(request: Request, *fields: str) -> list[str]:
        core.authenticate(request.headers.get("authorization"))
        body = protocol.parse_json_body(await request.body())
        values = []
        for name in fields:
            value = body.get(name)
            if not isinstance(value, str) or not value:
                raise InvalidRequestError(f"{name} must be a non-empty string", param=name)
            values.append(value)
        return values

    @router.post("/v1/load_lora_adapter")
    async def load(request: Request):
        name, path = await body_of(request, "lora_name", "lora_path")
        if name == core.model.name or name.startswith(core.model.name + ":"):
            raise InvalidRequestError(f"{name!r} is the base model's name; give the adapter another", param="lora_name")
        spec = read_lora(name, path)
        known = await core.loras()
        if name in known and known[name] != spec.path:
            raise InvalidRequestError(f"adapter {name!r} is already served from {known[name]}; unload it first",
                                      param="lora_name")
        await add_lora(core.redis, name, spec.path)
        core.forget_loras()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        (name,) = await body_of(request, "lora_name")
        if not await remove_lora(core.redis, name):
            raise ModelNotFoundError(f"no LoRA adapter {name!r} is served", param="lora_name")
        core.forget_loras()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router
