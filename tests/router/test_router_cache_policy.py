"""Pure parts of mixed routing: the prefix index, the cache-aware rule, the mode flags and the
instances file."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mtpserve.router.config import Members, parse_args
from mtpserve.router.policy import BALANCE, CACHE, MISS, PolicyConfig, choose
from mtpserve.router.prefix_index import CHUNK_CHARS, PrefixSet, prefix_keys, prompt_text


@dataclass
class Fake:
    in_flight: int
    seen: PrefixSet

    def matched(self, keys) -> int:
        return self.seen.match(keys)

    def num_prefixes(self) -> int:
        return len(self.seen)


def instance(in_flight: int = 0, *texts: str) -> Fake:
    seen = PrefixSet(1000)
    for text in texts:
        seen.insert(prefix_keys(text))
    return Fake(in_flight, seen)


SYSTEM = "s" * (4 * CHUNK_CHARS)


def test_keys_name_whole_prefixes():
    a, b = prefix_keys(SYSTEM + "x" * CHUNK_CHARS), prefix_keys(SYSTEM + "y" * CHUNK_CHARS)
    assert len(a) == 5 and a[:4] == b[:4] and a[4] != b[4]
    assert prefix_keys("z" + SYSTEM)[:4] != a[:4], "a key depends on everything before it"
    assert prefix_keys("short") == []


def test_the_prefix_set_forgets_the_least_recently_sent_first():
    seen = PrefixSet(max_keys=6)
    old, new = prefix_keys("a" * 4 * CHUNK_CHARS), prefix_keys("b" * 4 * CHUNK_CHARS)
    seen.insert(old)
    seen.insert(new)
    assert len(seen) == 6 and seen.match(new) == 4 and seen.match(old) == 0


def test_chat_text_follows_roles_and_text_parts():
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(body, chat=True) == "system\x00be brief\x00user\x00hi\x00"
    assert prompt_text({"prompt": [1, 22, 3]}, chat=False) == "1,22,3,"


def test_cache_aware_takes_the_longest_match_and_ties_by_load():
    keys = prefix_keys(SYSTEM + "question")
    config = PolicyConfig()
    others = [instance(0), instance(3, SYSTEM), instance(1, SYSTEM)]
    choice = choose(config, others, keys, turn=0)
    assert (choice.position, choice.matched, choice.reason) == (2, 4, CACHE)


def test_a_short_match_is_a_miss_that_goes_to_the_least_loaded_then_the_emptiest():
    keys = prefix_keys(SYSTEM + "q" * 8 * CHUNK_CHARS)  # 12 keys, 4 of them seen
    pool = [instance(2), instance(0, SYSTEM), instance(0)]
    choice = choose(PolicyConfig(cache_threshold=0.5), pool, keys, turn=0)
    assert (choice.position, choice.reason) == (2, MISS)
    assert choose(PolicyConfig(cache_threshold=0.3), pool, keys, turn=0).reason == CACHE


def test_load_wins_past_both_thresholds_only():
    keys = prefix_keys(SYSTEM)
    config = PolicyConfig(balance_abs=4, balance_rel=1.5)
    assert choose(config, [instance(5, SYSTEM), instance(2)], keys, 0).reason == CACHE  # 3 more: under abs
    assert choose(config, [instance(7, SYSTEM), instance(2)], keys, 0).reason == BALANCE
    assert choose(config, [instance(12, SYSTEM), instance(9)], keys, 0).reason == CACHE  # under rel


def test_round_robin_and_least_loaded_ignore_prefixes():
    keys = prefix_keys(SYSTEM)
    pool = [instance(3, SYSTEM), instance(1)]
    assert choose(PolicyConfig("round_robin"), pool, keys, turn=0).position == 0
    assert choose(PolicyConfig("least_loaded"), pool, keys, turn=0).position == 1
    with pytest.raises(ValueError, match="policy"):
        PolicyConfig("random")


def test_the_flags_choose_one_mode(capsys):
    config = parse_args(["--instance", "http://a:1", "http://b:2/", "--policy", "round_robin"], env={})
    assert config.instance_urls == ("http://a:1", "http://b:2") and config.policy == "round_robin"
    assert parse_args(["--prefill", "http://a:1", "--decode", "http://b:2"], env={}).policy == "cache_aware"
    for argv in (["--instance", "http://a:1", "--prefill", "http://b:2", "--decode", "http://c:3"],
                 ["--prefill", "http://b:2"], [], ["--instance", "http://a:1", "--cache-threshold", "2"]):
        with pytest.raises(SystemExit):
            parse_args(argv, env={})
    assert "not both" in capsys.readouterr().err


def test_the_instances_file(tmp_path):
    path = tmp_path / "instances"
    path.write_text("# PD\nprefill http://p:1\n\ndecode http://d:2  # the decode\n")
    assert Members.read(str(path)) == Members((), ("http://p:1",), ("http://d:2",))
    assert parse_args(["--instances-file", str(path)], env={}).decode_urls == ("http://d:2",)
    path.write_text("router http://x:1\n")
    with pytest.raises(ValueError, match=":1:"):
        Members.read(str(path))
