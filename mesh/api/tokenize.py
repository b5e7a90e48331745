"""The model's tokenizer over HTTP, in vLLM's shape: /tokenize, /detokenize, /tokenizer_info.

An evaluation harness scores a continuation by the positions its tokens take in the prompt,
so it must tokenize as the server does. lm-eval's `local-completions` finds these endpoints
itself (its `remote` tokenizer backend) and uses them instead of downloading a Hugging Face
tokenizer, which a GGUF served here may not have, or not the same one. The same API keys
guard them as /v1 (mesh/api/app.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mesh.api.body import parse_json, read_body
from mesh.api.error import ApiError, bad_request
from mesh.api.invalid import invalid_request
from mesh.api.media import json_required
from mesh.backend import Backend


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # vLLM's default: the BOS the model adds to a prompt


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def tokenizer_router(backend: Backend, max_body: int) -> APIRouter:
    router = APIRouter()

    @router.get("/tokenizer_info")
    async def info() -> dict[str, Any]:
        tok = backend.tok()
        eos, bos = tok.llm.token_eos(), tok.bos
        return {"tokenizer_class": "llama.cpp", "model_max_length": backend.ctx_per_session,
                "eos_token": _text(backend, eos), "bos_token": _text(backend, bos),
                "chat_template": tok.template}

    @router.post("/tokenize", response_model=None, dependencies=[Depends(json_required)])
    async def tokenize(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = await _read(request, TokenizeRequest, backend, max_body)
            assert isinstance(body, TokenizeRequest)
            # special tokens' text is parsed, as Hugging Face tokenizers do: a harness that asks
            # for the EOS token's id tokenizes its text
            tokens = await asyncio.to_thread(backend.tok().tokenize, body.prompt, True, body.add_special_tokens)
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return {"count": len(tokens), "max_model_len": backend.ctx_per_session, "tokens": tokens}

    @router.post("/detokenize", response_model=None, dependencies=[Depends(json_required)])
    async def detokenize(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = await _read(request, DetokenizeRequest, backend, max_body)
            assert isinstance(body, DetokenizeRequest)
            n_vocab = backend.tok().n_vocab
            if any(not 0 <= t < n_vocab for t in body.tokens):
                raise bad_request(f"tokens must be ids in 0..{n_vocab - 1}", "tokens")
        except ApiError as err:
            return JSONResponse(err.body(), status_code=err.status)
        text = await asyncio.to_thread(backend.tok().detokenize, body.tokens)
        return {"prompt": text.decode(errors="replace")}

    return router


async def _read(request: Request, model: type[_Strict], backend: Backend, max_body: int) -> _Strict:
    data = parse_json(await read_body(request, max_body))
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", None)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise invalid_request(exc, {}) from None
    asked = getattr(body, "model", None)
    if asked is not None and asked != backend.model_id:
        raise ApiError(404, f"model {asked!a} does not exist; this server serves {backend.model_id!a}",
                       "model_not_found", "model")
    return body


def _text(backend: Backend, token: int) -> str | None:
    return None if token < 0 else backend.tok().token_text(token).decode(errors="replace")
