"""A real Prometheus (Debian's package; scripts/setup.sh installs it) scrapes a running `serve`
under load, and every PromQL expression of the shipped Grafana dashboard returns data, as
Grafana sends it both with a model picked and with All: `$model` resolved from its label query
and escaped as Grafana does, All its allValue. What Prometheus stores, not our registry, is what
the dashboard reads."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest

from pagedserve.client import build_request
from tests.executor_svc.test_lora_adapters import write_adapter
from tests.integration.service import Service, free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/pagedserve.json"
MODEL = "smollm2-135m.instruct"  # a regex character in it: Grafana escapes the value
# Grafana's $__rate_interval with its default 15 s scrape interval is 4 x 15 s; on a slow machine
# the load and the waits below can outlast that, so the test widens the window to cover them
RATE_INTERVAL_S = 60
SYSTEM = ("You are a careful assistant for a library. Answer in one short sentence, name no "
          "sources, and never invent a book, an author or a date. If a question is unclear, "
          "say which part is unclear. Keep a polite and neutral tone in every answer.")
QUESTIONS = ["What is a library?", "What is a book?", "Who writes books?",
             "What is an index?", "What is a shelf?", "What is a catalogue?"]

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="no prometheus binary (scripts/setup.sh installs it)")


class Prometheus:
    def __init__(self, tmp: Path, target: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "pagedserve",
                                "static_configs": [{"targets": [target]}]}]}))
        self.log = open(tmp / "prometheus.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait(self, expr: str, want: float, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while (got := self.value(expr)) != want:
            assert time.monotonic() < deadline, f"{expr} = {got}, not {want}"
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def stack(tmp_path, model_dir, hf_model):
    # n-gram drafts from 1-grams up, and a LoRA adapter one chat uses: the load feeds the
    # speculative-decoding and LoRA panels too
    adapter = write_adapter(tmp_path / "tuned", hf_model, 1, 4, ["q_proj", "v_proj"], 8)
    svc = Service(tmp_path / "serve.log", "--served-model-name", MODEL, "--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
                  "--enable-lora", "--lora-modules", f"tuned={adapter}")
    prom = Prometheus(tmp_path, f"127.0.0.1:{svc.metrics_port}")
    try:
        svc.wait_serving()
        yield svc, prom
    finally:
        prom.stop()
        assert svc.stop() == 0


def drive_load(svc: Service) -> dict[str, str]:
    """Six streams sharing a system prompt, a cancel, a bad request, a deadline; returns the
    status each client saw."""
    seen: dict[str, str] = {}

    def chat(i: int) -> None:
        svc.client.complete(chat=[("system", SYSTEM), ("user", QUESTIONS[i])], max_tokens=16,
                            temperature=0, adapter="tuned" if i == 5 else "")
        seen[f"chat{i}"] = "OK"

    def cancel() -> None:
        call = svc.client.stub.Generate(build_request(text="Count: 1, 2,", max_tokens=400,
                                                      ignore_eos=True), timeout=60)
        next(call), next(call)
        call.cancel()
        seen["cancel"] = "CANCELLED"

    def expire() -> None:
        try:
            list(svc.client.stub.Generate(build_request(text="Count: 1, 2,", max_tokens=400,
                                                        ignore_eos=True), timeout=1.5))
        except grpc.RpcError as e:
            seen["deadline"] = e.code().name

    def bad() -> None:
        try:
            list(svc.client.stub.Generate(build_request(text="hi", top_p=1.5), timeout=30))
        except grpc.RpcError as e:
            seen["bad"] = e.code().name

    def http(name: str, body: dict) -> None:  # the OpenAI API: counted by route and status
        req = urllib.request.Request(svc.http_url + "/v1/chat/completions",
                                     json.dumps({"model": MODEL, **body}).encode(),
                                     {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                seen[name] = str(r.status)
        except urllib.error.HTTPError as e:
            seen[name] = str(e.code)

    question = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 4}
    threads = [threading.Thread(target=f, args=a) for f, a in
               [(chat, (i,)) for i in range(6)] + [(cancel, ()), (expire, ()), (bad, ())] +
               [(http, ("http", question)), (http, ("http_bad", {**question, "top_p": 2}))]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return seen


def grafana_value(variable: dict, picked: list[str] | None, options: list[str]) -> str:
    """A query variable in a regex matcher as Grafana writes it: the values picked (None: All)
    escaped by its Prometheus data source (prometheusSpecialRegexEscape for a multi-value or
    include-All variable, one value bare, several as (a|b)); All is the variable's allValue as
    it stands (Grafana leaves a custom all value unformatted), else every option."""
    if picked is None and variable.get("allValue"):
        return variable["allValue"]
    values = options if picked is None else picked
    if not (variable.get("multi") or variable.get("includeAll")):
        [value] = values
        return value.replace("\\", "\\\\").replace("'", "\\\\'")
    escaped = [re.sub(r"([$^*{}\[\]'+?.()|])", r"\\\\\1", v.replace("\\", "\\\\\\\\"))
               for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def dashboard() -> tuple[list[dict], list[tuple[str, str]]]:
    """The template variables, and every panel query as (panel title / refId, expr)."""
    dash = json.loads(DASHBOARD.read_text())
    queries = [(f'{p["title"]} / {t["refId"]}', t["expr"]) for p in dash["panels"]
               for t in p["targets"]]
    return dash["templating"]["list"], queries


def test_every_dashboard_query_returns_data_from_a_real_prometheus(stack):
    svc, prom = stack
    # rate() over a window needs a sample from before the load: a counter first scraped with
    # its final value shows no increase (all six TTFTs can fall within one batched prefill)
    prom.wait(f'sum(pagedserve_time_to_first_token_seconds_count{{model_name="{MODEL}"}})', 0,
              timeout=60)
    started = time.monotonic()
    assert drive_load(svc) == {**{f"chat{i}": "OK" for i in range(6)}, "cancel": "CANCELLED",
                               "deadline": "DEADLINE_EXCEEDED", "bad": "INVALID_ARGUMENT",
                               "http": "200", "http_bad": "400"}
    sel = f'model_name="{MODEL}"'
    for reason, n in (("abort", 1), ("deadline_exceeded", 1), ("unavailable", 0)):
        prom.wait(f'pagedserve_request_success_total{{{sel}, finished_reason="{reason}"}}', n)
    prom.wait(f'sum(pagedserve_request_success_total{{{sel}, finished_reason=~"stop|length"}})',
              7)
    for code, n in (("OK", 6), ("CANCELLED", 1), ("DEADLINE_EXCEEDED", 1),
                    ("INVALID_ARGUMENT", 1)):
        prom.wait(f'pagedserve_grpc_server_handled_total{{{sel}, grpc_method="Generate", '
                  f'grpc_code="{code}"}}', n)
    for status in ("200", "400"):
        prom.wait(f'pagedserve_http_requests_total{{{sel}, route="/v1/chat/completions", '
                  f'status="{status}"}}', 1)
    prom.wait(f'sum(pagedserve_request_prompt_tokens_count{{{sel}}})', 9)  # all that ran

    # every series the dashboard filters by model carries the label: one without it shows
    # under All (.*) and goes empty with a model picked
    assert prom.query('count by (__name__) ({__name__=~"pagedserve_.+", model_name=""})') == []

    # $model: label_values(metric, label) -> the label's values among that metric's series
    [variable], queries = dashboard()
    assert (variable["name"], variable["type"]) == ("model", "query")
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)",
                                 variable["definition"]).groups()
    models = prom.get(f"/api/v1/label/{label}/values", **{"match[]": metric})
    assert models == [MODEL]
    window = f"{max(RATE_INTERVAL_S, math.ceil(time.monotonic() - started) + 15)}s"
    builtin = {"$__rate_interval": window, "$__interval": "15s", "$__range": window}
    picks = {"picked": grafana_value(variable, models, models),
             "All": grafana_value(variable, None, models)}
    assert picks == {"picked": r"smollm2-135m\\.instruct", "All": ".*"}
    empty, not_finite = [], []
    for pick, value in picks.items():
        for name, expr in queries:
            for var, sub in sorted({**builtin, "$model": value}.items(),
                                   key=lambda kv: -len(kv[0])):  # a longer name first
                expr = expr.replace(var, sub)
            assert "$" not in expr, (name, expr)  # a variable this test does not know
            result = prom.query(expr)
            if not result:
                empty.append((pick, name))
            elif not any(math.isfinite(float(s["value"][1])) for s in result):
                not_finite.append((pick, name))
    assert (empty, not_finite) == ([], [])  # no exceptions: the load feeds every panel
    assert len(queries) >= 52

    # a block shared through the prefix cache holds its tokens once: utilization stays <= 1
    assert prom.value(f'pagedserve_prefix_cache_hits_total{{{sel}}}') > 0
    for gauge in ("kv_cache_token_utilization", "kv_cache_token_utilization_at_peak"):
        assert 0 < prom.value(f'max_over_time(pagedserve_{gauge}{{{sel}}}[5m])') <= 1
    log = [json.loads(line) for line in (svc.log_path.read_text().splitlines())
           if line.startswith('{"event": "request_finished"')]
    assert sorted(r["finish_reason"] for r in log if r["finish_reason"] not in
                  ("stop", "length")) == ["abort", "deadline_exceeded"]
