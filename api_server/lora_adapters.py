"""The LoRA adapters a server answers for by name (MAX's and vLLM's `model` = adapter name),
and the routes that load and unload them at run time.

Adapters are checked here, before any request can name them (pipelines/lora.py): files,
shapes against the base model, rank, and where they lie: a route may only load from the
directories the operator allowed (--lora-dir, and those of --lora-paths' adapters), so a
client cannot make the server read arbitrary paths. The worker reads the weights when a step
first needs them.
"""

from __future__ import annotations

import os

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api_server.protocol import RequestError, decode_body
from pipelines.config import LoRAConfig
from pipelines.lora import AdapterError, LoRARequest, check_adapter, inside, parse_lora_paths


class LoadLoRAAdapter(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapter(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: str
    lora_int_id: int | None = None  # (vLLM's clients send it; the name says which)


class LoRAAdapters:
    def __init__(self, config: LoRAConfig, base_config, base_name: str) -> None:
        """`base_config`: the base model's ModelConfig (the shapes adapters must fit).
        AdapterError if an adapter of --lora-paths cannot be served."""
        self.max_rank = config.max_lora_rank
        self.max_num_loras = config.max_num_loras
        self.base_config = base_config
        self.base_name = base_name
        self.adapters: dict[str, LoRARequest] = {}
        given = parse_lora_paths(config.lora_paths)
        self.allowed_dirs = {os.path.dirname(path) for path in given.values()}
        if config.lora_dir:
            self.allowed_dirs.add(os.path.realpath(os.path.expanduser(config.lora_dir)))
        for name, path in given.items():
            self._add(name, path)

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    @property
    def names(self) -> list[str]:
        return sorted(self.adapters)

    def request_for(self, model_name: str) -> LoRARequest | None:
        """The adapter a request for `model_name` runs (None: the base model)."""
        if model_name == self.base_name:
            return None
        adapter = self.adapters.get(model_name)
        if adapter is None:  # (unloaded since the request's model was checked)
            raise RequestError(f"the model `{model_name}` does not exist", param="model",
                               status=404, code="model_not_found")
        return adapter

    def model_cards(self, created: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "loom",
                 "root": adapter.path, "parent": self.base_name}
                for name, adapter in sorted(self.adapters.items())]

    def _add(self, name: str, path: str) -> None:
        check_adapter(path, self.base_config, self.max_rank)
        self.adapters[name] = LoRARequest(name, path)

    # ---- routes -----------------------------------------------------------------------------
    def load(self, body: bytes, reserved_names: set[str]) -> dict:
        """POST /v1/load_lora_adapter {lora_name, lora_path}."""
        req = _parse(body, LoadLoRAAdapter)
        name = req.lora_name.strip()
        if not name or name in reserved_names:
            raise RequestError(f"lora_name {req.lora_name!r} is empty or names a model",
                               param="lora_name")
        if name in self.adapters:
            raise RequestError(f"the LoRA adapter `{name}` is already loaded; unload it first",
                               param="lora_name", code="lora_already_loaded")
        path = os.path.realpath(os.path.expanduser(req.lora_path))
        if not self.allowed_dirs or not inside(path, self.allowed_dirs):
            raise RequestError(
                "lora_path is outside the directories adapters may be loaded from (--lora-dir, "
                "and those of --lora-paths)", param="lora_path", code="lora_path_not_allowed")
        try:
            self._add(name, path)
        except AdapterError as exc:
            raise RequestError(f"LoRA adapter `{name}`: {exc}", param="lora_path",
                               code="invalid_lora_adapter") from None
        return {"status": "ok", "message": f"LoRA adapter {name} loaded"}

    def unload(self, body: bytes, requests_using: int) -> dict:
        """POST /v1/unload_lora_adapter {lora_name}; refused while requests run it."""
        req = _parse(body, UnloadLoRAAdapter)
        if req.lora_name not in self.adapters:
            raise RequestError(f"no LoRA adapter `{req.lora_name}` is loaded", param="lora_name",
                               status=404, code="lora_not_found")
        if requests_using:
            raise RequestError(
                f"the LoRA adapter `{req.lora_name}` runs {requests_using} request(s); unload "
                f"it once they are done", param="lora_name", code="lora_in_use")
        del self.adapters[req.lora_name]
        return {"status": "ok", "message": f"LoRA adapter {req.lora_name} unloaded"}


def _parse(body: bytes, kind: type) -> msgspec.Struct:
    return decode_body(body[:1 << 16], kind)  # (two short fields)


class LoRARoutes:
    """The two routes, answered from the ServingContext's adapters."""

    def __init__(self, serving) -> None:
        self.serving = serving

    async def load(self, request: Request) -> Response:
        from api_server.serving_context import error_response, json_response

        try:
            adapters = self._adapters()
            return json_response(adapters.load(await request.body(),
                                               self.serving.model_aliases))
        except RequestError as exc:
            return error_response(exc)

    async def unload(self, request: Request) -> Response:
        from api_server.serving_context import error_response, json_response

        try:
            adapters = self._adapters()
            body = await request.body()
            name = _parse(body, UnloadLoRAAdapter).lora_name
            return json_response(adapters.unload(body, self.serving.engine.requests_using(name)))
        except RequestError as exc:
            return error_response(exc)

    def _adapters(self) -> LoRAAdapters:
        if self.serving.loras is None:
            raise RequestError("this server serves no LoRA adapters (start it with "
                               "--enable-lora)", status=400, code="lora_not_enabled")
        return self.serving.loras
