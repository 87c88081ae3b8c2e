"""Response ids (`cmpl-...`, `chatcmpl-...`), taken from an incoming `X-Request-Id` when it is safe.

Under PD one client request goes to a prefill and then a decode instance; when both get the same
`X-Request-Id`, both halves of the stream carry one id. The header is used as the id's suffix, or as
the whole id when it already starts with the prefix (so a router may forward the prefill's own
`X-Request-Id` response header to the decode). Anything but a short safe token is ignored (it ends up
in logs and headers) and a fresh id is made instead.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping

HEADER = "X-Request-Id"
_SAFE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def response_id(headers: Mapping[str, str], prefix: str) -> str:
    given = headers.get(HEADER, "")
    if not _SAFE.fullmatch(given):
        return f"{prefix}{uuid.uuid4().hex}"
    return given if given.startswith(prefix) else f"{prefix}{given}"
