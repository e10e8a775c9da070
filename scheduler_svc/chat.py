"""Chat messages -> prompt token ids through the model's chat template, with the messages
treated as untrusted: a role must be one the template knows, and text in a message that spells
a special token (`<|im_start|>system`) stays text instead of becoming that token.
"""

from __future__ import annotations

import re
from typing import Any

STANDARD_ROLES = ("system", "user", "assistant", "tool")
# a role the template names, e.g. message['role'] == 'system' or message.role == "ipython"
_TEMPLATE_ROLE = re.compile(r"""role\W{0,3}\s*(?:==|!=)\s*["']([A-Za-z_][\w-]*)["']""")
_SLOT = "\ue000{}\ue001"  # stands for message i's content while the template renders


class ChatError(ValueError):
    """A client's chat messages the template cannot take; the message names the field."""


class ChatRenderer:
    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        template = tokenizer.chat_template or ""
        if isinstance(template, dict):  # named templates
            template = " ".join(template.values())
        self.roles = frozenset(STANDARD_ROLES) | set(_TEMPLATE_ROLE.findall(template))
        self.special = sorted((t.content for t in tokenizer.added_tokens_decoder.values()
                               if t.special), key=len, reverse=True)

    def encode(self, messages: list[tuple[str, str]]) -> list[int]:
        if not messages:
            raise ChatError("chat.messages: at least one message is required")
        for i, (role, _) in enumerate(messages):
            if role not in self.roles:
                raise ChatError(f"chat.messages[{i}].role: {role!r} is not a role of this "
                                f"model's chat template ({', '.join(sorted(self.roles))})")
        if any(s in content for _, content in messages for s in self.special):
            return self._encode_as_text(messages)
        ids = self._render(messages, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def _render(self, messages: list[tuple[str, str]], tokenize: bool) -> Any:
        msgs = [{"role": r, "content": c} for r, c in messages]
        try:
            return self.tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                tokenize=tokenize)
        except Exception as e:  # template errors (bad order, ...) are the client's
            raise ChatError(f"chat.messages: the chat template rejected them: {e}") from e

    def _encode_as_text(self, messages: list[tuple[str, str]]) -> list[int]:
        """The template's own text tokenized as usual, each message's content with special
        tokens split into plain text (what HF tokenizers do for untrusted text)."""
        slots = [(r, _SLOT.format(i)) for i, (r, _) in enumerate(messages)]
        rendered = self._render(slots, tokenize=False)
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
            ids += self.tok(messages[i][1], add_special_tokens=False,
                            split_special_tokens=True)["input_ids"]
        if sorted(seen) != list(range(len(messages))):
            raise ChatError("chat.messages: a message spells a special token, and this model's "
                            "template does not pass message text through unchanged")
        return ids
