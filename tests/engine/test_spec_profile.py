"""The start-up profile kept for restarts (engine/spec_profile.py): the frozen step costs survive a file whole,
a file serves only a start like the one that measured it and only while fresh, and a bad or unwritable file
costs a profile, never the start."""

import dataclasses
import os
import shutil

import msgspec
import pytest
from daemon_harness import BUNDLED
from mtpserve.config import Config
from mtpserve.engine.spec_cost import StepCosts, StepLoad
from mtpserve.engine.spec_profile import FORMAT, MAX_AGE_S, KeptProfile, ProfileCache, profile_key
from mtpserve.engine.step_plan import StepTiming
from spec_device import memory_bound_ms
from spec_rows import K


def decode_load(rows: int, kv: int, depth: int) -> StepLoad:
    window = depth + 1
    keys, pairs = rows * (kv + window), rows * window * (kv + window)
    return StepLoad(rows * window, rows, depth, False, rows, pairs, keys)


def chunk_load(width: int, start: int, depth: int) -> StepLoad:
    """One prompt's chunk of `width` tokens from position `start` (as spec_load.plan_load counts it)."""
    return StepLoad(width, 1, depth, True, int(start > 0), start + width, start + width, width * start)


def profiled_costs() -> StepCosts:
    """Step costs profiled as the start-up profile does, on a synthetic device: decode steps at every depth, a
    few rows and two contexts, and prompts prefilled at every depth, one of them in two chunks."""
    costs = StepCosts()
    for rows, kv in [(1, 32), (1, 384), (4, 32), (4, 384), (16, 32), (16, 384), (64, 32)]:
        for depth in range(K + 1):
            target, drafts = memory_bound_ms(rows, kv, depth)
            for noise in (1.0, 1.1, 1.3):
                costs.observe(decode_load(rows, kv, depth), 0.0, StepTiming(target * noise * 1e-3, drafts * noise * 1e-3))
    for depth in range(K + 1):
        for width, start in ((64, 0), (256, 0), (512, 0), (512, 512)):
            target = 0.5 + 0.06 * width + 0.15e-3 * width * start
            drafts = depth * (0.3 + 0.004 * width + 0.06e-3 * width * start)
            for noise in (1.0, 1.1, 1.3):
                costs.observe(chunk_load(width, start, depth), 0.0,
                              StepTiming(target * noise * 1e-3, drafts * noise * 1e-3))
    costs.freeze()
    return costs


LOADS = ([decode_load(rows, kv, depth) for rows in (1, 3, 8, 40, 64, 200) for kv in (10, 300, 2000)
          for depth in range(K + 1)]
         + [chunk_load(width, start, depth) for width in (48, 300, 512) for start in (0, 512, 1536)
            for depth in range(K + 1)])


def test_restored_step_costs_price_every_step_as_the_profiled_ones_and_learn_no_more():
    profiled = profiled_costs()
    restored = StepCosts()
    restored.observe(decode_load(4, 32, 1), 5.0, StepTiming(4.0, 1.0))  # NOTE: a warm-up step, to be dropped
    restored.restore(msgspec.json.decode(msgspec.json.encode(profiled.state()), type=type(profiled.state())))
    assert restored.frozen and restored.prefix_target > 0
    assert [restored.device(load) for load in LOADS] == [profiled.device(load) for load in LOADS]
    restored.observe(decode_load(4, 32, 1), 5.0, StepTiming(4.0, 1.0))
    assert [restored.device(load) for load in LOADS] == [profiled.device(load) for load in LOADS]


def test_a_kept_profile_is_loaded_under_its_key_only():
    cache, state = ProfileCache.from_setting(""), profiled_costs().state()
    assert cache.directory is not None
    cache.save("a" * 32, state)
    assert cache.load("a" * 32) == state
    assert cache.load("b" * 32) is None


@pytest.fixture(autouse=True)
def home_cache(tmp_path, monkeypatch):
    """The default directory in this test's own place."""
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.mark.parametrize("change", ["stale", "format", "key", "garbage"])
def test_a_stale_foreign_or_broken_file_is_not_used(tmp_path, change):
    cache, state = ProfileCache(tmp_path / "profiles"), profiled_costs().state()
    cache.save("k" * 32, state)
    [path] = (tmp_path / "profiles").iterdir()
    kept = msgspec.json.decode(path.read_bytes(), type=KeptProfile)
    edited = {"stale": msgspec.structs.replace(kept, measured_at=kept.measured_at - MAX_AGE_S - 60),
              "format": msgspec.structs.replace(kept, format=FORMAT + 1),
              "key": msgspec.structs.replace(kept, key="j" * 32)}.get(change)
    path.write_bytes(b"{not json" if edited is None else msgspec.json.encode(edited))
    assert cache.load("k" * 32) is None


def test_off_keeps_nothing_and_an_unwritable_directory_costs_only_the_next_profile(tmp_path):
    off = ProfileCache.from_setting("off")
    off.save("k" * 32, profiled_costs().state())
    assert off.directory is None and off.load("k" * 32) is None
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    cache = ProfileCache(blocked / "profiles")
    cache.save("k" * 32, profiled_costs().state())
    assert cache.load("k" * 32) is None


def test_the_default_directory_is_systemd_s_cache_directory_else_the_user_s(tmp_path, monkeypatch):
    assert ProfileCache.from_setting("").directory == tmp_path / "xdg" / "mtpserve" / "step-profiles"
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "var-cache"))
    assert ProfileCache.from_setting("").directory == tmp_path / "var-cache" / "step-profiles"
    assert ProfileCache.from_setting(str(tmp_path / "x")).directory == tmp_path / "x"


def test_the_key_changes_with_what_a_profile_measures_and_nothing_else(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(BUNDLED / name, model / name)
    (model / "model.safetensors").write_bytes(b"weights")
    config = Config()
    key = profile_key(model, config)
    assert profile_key(model, config) == key
    assert profile_key(model, dataclasses.replace(
        config, speculative=dataclasses.replace(config.speculative, profile_cache="/elsewhere"))) == key
    assert profile_key(model, dataclasses.replace(
        config, server=dataclasses.replace(config.server, port=9))) == key
    changed = [
        dataclasses.replace(config, engine=dataclasses.replace(config.engine, max_num_seqs=32)),
        dataclasses.replace(config, speculative=dataclasses.replace(config.speculative, num_speculative_tokens=3)),
        dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, cpu_threads=1)),
        dataclasses.replace(config, pd=dataclasses.replace(config.pd, role="decode")),
    ]
    assert len({profile_key(model, other) for other in changed} | {key}) == len(changed) + 1
    stat = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    retouched = profile_key(model, config)
    (model / "config.json").write_text((model / "config.json").read_text().replace("}", ', "x": 1}', 1))
    assert len({key, retouched, profile_key(model, config)}) == 3



def test_a_start_without_a_key_profiles_and_keeps_nothing(tmp_path):
    """A model directory that cannot be read for the key (here: gone) turns the cache off for that start."""
    config = Config()
    config = dataclasses.replace(config, speculative=dataclasses.replace(config.speculative,
                                                                           profile_cache=str(tmp_path / "p")))
    cache, key = ProfileCache.for_start(tmp_path / "no-model", config)
    assert cache.directory is None and key == ""
    assert ProfileCache.for_start(BUNDLED, config)[0].directory == tmp_path / "p"
