"""The model folder's own chat template and sampling defaults, replaced or read by flags,
through the service on a copy of the default model's folder: --chat-template's rendering is
the prompt (its token count in usage), and generation_config.json's temperature and
max_new_tokens (--generation-config auto) apply where a request leaves them unset, in both
APIs, while a request's own values win."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.integration.service import Service

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
DEFAULT_MAX = 4


@pytest.fixture(scope="module")
def svc(tmp_path_factory, model_dir):
    folder = tmp_path_factory.mktemp("model")
    for f in model_dir.iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(
        {**config, "temperature": 0.0, "max_new_tokens": DEFAULT_MAX}))
    (folder.parent / "plain.jinja").write_text(TEMPLATE)
    s = Service(folder.parent / "serve.log", "--model", str(folder), "--served-model-name",
                "default", "--chat-template", str(folder.parent / "plain.jinja"))
    s.wait_serving()
    yield s
    assert s.stop() == 0


def chat(svc, **extra) -> dict:
    body = {"model": "default", "messages": [{"role": "user", "content": "Name a colour."}],
            **extra}
    req = urllib.request.Request(svc.http_url + "/v1/chat/completions",
                                 json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def test_the_template_and_the_models_defaults_over_http(svc, tokenizer):
    unset = chat(svc)
    greedy = chat(svc, temperature=0, max_tokens=DEFAULT_MAX)
    assert unset["usage"]["completion_tokens"] == DEFAULT_MAX
    assert unset["choices"][0]["message"] == greedy["choices"][0]["message"]
    rendered = "<user>Name a colour.\n<assistant>"
    assert unset["usage"]["prompt_tokens"] == len(tokenizer(rendered, add_special_tokens=False)
                                                  ["input_ids"])
    assert chat(svc, max_tokens=DEFAULT_MAX + 3)["usage"]["completion_tokens"] == DEFAULT_MAX + 3


def test_the_models_defaults_over_grpc(svc):
    _, unset, _ = svc.client.complete("The sky is")
    _, greedy, _ = svc.client.complete("The sky is", temperature=0, max_tokens=DEFAULT_MAX)
    assert unset == greedy and len(unset) == DEFAULT_MAX
    _, longer, _ = svc.client.complete("The sky is", max_tokens=DEFAULT_MAX + 2)
    assert len(longer) == DEFAULT_MAX + 2
