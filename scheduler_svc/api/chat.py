"""Chat messages -> prompt token ids through the model's chat template, with the messages
treated as untrusted: a role must be one the template knows, and text in a message that spells
a special token (`<|im_start|>system`) stays text instead of becoming that token.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.scheduler.api.tools import calls_text, fallback_system
from pagedserve.scheduler.invalid import InvalidRequest

STANDARD_ROLES = ("system", "user", "assistant", "tool")
# a role the template names, e.g. message['role'] == 'system' or message.role == "ipython"
_TEMPLATE_ROLE = re.compile(r"""role\W{0,3}\s*(?:==|!=)\s*["']([A-Za-z_][\w-]*)["']""")
_SLOT = "\ue000{}\ue001"  # stands for message i's content while the template renders


class ChatError(InvalidRequest):
    """A client's chat messages the template cannot take."""


class ChatRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        template = tokenizer.chat_template or ""
        if isinstance(template, dict):  # named templates
            template = " ".join(template.values())
        self.roles = frozenset(STANDARD_ROLES) | set(_TEMPLATE_ROLE.findall(template))
        # templates that render tools / past calls themselves (Qwen's, Llama 3.1's, Hermes')
        self.takes_tools = re.search(r"\btools\b", template) is not None
        self.takes_calls = re.search(r"\btool_calls\b", template) is not None
        self.special = sorted((t.content for t in tokenizer.added_tokens_decoder.values()
                               if t.special), key=len, reverse=True)

    def encode(self, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        """messages: {"role", "content"} and, from tools.py, "tool_calls" / "tool_call_id"."""
        if not messages:
            raise ChatError("chat.messages", "at least one message is required")
        for i, m in enumerate(messages):
            if m["role"] not in self.roles:
                raise ChatError(f"chat.messages[{i}].role", f"{m['role']!r} is not a role of this "
                                f"model's chat template ({', '.join(sorted(self.roles))})")
        messages, tools = self._with_tools(messages, tools)
        if any(s in m["content"] for m in messages for s in self.special):
            return self._encode_as_text(messages, tools)
        ids = self._render(messages, tools, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def _with_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Tools and calls where the template takes them, else as text (tools.py's fallback);
        JSON the template renders itself cannot go through _encode_as_text's slots, so a
        special token spelt there is refused."""
        out = []
        for m in messages:
            calls = m.get("tool_calls")
            if calls and not self.takes_calls:
                text = calls_text(calls)
                m = {**m, "content": f"{m['content']}\n{text}" if m["content"] else text}
                del m["tool_calls"]
            out.append(m)
        if tools and not self.takes_tools:
            block = fallback_system(tools)
            if out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
            else:
                out.insert(0, {"role": "system", "content": block})
            tools = None
        native = json.dumps([tools or [], [m.get("tool_calls") for m in out]],
                            ensure_ascii=False)
        if any(s in native for s in self.special):
            raise ChatError("chat.tools", "a tool or a tool call spells a special token")
        return out, tools or None

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                tokenize: bool) -> Any:
        try:
            return self.tok.apply_chat_template(messages, tools=tools,
                                                add_generation_prompt=True, tokenize=tokenize)
        except Exception as e:  # template errors (bad order, ...) are the client's
            raise ChatError("chat.messages", f"the chat template rejected them: {e}") from e

    def _encode_as_text(self, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None) -> list[int]:
        """The template's own text tokenized as usual, each message's content with special
        tokens split into plain text (what HF tokenizers do for untrusted text)."""
        slots = [{**m, "content": _SLOT.format(i)} for i, m in enumerate(messages)]
        rendered = self._render(slots, tools, tokenize=False)
        parts = re.split("(\ue000\\d+\ue001)", rendered)
        ids: list[int] = []
        seen = []
        for part in parts:
            m = re.fullmatch("\ue000(\\d+)\ue001", part)
            if m is None:
                ids += self.tok(part, add_special_tokens=False)["input_ids"] if part else []
                continue
            i = int(m.group(1))
            seen.append(i)
            ids += self.tok(messages[i]["content"], add_special_tokens=False,
                            split_special_tokens=True)["input_ids"]
        if sorted(seen) != list(range(len(messages))):
            raise ChatError("chat.messages", "a message spells a special token, and this model's "
                            "template does not pass message text through unchanged")
        return ids
