"""What the router remembers of the prompts it sent to each instance: an approximate prefix tree.

The router has no tokenizer, so prompts are text: a completions prompt as it came (token-id prompts
as their decimal ids), a chat request as its messages' roles and texts in order. The text is cut into
`CHUNK_CHARS`-character chunks, and chunk i's key is a hash of chunk i-1's key and chunk i: one key
names a whole prefix, so a set of keys is a prefix tree whose nodes are chunk boundaries, and the
longest prefix an instance has seen is the longest run of leading keys in its set. Each instance's set
is an LRU of at most `max_keys` keys: memory is bounded, and prefixes not sent for a while leave first,
as they leave the instance's own cache.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

CHUNK_CHARS = 64
MAX_CHUNKS = 1024  # NOTE: 64 KiB of prompt text; past it, requests count as equal


def prompt_text(body: dict, chat: bool) -> str:
    """The text the instance's prompt will be made of (approximately: no template, no tokenizer)."""
    if chat:
        messages = body.get("messages")
        parts = []
        for message in messages if isinstance(messages, list) else ():
            if isinstance(message, dict):
                parts.append(f"{message.get('role', '')}\x00{_content_text(message.get('content'))}\x00")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return ",".join(str(t) for t in prompt) + ","
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return prompt_text({"prompt": prompt[0]}, chat=False)  # NOTE: several prompts: the first decides
    return ""


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prefix_keys(text: str) -> list[bytes]:
    """One key per full chunk of `text`, each naming the whole prefix up to its chunk's end."""
    keys: list[bytes] = []
    parent = b""
    for start in range(0, min(len(text), MAX_CHUNKS * CHUNK_CHARS) - CHUNK_CHARS + 1, CHUNK_CHARS):
        parent = hashlib.blake2b(parent + text[start:start + CHUNK_CHARS].encode(), digest_size=12).digest()
        keys.append(parent)
    return keys


class PrefixSet:
    """One instance's recently sent prefixes: an LRU of prefix keys."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._keys: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of a prompt this instance has seen."""
        matched = 0
        for key in keys:
            if key not in self._keys:
                break
            matched += 1
        return matched

    def insert(self, keys: Sequence[bytes]) -> None:
        """Remember a prompt sent to the instance; its keys become the most recently used."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
