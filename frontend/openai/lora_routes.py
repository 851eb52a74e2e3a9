"""vLLM's runtime LoRA routes: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Present only with `--allow-runtime-lora-updating` (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, as
vLLM gates them); otherwise they are 404s, as in vLLM. A load is checked against the model on a
thread (file reads never stall the event loop, so requests of other adapters and the base model
go on) and refused with a 400 naming the adapter; a path outside `--lora-allowed-dirs` is a 403.
Unloading forgets the name at once: new requests naming it get a 404, requests already running
finish with it (the registry and the workers say why, frontend/lora_registry.py).
"""

from __future__ import annotations

import asyncio
import functools

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from starlette.responses import PlainTextResponse, Response

from pagedserve.frontend.async_engine import AsyncEngine
from pagedserve.frontend.lora_registry import LoRANotFoundError
from pagedserve.frontend.openai.protocol import APIError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, engine: AsyncEngine, model_names: list[str]) -> None:
    registry = engine.loras
    if registry is None or not registry.config.allow_runtime_lora_updating:
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        if req.load_inplace:
            raise APIError(400, "load_inplace is not supported.", param="load_inplace")
        load = functools.partial(registry.load, req.lora_name, req.lora_path, model_names)
        try:
            await asyncio.get_running_loop().run_in_executor(None, load)
        except PermissionError as e:
            raise APIError(403, str(e), param="lora_path") from None
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        lora = registry.get(req.lora_name)
        if lora is not None and req.lora_int_id not in (None, lora.lora_int_id):
            raise APIError(400, f"lora_int_id {req.lora_int_id} is not {req.lora_name!r}'s.")
        try:
            registry.unload(req.lora_name)
        except LoRANotFoundError as e:
            raise APIError(404, str(e), param="lora_name", code="lora_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
