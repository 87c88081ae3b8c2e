"""One choice fed deltas directly: stop-string cut inside a multi-token delta keeps tokens, logprobs and
text consistent; a bare finish delta ends the choice without counting as a step."""

import time

from mtpserve.server.choice import ChoiceState, Timed
from mtpserve.server.detokenizer import IncrementalDetokenizer
from mtpserve.server.metrics import ServerMetrics
from mtpserve.server.outputs import TokenDelta
from mtpserve.server.stop_strings import StopStringMatcher


def _choice(text_model, stops, width: int | None = 2):
    return ChoiceState(0, 1, IncrementalDetokenizer(text_model), StopStringMatcher(stops), width,
                       ServerMetrics("m"), time.monotonic())


def _delta(ids, finish=None):
    return Timed(time.monotonic(), TokenDelta(1, ids, [-1.0] * len(ids), [[i, i + 1] for i in ids],
                                              [[-1.0, -2.0]] * len(ids), finish))


def test_stop_string_cut_inside_a_delta(text_model):
    ids = text_model.encode("alpha = 1\nbeta = 2\ngamma = 3\n")
    choice = _choice(text_model, ["beta"])
    updates = [u for i in range(0, len(ids), 3) if (u := choice.apply([_delta(ids[i:i + 3])])) is not None]
    updates = [u for u in updates if u is not None]
    assert "".join(u.text for u in updates) == "alpha = 1\n"
    assert updates[-1].finish_reason == "stop" and choice.stopped_by_string
    kept = [t for u in updates for t in u.token_ids]
    assert kept == ids[:len(kept)] and "beta" in text_model.decode(kept)
    assert "beta" not in text_model.decode(kept[:-1])  # nothing after the completing token
    assert sum(len(u.logprobs or []) for u in updates) == len(kept) == choice.num_tokens
    assert all(len(row) == 2 for u in updates for row in u.top_ids or [])


def test_bare_finish_is_not_a_step(text_model):
    ids = text_model.encode("x = 1")
    choice = _choice(text_model, [], width=None)
    choice.apply([_delta(ids[:1])])
    choice.apply([_delta(ids[1:])])
    update = choice.apply([_delta([], finish="length")])
    assert update is not None and update.finish_reason == "length" and update.logprobs is None
    assert choice.num_steps == 2 and choice.num_tokens == len(ids)
    assert choice.apply([_delta(ids)]) is None  # late deltas after the finish are ignored
