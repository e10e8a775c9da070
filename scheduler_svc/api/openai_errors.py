"""OpenAI's error object, raised anywhere in the HTTP API and sent by openai_api's handler."""

from __future__ import annotations

from typing import Any

STATUS = {  # an EngineError's gRPC code -> (HTTP status, OpenAI error type)
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "invalid_request_error"),
    "ALREADY_EXISTS": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "INTERNAL": (500, "server_error"),
}


class OpenAIError(Exception):
    """An error the client gets as {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    @classmethod
    def from_grpc(cls, code: str, message: str, retry_after_s: float | None = None
                  ) -> OpenAIError:
        status, _ = STATUS.get(code, (500, "server_error"))
        return cls(status, message, code=code.lower(), retry_after_s=retry_after_s)

    def body(self) -> dict[str, Any]:
        kind = next((t for s, t in STATUS.values() if s == self.status),
                    "invalid_request_error" if 400 <= self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}
