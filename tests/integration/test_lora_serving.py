"""Multi-LoRA through the service on the default model: three seeded random PEFT adapters
(written as PEFT writes them) and the base, interleaved in one batch through gRPC (`adapter`)
and the OpenAI API (`model`), with fewer device slots than adapters (--max-loras 2: slots are
reloaded): greedy ids equal HF transformers on the merged weights (W + scale * B @ A). The
prefix cache keeps adapters apart; names the server does not serve are refused; a bad adapter
stops the start with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from tests.executor_svc.test_lora_adapters import merged, write_adapter
from tests.integration.service import Service

ADAPTERS = {  # name: (seed, rank, targets, alpha, rsLoRA)
    "alpha": (1, 8, ["q_proj", "v_proj"], 16, False),
    "beta": (2, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"], 8, True),
    "gamma": (3, 4, ["o_proj", "gate_proj", "down_proj"], 8, False),
}
MAX_TOKENS = 10
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_model):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(root / name, hf_model, seed, rank, targets, alpha, rslora,
                                std=0.03)
            for name, (seed, rank, targets, alpha, rslora) in ADAPTERS.items()}


@pytest.fixture(scope="module")
def lora_service(tmp_path_factory, adapters, model_dir):
    svc = Service(tmp_path_factory.mktemp("lora") / "serve.log", "--enable-lora",
                  "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()),
                  "--max-loras", "2", "--max-lora-rank", "16", "--max-num-seqs", "16",
                  "--allow-runtime-lora-updating", "--api-server-count", "2")
    svc.wait_serving()
    yield svc
    assert svc.stop() == 0


@pytest.fixture(scope="module")
def expected(hf_model, adapters, tokenizer):
    """HF's greedy ids for every (model, prompt): the base and each adapter merged."""
    models = {"": hf_model, **{n: merged(hf_model, p) for n, p in adapters.items()}}
    out = {}
    for name, model in models.items():
        for text in PROMPTS:
            ids = tokenizer(text)["input_ids"]
            with torch.no_grad():
                gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                                     do_sample=False, pad_token_id=2)
            out[name, text] = (ids, gen[0, len(ids):].tolist())
    for text in PROMPTS:  # each adapter changes what the base says
        assert len({tuple(out[n, text][1]) for n in models}) > 1
    return out


def http(svc, path: str, body: dict | None = None, raw: bool = False):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(svc.http_url + path, data,
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode() if raw else json.load(r)


def refused(svc, path: str, body: dict) -> tuple[int, str]:
    with pytest.raises(urllib.error.HTTPError) as e:
        http(svc, path, body)
    return e.value.code, json.loads(e.value.read())["error"]["message"]


def test_adapters_and_the_base_in_one_batch_equal_hf_on_merged_weights(lora_service,
                                                                       expected, tokenizer):
    """Every (model, prompt) at once, half through gRPC and half through HTTP: 12 requests of
    three adapters and the base on two device slots."""
    def grpc_run(name, text):
        ids, _ = expected[name, text]
        return lora_service.client.complete(token_ids=ids, max_tokens=MAX_TOKENS,
                                            temperature=0, adapter=name)[1]

    def http_run(name, text):
        ids, _ = expected[name, text]
        body = {"model": name or "default", "prompt": ids, "max_tokens": MAX_TOKENS,
                "temperature": 0}
        return http(lora_service, "/v1/completions", body)["choices"][0]["text"]

    jobs = [(run, name, text) for i, (name, text) in enumerate(sorted(expected))
            for run in ((grpc_run, http_run)[i % 2],)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: j[0](j[1], j[2]), jobs))
    for (run, name, text), out in zip(jobs, got, strict=True):
        want = expected[name, text][1]
        if run is http_run:  # the API's text: the ids decoded
            want = tokenizer.decode(want, skip_special_tokens=True)
        assert out == want, (name, text)
    m = lora_service.metrics()  # each adapter's requests counted under its name
    for name in ADAPTERS:
        assert sum(v for k, v in m.items() if k.startswith(
            "pagedserve_lora_request_success_total{") and f'lora_name="{name}"' in k) == \
            len(PROMPTS)
    assert any(k.startswith("pagedserve_lora_requests_info{") for k in m)


def test_the_prefix_cache_keeps_adapters_apart(lora_service, tokenizer):
    prompt = "A long shared system prompt. " * 12  # some full blocks

    def cached(model):
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        return http(lora_service, "/v1/completions", body)["usage"]["prompt_tokens_details"][
            "cached_tokens"]

    assert cached("alpha") == 0
    assert cached("alpha") > 0  # the same prompt, the same adapter: its blocks
    assert cached("beta") == 0  # another adapter's KV differs: nothing shared
    assert cached("default") == 0


def test_the_official_sdk_lists_and_selects_adapters(lora_service, expected, tokenizer):
    from openai import OpenAI

    sdk = OpenAI(base_url=lora_service.http_url + "/v1", api_key="unused")
    assert sorted(m.id for m in sdk.models.list()) == ["alpha", "beta", "default", "gamma"]
    ids, want = expected["beta", PROMPTS[0]]
    out = sdk.completions.create(model="beta", prompt=ids, max_tokens=MAX_TOKENS,
                                 temperature=0)
    assert out.model == "beta"
    assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)


