"""The client's JSON body as the router forwards it: under PD, checked for what PD cannot do, given a seed.

The instances validate everything else; the router only refuses what it cannot route (several
choices: one request holds one prefill's KV) and adds a seed so that the prefill's and the decode's
sampling agree.
"""

from __future__ import annotations

import random

import msgspec

from mtpserve.web.errors import bad_request, from_decode_error

SEED_LIMIT = 2**63  # seeds are drawn from [0, SEED_LIMIT): a signed 64-bit int


def prepare_body(raw: bytes, completions: bool, pd: bool = True) -> dict:
    """The body to forward; `pd`: through a prefill and a decode instance (a mixed instance takes any
    body it would take directly)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from exc
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_type")
    if "kv_transfer_params" in body:  # NOTE: a client must not point a decode at memory of its choosing
        raise bad_request("`kv_transfer_params` is set by the PD router, not by clients.", "kv_transfer_params",
                          "unsupported")
    if not pd:
        return body
    _check_single_choice(body, completions)
    if body.get("seed") is None:
        body["seed"] = random.randrange(SEED_LIMIT)
    return body


def is_stream(body: dict) -> bool:
    return body.get("stream") is True


def _check_single_choice(body: dict, completions: bool) -> None:
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise bad_request("n > 1 is not supported through the PD router.", "n", "unsupported")
    if completions and _num_prompts(body.get("prompt")) > 1:
        raise bad_request("Several prompts in one request are not supported through the PD router.",
                          "prompt", "unsupported")


def _num_prompts(prompt: object) -> int:
    """A string or a list of token ids is one prompt; a list of strings or of id lists is several."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1
