"""API errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every invalid input is raised as an `ApiError` before anything reaches the engine; the error
middleware (app.py) turns it into a JSON response, the SSE writer into an error event.
"""

from __future__ import annotations

import re
from http import HTTPStatus

import msgspec

_MSGSPEC_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING_FIELD = re.compile(r"missing required field `([^`]*)`")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _default_type(status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


def _default_type(status: int) -> str:
    if status >= 500:
        return "server_error" if status == 500 else "service_unavailable_error"
    return {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def model_not_found(model: str) -> ApiError:
    return ApiError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", param="model",
                    code="model_not_found")


def context_too_long(num_prompt: int, max_tokens: int, max_model_len: int, param: str) -> ApiError:
    message = (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
               f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the completion).")
    return bad_request(message, param, "context_length_exceeded")


def from_decode_error(exc: msgspec.DecodeError) -> ApiError:
    """Map a msgspec JSON/validation failure to a 400 naming the offending field."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"Malformed JSON body: {text}", None, "invalid_json")
    match, missing = _MSGSPEC_PATH.search(text), _MISSING_FIELD.search(text)
    param = match.group(1) if match else ""
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    return bad_request(_MSGSPEC_PATH.sub("", text), param or None, "missing_field" if missing else "invalid_type")
