"""The client error every validation raises: one type, the field it concerns as a path into
the GenerateRequest (sampling.top_p, chat.messages[0].content, token_ids), and why. The gRPC
API sends str() ('sampling.top_p: must be in (0, 1], got 1.5'); the OpenAI API names the
field as its own parameter (openai_protocol.invalid), the Responses API as its own."""

from __future__ import annotations


class InvalidRequest(ValueError):
    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason
