"""--chat-template (pagedserve/core/chat_template.py): a file or the template itself, checked
at start; the tokenizer the API processes load renders with it."""

import argparse
import asyncio

import pytest

from pagedserve.core.chat_template import ChatTemplateError, read_chat_template
from pagedserve.scheduler.engine_settings import load_tokenizer
from tests.test_cli import pagedserve

PLAIN = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    assert read_chat_template(str(path)) == PLAIN
    assert read_chat_template(PLAIN) == PLAIN  # holds { and }: the template itself


def test_what_cannot_be_used_is_named(tmp_path):
    with pytest.raises(ChatTemplateError, match="'/nonexistent.jinja' is neither a readable "
                                                "file nor a template"):
        read_chat_template("/nonexistent.jinja")
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ChatTemplateError, match="neither a readable file nor a template "
                                                "\\(UnicodeDecodeError"):
        read_chat_template(str(binary))
    with pytest.raises(ChatTemplateError, match="line 2: "):
        read_chat_template("{{ messages }}\n{% for m in messages %}")


def test_the_loaded_tokenizer_renders_with_it(tmp_path):
    args = argparse.Namespace(model="default", tokenizer="", chat_template=PLAIN)
    _, tok = asyncio.run(load_tokenizer(args))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        "<system>Be brief.\n<user>Hi\n<assistant>"


def test_serve_refuses_a_bad_template_in_one_line_before_anything_loads():
    out, _ = pagedserve("serve", "--chat-template", "{% if %}")
    assert out.returncode == 1
    assert out.stderr.strip().startswith("pagedserve serve: --chat-template: line 1: ")
    assert "Traceback" not in out.stderr
