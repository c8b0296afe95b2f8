"""The request path of /v1/chat/completions and /v1/completions.

Order of work for one request, every refusal happening before the engine sees it:
model name -> unsupported options -> sampling params (every range) -> prompt length bound and
token ids (api.tokenization: bounded pools off the event loop) -> the model that answers
(api.model_routing) -> length checks -> A/B arm -> submit to that model's engine loop (which
validates again and may answer 429 or 503) -> stream or collect the outputs. A client that
disconnects, or a request that outlives the request timeout, is aborted so its KV blocks return to
the pool.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import Response
from specdec.api.ab import ARM_HEADER, SPECULATIVE_HEADER, ArmAssigner, Assignment
from specdec.api.errors import APIError
from specdec.api.formatting import ChatFormatter, CompletionFormatter, ResponseInfo
from specdec.api.json_text import JSONText, dumps
from specdec.api.metrics import RequestTracker, ServerMetrics
from specdec.api.model_routing import MODEL_HEADER, Backend, ModelRouter
from specdec.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from specdec.api.settings import ServerSettings
from specdec.api.tokenization import PromptTokenizer
from specdec.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from specdec.engine.errors import InvalidRequestError, SpecdecError
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.tokenizer import Tokenizer
from sse_starlette import EventSourceResponse


@dataclass
class Prepared:
    """A request that passed every check the API can make on its own."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    backend: Backend  # the model that answers
    assignment: Assignment
    stream: bool
    include_usage: bool
    arrival_time: float
    info: ResponseInfo


def _unsupported(param: str, why: str) -> APIError:
    return APIError(400, why, param=param, code="unsupported_parameter")


def check_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse options that would change the result but are not implemented."""
    if body.n is not None and body.n != 1:
        raise _unsupported("n", f"only n=1 is supported (got n={body.n}); send separate requests")
    if body.logit_bias:
        raise _unsupported("logit_bias", "logit_bias is not supported")
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs or body.top_logprobs:
            raise _unsupported("logprobs", "logprobs are not supported")
        if body.tools:
            raise _unsupported("tools", "tool calling is not supported")
        if body.tool_choice not in (None, "none", "auto"):
            raise _unsupported("tool_choice", "tool calling is not supported")
        if body.response_format is not None and body.response_format.get("type") != "text":
            raise _unsupported("response_format", "only response_format type 'text' is supported")
    else:
        if body.logprobs is not None:
            raise _unsupported("logprobs", "logprobs are not supported")
        if body.echo:
            raise _unsupported("echo", "echo is not supported")
        if body.best_of is not None and body.best_of != 1:
            raise _unsupported("best_of", "only best_of=1 is supported")
        if body.suffix:
            raise _unsupported("suffix", "suffix (insertion) is not supported")


def completion_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The single prompt of a completions request (a one-element batch is unwrapped)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise _unsupported(
                "prompt", f"batched prompts are not supported (got {len(prompt)}); send one each"
            )
        return prompt[0]
    return prompt


def requested_max_tokens(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """``max_completion_tokens`` when given (chat), else ``max_tokens``."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def build_sampling_params(
    body: SamplingFields, requested_max_tokens: int | None, limit: int | None
) -> SamplingParams:
    """SamplingParams of a request, which validates every range; raises InvalidRequestError (400).

    ``max_tokens`` is the requested one (None: decided once the prompt length is known, see
    ``fill_max_tokens``). Built before the prompt is tokenized, so a bad parameter costs nothing.
    """
    if requested_max_tokens is not None and limit is not None and requested_max_tokens > limit:
        raise InvalidRequestError(
            f"max_tokens ({requested_max_tokens}) exceeds this server's limit of {limit}",
            param="max_tokens",
        )
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
        frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        seed=body.seed,
        max_tokens=requested_max_tokens,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
    )


def fill_max_tokens(
    params: SamplingParams, num_prompt_tokens: int, max_model_len: int, limit: int | None
) -> SamplingParams:
    """Without a requested ``max_tokens`` the request may run to max_model_len, or to the server's
    ``limit`` when one is set."""
    if params.max_tokens is not None or limit is None:
        return params
    return replace(params, max_tokens=max(1, min(limit, max_model_len - num_prompt_tokens)))


