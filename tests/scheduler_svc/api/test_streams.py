"""A stream's chunks under --stream-interval: held tokens of a request without stop strings are
decoded once, when their chunk goes out (host work per message, not per token)."""

from pagedserve.scheduler.api.detokenizer import decoder_of
from pagedserve.scheduler.api.streams import RequestStream
from pagedserve.scheduler.outputs import TokenLogprob
from pagedserve.scheduler.request import GenerationParams, Request

TEXT = "The capital of France is Paris. Ünïcödé: 日本語 🎉 and a few more words to stream here."


def open_stream(tokenizer, calls, **params):
    backend = decoder_of(tokenizer)

    def counting(ids, skip_special_tokens=True):
        calls.append(list(ids))
        return backend(ids, skip_special_tokens=skip_special_tokens)

    return RequestStream.open(1, "r1", [1, 2, 3], GenerationParams(max_tokens=1000, **params),
                              tokenizer, counting)


def test_held_tokens_are_decoded_once_when_their_chunk_goes_out(tokenizer):
    ids = tokenizer.encode(TEXT * 2)[:40]
    calls = []
    stream = open_stream(tokenizer, calls)
    chunks = []
    for i, t in enumerate(ids):
        lp = TokenLogprob(-float(i))
        chunk = stream.push(t, "length" if i == len(ids) - 1 else None, None, 8, lp)
        if chunk is not None:
            chunks.append(chunk)
    assert [len(c.token_ids) for c in chunks] == [1, 7, 8, 8, 8, 8]
    assert [t for c in chunks for t in c.token_ids] == ids
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids, skip_special_tokens=True)
    assert [lp.logprob for c in chunks for lp in c.logprobs] == [-float(i) for i in range(40)]
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 40
    assert len(calls) == 2 * len(chunks) + 2  # two per chunk, two for the flush at the end


def test_a_request_with_stop_strings_is_still_matched_token_by_token(tokenizer):
    ids = tokenizer.encode(TEXT * 2)[:40]
    calls = []
    stream = open_stream(tokenizer, calls, stop=("Paris",))
    chunks = []
    for t in ids:
        chunk = stream.push(t, None, None, 8)
        if chunk is not None:
            chunks.append(chunk)
            if chunk.finish_reason:
                break
    assert "".join(c.text for c in chunks) == "The capital of France is "
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == "Paris"
    assert len(calls) == 2 * sum(len(c.token_ids) for c in chunks)  # each token decoded


class NoScan(dict):
    def values(self):
        raise AssertionError("expire() scanned every open stream")


def test_deadlines_expire_soonest_first_without_scanning_the_open_streams(tokenizer):
    import asyncio

    from pagedserve.scheduler.api.streams import OutputProcessor
    from pagedserve.scheduler.delivery import StreamTable
    from pagedserve.scheduler.engine_io import EngineError
    from pagedserve.scheduler.metrics import Metrics
    from pagedserve.scheduler.telemetry import Telemetry
    from pagedserve.scheduler.tracked import Tracked

    class Client:  # the engine client's side the output processor uses
        def subscribe(self, subscriber):
            self.subscriber = subscriber

    async def main():
        finished = []
        outputs = OutputProcessor(Client(), tokenizer)
        table = StreamTable(Telemetry(Metrics(), tokenizer), finished.append, outputs.deliver)
        table._open = NoScan()
        streams, tracked = {}, {}
        for rid, timeout in [(1, None), (2, -1.0), (3, 3600.0), (4, -2.0), (5, -0.5)]:
            req = Request(rid, f"r{rid}", 3, [1, 2, 3], GenerationParams(max_tokens=4))
            tracked[rid] = Tracked.open(req, timeout)
            table.add(tracked[rid])
            streams[rid] = outputs.open(rid, f"r{rid}", [1, 2, 3], req.params)
        table.leave(tracked[5], "cancelled")  # ended before its deadline came
        table.expire()
        assert finished == [5, 4, 2]  # the cancelled one, then the expired, soonest first
        for rid in (2, 4):
            err = streams[rid].queue.get_nowait()
            assert isinstance(err, EngineError) and err.code == "DEADLINE_EXCEEDED"
        assert streams[1].queue.empty() and streams[3].queue.empty() and len(table) == 2
        table.expire()  # nothing more is due
        assert finished == [5, 4, 2]

    asyncio.run(main())
