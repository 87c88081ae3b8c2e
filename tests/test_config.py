"""The configuration tree: precedence, validation errors that name the key, and the example file."""

from pathlib import Path

import pytest

from mtpserve.cli import example_toml
from mtpserve.config import Config, ConfigError, iter_keys, load_config

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mtpserve.toml"
    path.write_text(text)
    return path


def test_defaults_when_nothing_given():
    assert load_config() == Config()


def test_precedence_file_then_env_then_cli(tmp_path):
    path = write(tmp_path, "[engine]\nmax_num_seqs = 8\nblock_size = 32\n[server]\nport = 9001\n")
    env = {"MTPSERVE_ENGINE_MAX_NUM_SEQS": "16", "MTPSERVE_SERVER_PORT": "9002"}
    config = load_config(path, env=env, cli={"server.port": "9003"})
    assert config.engine.block_size == 32  # file only
    assert config.engine.max_num_seqs == 16  # env over file
    assert config.server.port == 9003  # cli over env


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        load_config().engine.max_num_seqs = 3  # type: ignore[misc]


@pytest.mark.parametrize("text, needle", [
    ("[engine]\nmax_num_seq = 8\n", "engine.max_num_seq"),
    ("[enginee]\nmax_num_seqs = 8\n", "enginee.max_num_seqs"),
    ("[engine]\nmax_num_seqs = -1\n", "must be >= 1"),
    ("[engine]\nmax_num_seqs = \"8\"\n", "expected int"),
    ("[engine]\nenable_overlap = 1\n", "expected bool"),
    ("[server]\nport = 70000\n", "must be <= 65535"),
    ("[pd]\nrole = \"both\"\n", "must be one of"),
    ("[engine\nmax_num_seqs = 8\n", "TOML syntax error"),
    ("engine = 3\n", "expected a [engine] table"),
])
def test_bad_file_names_the_problem(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(write(tmp_path, text))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("env, needle", [
    ({"MTPSERVE_ENGINE_MAX_NUM_SEQS": "lots"}, "MTPSERVE_ENGINE_MAX_NUM_SEQS"),
    ({"MTPSERVE_ENGINE_NOPE": "1"}, "unknown environment variable"),
    ({"MTPSERVE_ENGINE_ENABLE_OVERLAP": "maybe"}, "expected bool"),
])
def test_bad_env_names_the_variable(env, needle):
    with pytest.raises(ConfigError) as err:
        load_config(env=env)
    assert needle in str(err.value)


def test_cross_field_rule():
    with pytest.raises(ConfigError, match="node_rank"):
        load_config(cli={"parallel.nnodes": "2", "parallel.node_rank": "2"})


def test_floats_accept_integers(tmp_path):
    assert load_config(write(tmp_path, "[server]\ndrain_timeout = 5\n")).server.drain_timeout == 5.0


def test_example_file_is_current_and_loads():
    example = ROOT / "config" / "mtpserve.example.toml"
    assert example.read_text() == example_toml(), "regenerate: mtpserve config --example > config/mtpserve.example.toml"
    assert load_config(example) == Config()


def test_example_documents_every_key():
    text = example_toml()
    for spec in iter_keys():
        assert f"\n{spec.name} = " in text and spec.env_var in text and spec.flag in text


def test_pd_role_with_tensor_parallelism_is_refused():
    with pytest.raises(ConfigError, match="pd.role: prefill needs parallel.tensor_parallel_size 1"):
        load_config(cli={"pd.role": "prefill", "parallel.tensor_parallel_size": "2"})
    assert load_config(cli={"pd.role": "decode"}).pd.role == "decode"