class OpenAIServing:
    """Handles the two generation endpoints for one engine."""

    def __init__(
        self,
        engine: AsyncEngine,
        settings: ServerSettings,
        metrics: ServerMetrics,
        assigner: ArmAssigner,
        router: ModelRouter | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.assigner = assigner
        # Without a router, every served name is the target's.
        self.router = router or ModelRouter(
            Backend(settings.model_name, engine.engine.config.model, engine, assigner),
            settings.served_model_names,
        )
        self.max_model_len = engine.engine.max_model_len
        self.max_tokens_limit = settings.max_tokens_limit
        tokenizer: Tokenizer | None = engine.engine.tokenizer
        self.prompts: PromptTokenizer | None = None
        if tokenizer is not None:
            tokenizer.max_chars_per_token  # noqa: B018 - computed once, at start-up
            self.prompts = PromptTokenizer(
                tokenizer,
                self.max_model_len,
                special_tokens_in_content=settings.allow_special_tokens_in_content,
            )

    # ---- endpoints --------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        model = self._check_model(body.model)
        check_unsupported(body)
        if self.prompts is None:
            raise InvalidRequestError(
                "this model has no tokenizer, so chat messages cannot be encoded; use "
                "/v1/completions with token ids",
                param="messages",
            )
        requested = requested_max_tokens(body)
        params = build_sampling_params(body, requested, self.max_tokens_limit)
        messages = []
        for m in body.messages:
            message = m.model_dump(mode="python", exclude_unset=True)
            message.setdefault("content", None)
            messages.append(message)
        prompt_ids = await self.prompts.encode_chat(messages)
        prep = self._prepare(body, request, prompt_ids, params, arrival, model, "chatcmpl")
        return await self._generate(prep, request, ChatFormatter(prep.info))

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        model = self._check_model(body.model)
        check_unsupported(body)
        params = build_sampling_params(body, body.max_tokens, self.max_tokens_limit)
        prompt = completion_prompt(body.prompt)
        if isinstance(prompt, str):
            if self.prompts is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: pass the prompt as token ids", param="prompt"
                )
            prompt_ids = await self.prompts.encode_prompt(prompt)
        else:
            prompt_ids = list(prompt)
        prep = self._prepare(body, request, prompt_ids, params, arrival, model, "cmpl")
        return await self._generate(prep, request, CompletionFormatter(prep.info))

    # ---- checks -----------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> str:
        """The requested model name, or 404 (api.model_routing)."""
        return self.router.resolve(name)

    def _prepare(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        request: Request,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: float,
        model: str,
        id_prefix: str,
    ) -> Prepared:
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        header_mode = request.headers.get(SPECULATIVE_HEADER)
        backend = self.router.route(
            model, len(prompt_ids), params.max_tokens, body.speculative, header_mode
        )
        params = fill_max_tokens(
            params, len(prompt_ids), backend.max_model_len, self.max_tokens_limit
        )
        backend.engine.engine.check_lengths(len(prompt_ids), params)
        assignment = backend.assigner.assign(body.speculative, header_mode)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        info = ResponseInfo(
            response_id=request_id,
            created=int(time.time()),
            model=backend.name,
            arm=assignment.arm,
            mode=assignment.mode,
            num_prompt_tokens=len(prompt_ids),
        )
        return Prepared(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            backend=backend,
            assignment=assignment,
            stream=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            arrival_time=arrival,
            info=info,
        )

    # ---- generation -------------------------------------------------------------------------
    async def _generate(self, prep: Prepared, request: Request, formatter) -> Response:
        engine = prep.backend.engine
        stream = await engine.add_request(
            prep.request_id,
            prep.prompt_ids,
            prep.params,
            prep.assignment.mode,
            arrival_time=prep.arrival_time,
        )
        tracker = self.metrics.tracker(
            prep.assignment.arm, prep.arrival_time, len(prep.prompt_ids), prep.backend.name
        )
        headers = {ARM_HEADER: prep.assignment.arm, MODEL_HEADER: prep.backend.name}
        if prep.stream:

            async def on_disconnect(message) -> None:
                # Also covers a client gone before the first event, when the event generator
                # never started and so never reaches its own clean-up.
                engine.abort(prep.request_id)

            return EventSourceResponse(
                self._events(prep, stream, tracker, formatter),
                headers=headers,
                sep="\n",
                ping=15,
                client_close_handler_callable=on_disconnect,
            )
        final = await self._collect(prep, stream, tracker, request)
        if final is None:  # the client is gone; nobody will read this
            return Response(status_code=499)
        return JSONText(formatter.response(final), headers=headers)

    def _deadline(self, prep: Prepared) -> float | None:
        timeout = self.settings.request_timeout_s
        return None if timeout is None else prep.arrival_time + timeout

    def _timeout_error(self) -> APIError:
        return APIError(
            503,
            f"the request did not finish within {self.settings.request_timeout_s} s and was "
            f"aborted",
            type="service_unavailable",
            code="request_timeout",
        )

    async def _collect(
        self, prep: Prepared, stream: RequestStream, tracker: RequestTracker, request: Request
    ):
        async def consume():
            async for out in stream:
                tracker.observe(out)
                if out.finished:
                    return out
            return None

        consumer = asyncio.ensure_future(consume())
        disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
        deadline = self._deadline(prep)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            done, _ = await asyncio.wait(
                {consumer, disconnect}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            disconnect.cancel()
            if not consumer.done():
                consumer.cancel()
                prep.backend.engine.abort(prep.request_id)
        if consumer in done:
            try:
                return consumer.result()
            except SpecdecError:
                tracker.finish("error")
                raise
        if disconnect in done:
            tracker.finish("abort")
            return None
        tracker.finish("timeout")
        raise self._timeout_error()

    async def _events(
        self, prep: Prepared, stream: RequestStream, tracker: RequestTracker, formatter
    ) -> AsyncIterator[str]:
        finished = False
        reason = "abort"  # what the metrics record if the stream ends early
        deadline = self._deadline(prep)
        try:
            for chunk in formatter.opening_chunks():
                yield dumps(chunk)
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                out = await asyncio.wait_for(stream.get(), timeout)
                tracker.observe(out)
                if out.new_text or out.finished:
                    yield dumps(formatter.delta_chunk(out))
                if out.finished:
                    finished = True
                    if prep.include_usage:
                        yield dumps(formatter.usage_chunk(out))
                    break
        except asyncio.TimeoutError:
            reason = "timeout"
            yield dumps(self._timeout_error().body())
        except EngineDeadError as exc:
            reason = "error"
            yield dumps(APIError.from_engine(exc).body())
        finally:
            if not finished:
                # Disconnect (the task is cancelled at an await), timeout or engine failure.
                prep.backend.engine.abort(prep.request_id)
                tracker.finish(reason)
        yield "[DONE]"


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is already read, so only that can come)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
