"""AsyncLLM: the engine loop on a background thread, a stream of outputs per request.

The step is CPU-heavy, blocking work, so it runs on its own thread, and only that thread
touches the engine. The asyncio side sends it operations (add, abort) through a queue with a
future each, so a bad request raises its ValueError in the caller (nothing is queued), an abort
can never race a step, and the event loop is never blocked by a step.
"""

from __future__ import annotations

import asyncio
import logging
import queue as queue_mod
import threading
import uuid
from collections.abc import AsyncIterator

from jaxllm.config import EngineArgs
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.outputs import EmbeddingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger("jaxllm")


class EngineDeadError(RuntimeError):
    """The engine loop crashed; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine step computing this request failed; the engine goes on serving the others."""


class AsyncLLM:
    """`on_dead(error)`, if given, is called (on the engine thread) once the engine loop has died;
    by then every open stream and pending call has been failed with `EngineDeadError`."""

    def __init__(
        self, engine_args: EngineArgs | None = None, *, engine: LLMEngine | None = None, on_dead=None, **kwargs
    ):
        self.engine = engine or LLMEngine(engine_args or EngineArgs(**kwargs))
        self._ops: queue_mod.SimpleQueue = queue_mod.SimpleQueue()  # (fn, loop, future, kind)
        # Operations that wait for the engine to be idle ("wait" weight updates, sleep), and the
        # requests held back meanwhile (admitted once those have run).
        self._idle_ops: list = []
        self._held: list = []
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Held while registering a stream or queueing a call, and while the dying loop fails them
        # all: nothing registered can be missed, nothing registered later can wait forever.
        self._lock = threading.Lock()
        self._stopped = False
        self.dead_error: BaseException | None = None
        self.on_dead = on_dead
        self._thread = threading.Thread(target=self._loop, name="jaxllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead_error is None

    @property
    def num_unfinished_requests(self) -> int:
        """Requests with an open stream (queued or running)."""
        return len(self._streams)

    def _run_ops(self) -> None:
        while True:
            try:
                entry = self._ops.get_nowait()
            except queue_mod.Empty:
                break
            kind = entry[3]
            if kind == "idle":
                self._idle_ops.append(entry)
            elif kind == "add" and self._idle_ops:
                self._held.append(entry)
            else:
                self._run(entry)
        if self._idle_ops and not self.engine.has_unfinished_requests():
            ops, held, self._idle_ops, self._held = self._idle_ops, self._held, [], []
            for entry in (*ops, *held):
                self._run(entry)

    @staticmethod
    def _run(entry) -> None:
        fn, loop, future, _ = entry
        try:
            result, error = fn(), None
        except Exception as e:
            result, error = None, e
        if future is not None:
            _post(loop, _settle, future, result, error)

    def _publish(self, outputs) -> None:
        """Hand outputs made outside a step (an update's aborts, its settled step) to their streams."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                _post(stream[0], stream[1].put_nowait, out)

    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._run_ops()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(0.05)
                    self._wakeup.clear()
                    continue
                self._publish(self.engine.step())
        except BaseException as e:  # a failure beyond what the engine core recovers from
            self._die(e)

    def _die(self, error: BaseException) -> None:
        """Fail every stream and every queued call; no handler is left waiting."""
        logger.critical("the engine loop has stopped; failing %d open request(s)", len(self._streams), exc_info=error)
        with self._lock:
            self.dead_error = error
            for loop, queue in list(self._streams.values()):
                _post(loop, queue.put_nowait, error)
            pending, self._idle_ops, self._held = [*self._idle_ops, *self._held], [], []
            while True:
                try:
                    pending.append(self._ops.get_nowait())
                except queue_mod.Empty:
                    break
            for _, loop, future, _ in pending:
                if future is not None:
                    _post(loop, _settle, future, None, self._dead())
        if self.on_dead is not None:
            self.on_dead(error)

    def _dead(self) -> EngineDeadError:
        error = EngineDeadError("the engine loop has stopped")
        error.__cause__ = self.dead_error
        return error

    async def _call(self, fn, kind: str = "op"):
        """Run `fn` on the engine thread between steps; return its result or raise its error.
        kind "add": a new request (held back while an "idle" operation waits); "idle": once no
        request is unfinished, new ones held back until it has run."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self.dead_error is not None:
                raise self._dead()
            self._ops.put((fn, loop, future, kind))
        self._wakeup.set()
        return await future

    async def generate(
        self,
        prompt: str | list[int] | dict,
        sampling_params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        *,
        output_kind: str = "cumulative",
        priority: int = 0,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        """Yield outputs as the request progresses (cumulative by default, or `output_kind=
        "delta"` for just the new tokens/text; `priority` and `lora_request` as
        `LLMEngine.add_request`'s). Leaving the loop early aborts the request.
        (With PoolingParams, on a pooling engine: `encode`.)"""
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        token_ids = None
        if isinstance(prompt, dict):
            prompt, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        with self._lock:
            if self.dead_error is not None:
                raise self._dead()
            if request_id in self._streams:  # checked here: an "in use" error must not abort the first one
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        try:
            if isinstance(sampling_params, SamplingParams) and sampling_params.structured_outputs is not None:
                # Compile the grammar here, off the event loop and the engine thread (a large one
                # takes a while; the backend releases the GIL): add_request finds it cached.
                await asyncio.to_thread(self.engine.structured_output.compile, sampling_params.structured_outputs)
            if lora_request is not None:  # read from disk here, off the engine thread: add_request finds it cached
                await asyncio.to_thread(self.engine.add_lora, lora_request)
            await self._call(
                lambda: self.engine.add_request(
                    request_id,
                    prompt,
                    sampling_params,
                    prompt_token_ids=token_ids,
                    output_kind=output_kind,
                    priority=priority,
                    lora_request=lora_request,
                ),
                kind="add",
            )
        except BaseException:
            self._streams.pop(request_id, None)
            await self.abort(request_id)  # in case the add went through before a cancel
            raise
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise self._dead()
                finished = out.finished
                if "error" in out.finish_reasons:
                    raise RequestFailedError(
                        f"the engine failed while computing request {request_id!r} "
                        f"(logged on the server); other requests are unaffected"
                    )
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort without waiting for the engine thread (safe from a cancelled task)."""
        self._ops.put((lambda: self.engine.abort_request(request_id), None, None, "op"))
        self._wakeup.set()

    async def run_on_engine(self, fn):
        """Run `fn(engine)` on the engine thread between steps (e.g. to read its state)."""
        return await self._call(lambda: fn(self.engine))

    async def update_weights(self, weights, *, version: int | str | None = None, in_flight: str = "keep") -> None:
        """`LLMEngine.update_weights` on the engine thread. "wait": new requests are held back
        until every request in flight has finished and the weights are replaced; "abort" ends
        the streams in flight (finish reason "abort"); "keep" lets them go on with the new weights."""
        engine = self.engine
        if in_flight == "wait":
            await self._call(lambda: self._publish(engine.update_weights(weights, version=version)), kind="idle")
        else:
            await self._call(
                lambda: self._publish(engine.update_weights(weights, version=version, in_flight=in_flight))
            )

    async def update_lora(self, lora_request, tensors, config: dict | None = None) -> None:
        """`LLMEngine.update_lora`: the tensors read and laid out off the engine thread, then the
        requests under the adapter switched on it."""
        adapter = await asyncio.to_thread(self.engine._updated_lora, lora_request, tensors, config)
        await self._call(lambda: self._publish(self.engine._serve_updated_lora(adapter)))

    async def sleep(self, level: int = 1) -> None:
        """`LLMEngine.sleep` once the requests in flight have finished (new ones wait meanwhile,
        and are refused while the engine sleeps)."""
        await self._call(lambda: self.engine.sleep(level), kind="idle")

    async def wake_up(self) -> None:
        await self._call(self.engine.wake_up)

    async def encode(
        self, prompt: str | list[int] | dict, pooling_params: PoolingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[EmbeddingRequestOutput]:
        """A pooling engine's request (vLLM's `encode`): yields its one output, the embedding."""
        async for out in self.generate(prompt, pooling_params or PoolingParams(), request_id, output_kind="final"):
            yield out

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.engine.shutdown()  # over several processes: release the followers


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run `fn(*args)` on `loop` (from the engine thread); a closed loop has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
