"""--chat-template: a Jinja chat template replacing the tokenizer's (a base model's missing
one, a fixed or a house template), as vLLM's flag takes it: a file's path, or the template
itself where the value holds Jinja's characters."""

from __future__ import annotations

from pathlib import Path

JINJA_CHARS = "{}\n"


class ChatTemplateError(ValueError):
    """A --chat-template that cannot be read or parsed."""


def read_chat_template(value: str) -> str:
    """The template `value` names: its text when it holds one of JINJA_CHARS, else the
    contents of the file at that path; ChatTemplateError when the file cannot be read or the
    template is not valid Jinja (checked at start, not at a client's first request)."""
    if any(c in value for c in JINJA_CHARS):
        template = value
    else:
        try:
            template = Path(value).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e  # (a decode error has no strerror)
            raise ChatTemplateError(f"--chat-template {value!r} is neither a readable file nor "
                                    f"a template ({type(e).__name__}: {why})") from None
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"--chat-template: line {e.lineno}: {e.message}") from None
    return template