def test_the_adapters_are_listed_and_unknown_names_refused(lora_service, adapters):
    cards = {c["id"]: c for c in http(lora_service, "/v1/models")["data"]}
    assert sorted(cards) == ["alpha", "beta", "default", "gamma"]
    assert cards["beta"]["parent"] == "default" and cards["beta"]["root"] == str(
        adapters["beta"])
    assert list(lora_service.client.model_info().lora_adapters) == ["alpha", "beta", "gamma"]
    with pytest.raises(urllib.error.HTTPError) as e:
        http(lora_service, "/v1/completions", {"model": "delta", "prompt": "Hi"})
    assert e.value.code == 404 and "'delta' does not exist" in e.value.read().decode()
    with pytest.raises(grpc.RpcError) as e:
        lora_service.client.complete("Hi", max_tokens=2, adapter="delta")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "adapter: unknown LoRA adapter 'delta'" in e.value.details()


def test_adapters_unloaded_and_loaded_at_run_time(lora_service, adapters, expected,
                                                   tokenizer):
    """Through the two API processes: an unloaded adapter is gone from every one (its name
    404s); loaded again (a new id: no block of the old one's is reused) it serves HF's merged
    tokens over gRPC and HTTP; bad loads and unloads are refused with the reason and change
    nothing."""
    svc = lora_service
    assert http(svc, "/v1/unload_lora_adapter", {"lora_name": "gamma"}, raw=True) == \
        "Success: LoRA adapter 'gamma' removed successfully."
    for _ in range(4):  # new connections: either API process
        assert "gamma" not in {c["id"] for c in http(svc, "/v1/models")["data"]}
        assert refused(svc, "/v1/completions", {"model": "gamma", "prompt": "Hi"})[0] == 404
    assert http(svc, "/v1/load_lora_adapter", {"lora_name": "gamma",
                                               "lora_path": str(adapters["gamma"])}, raw=True) \
        == "Success: LoRA adapter 'gamma' added successfully."  # again: a new id
    for text in PROMPTS:
        ids, want = expected["gamma", text]
        assert svc.client.complete(token_ids=ids, max_tokens=MAX_TOKENS, temperature=0,
                                   adapter="gamma")[1] == want
        body = {"model": "gamma", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
        assert http(svc, "/v1/completions", body)["choices"][0]["text"] == \
            tokenizer.decode(want, skip_special_tokens=True)
    bad = svc.log_path.parent / "missing"
    assert refused(svc, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(bad)}) \
        == (400, f"LoRA adapter 'x' ({bad}): no adapter_config.json")
    assert refused(svc, "/v1/load_lora_adapter", {"lora_name": "gamma",
                                                  "lora_path": str(adapters["gamma"])}) == \
        (400, "LoRA adapter 'gamma' is already loaded")
    assert refused(svc, "/v1/unload_lora_adapter", {"lora_name": "delta"}) == \
        (404, "LoRA adapter 'delta' is not loaded")
    assert refused(svc, "/v1/load_lora_adapter", {"lora_name": "x"}) == \
        (400, "lora_path: Field required")
    assert refused(svc, "/v1/unload_lora_adapter", {"lora_name": ""})[0] == 400
    assert sorted(c["id"] for c in http(svc, "/v1/models")["data"]) == \
        ["alpha", "beta", "default", "gamma"]


def test_a_bad_adapter_stops_the_start_with_the_reason(adapters):
    run = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--port", "0",
                          "--http-port", "0", "--metrics-port", "0", "--enable-lora",
                          "--lora-modules", f"beta={adapters['beta']}", "--max-lora-rank", "8"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode != 0
    assert "rank 16 is more than --max-lora-rank 8" in run.stdout + run.stderr


@pytest.mark.slow
def test_an_executor_restarted_is_given_the_adapters_loaded_at_run_time(lora_service, expected):
    """gamma was unloaded and loaded again (a new id, not in --lora-modules); after the
    executor is killed -9, the one serve starts is given it before its first step."""
    import psutil

    svc = lora_service
    [executor] = [p for p in psutil.Process(svc.proc.pid).children(recursive=True)
                  if "executor" in p.cmdline()]
    executor.kill()
    executor.wait(30)
    deadline = time.monotonic() + 180
    while True:  # readiness drops once the link notices, then returns with the new executor
        try:
            ids, want = expected["gamma", PROMPTS[0]]
            got = svc.client.complete(token_ids=ids, max_tokens=MAX_TOKENS, temperature=0,
                                      adapter="gamma")[1]
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline
            time.sleep(1)
    assert got == want
    assert [p.pid for p in psutil.Process(svc.proc.pid).children(recursive=True)
            if "executor" in p.cmdline()] != [executor.pid]


@pytest.mark.slow
def test_an_engine_core_restarted_is_given_the_adapters_loaded_at_run_time(lora_service,
                                                                          adapters, expected):
    """An adapter loaded at run time under a name of its own lives in the engine core's
    memory only: after the engine core is killed -9 mid-stream, the API processes load it
    into the new one before resubmitting, so the stream completes with HF's merged tokens
    and both processes list it."""
    import psutil

    from pagedserve.client import build_request

    svc = lora_service
    assert http(svc, "/v1/load_lora_adapter", {"lora_name": "late",
                                               "lora_path": str(adapters["gamma"])}, raw=True) \
        == "Success: LoRA adapter 'late' added successfully."
    [engine] = [p for p in psutil.Process(svc.proc.pid).children()
                if p.cmdline()[p.cmdline().index("pagedserve.cli") + 3] == "engine"]
    ids, want = expected["gamma", PROMPTS[1]]
    stream = svc.client.stub.Generate(build_request(token_ids=ids, max_tokens=MAX_TOKENS,
                                                    temperature=0, adapter="late"), timeout=180)
    got = list(next(stream).token_ids)
    engine.kill()
    for chunk in stream:
        got.extend(chunk.token_ids)
    assert got == want
    for _ in range(4):  # new connections: either API process
        assert "late" in {c["id"] for c in http(svc, "/v1/models")["data"]}
    assert "loading LoRA adapters ['late'] again" in svc.log_path.read_text()
