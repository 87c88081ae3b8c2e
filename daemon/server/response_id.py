"""Response ids: `cmpl-<suffix>` / `chatcmpl-<suffix>`, the suffix taken from an incoming `X-Request-Id`.

Under PD the router sends one client request to a prefill and then a decode instance with the same
`X-Request-Id`, so both halves of the stream carry one id. Anything but a short safe token is ignored
(it ends up in logs and headers) and a fresh id is made instead.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping

HEADER = "X-Request-Id"
_SAFE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def response_suffix(headers: Mapping[str, str]) -> str:
    given = headers.get(HEADER, "")
    return given if _SAFE.fullmatch(given) else uuid.uuid4().hex
