"""The gRPC servicer's Tokenize against the real tokenizer: work in proportion to the input
stays off the event loop."""

import asyncio
import threading

from pagedserve.protos.v1 import generate_pb2 as api
from pagedserve.scheduler.api.frontend import Frontend
from pagedserve.scheduler.api.inputs import InputProcessor
from pagedserve.scheduler.api.servicer import GenerationServicer
from pagedserve.scheduler.api.streams import OutputProcessor
from pagedserve.scheduler.engine import Engine
from pagedserve.scheduler.engine_client import EngineClient
from pagedserve.scheduler.executor_link import ExecutorLink
from pagedserve.scheduler.scheduler import SchedulerConfig


class Spy:
    """The tokenizer, recording the threads that turn ids into token strings."""

    def __init__(self, tok) -> None:
        self._tok, self.threads = tok, []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def convert_ids_to_tokens(self, ids):
        self.threads.append(threading.get_ident())
        return self._tok.convert_ids_to_tokens(ids)


class NoMetadata:
    def invocation_metadata(self):
        return ()


def test_tokenize_turns_ids_into_tokens_off_the_event_loop(tokenizer):
    spy = Spy(tokenizer)
    text = "The capital of France is Paris. " * 2000  # 64 KB: a large input

    async def tokenize():
        engine = Engine(SchedulerConfig(), ExecutorLink("inproc://unused"), tokenizer, [])
        frontend = Frontend(OutputProcessor(EngineClient(engine), spy),
                            InputProcessor(spy, model_len=8192))
        servicer = GenerationServicer(frontend, "m")
        try:
            return await servicer.Tokenize(api.TokenizeRequest(text=text), NoMetadata()), \
                threading.get_ident()
        finally:
            await engine.close()

    out, loop_thread = asyncio.run(tokenize())
    ids = tokenizer.encode(text)
    assert list(out.token_ids) == ids
    assert list(out.tokens) == tokenizer.convert_ids_to_tokens(ids)
    assert len(spy.threads) == 1 and spy.threads[0] != loop_thread
