"""The `mtpserve` command as a user runs it: help, version, and config errors before anything starts."""

import subprocess
import sys

import pytest

from mtpserve.config import iter_keys


def mtpserve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mtpserve.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_serve_help_lists_every_key_with_its_default():
    out = mtpserve("serve", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for spec in iter_keys():
        assert spec.flag in text
    assert text.count("(default:") >= len(list(iter_keys()))


def test_top_help_lists_commands():
    out = mtpserve("--help")
    assert out.returncode == 0
    for command in ("serve", "config", "version", "bench"):
        assert command in out.stdout


def test_version():
    out = mtpserve("version")
    assert out.returncode == 0 and out.stdout.startswith("mtpserve ")


@pytest.mark.parametrize("args, toml, needle", [
    (["--max-num-seqs", "-1"], None, "engine.max_num_seqs"),
    ([], "[engine]\nmax_num_seqs = -1\n", "engine.max_num_seqs"),
    ([], "[engine]\nbogus = 1\n", "engine.bogus"),
    ([], "[engine\n", "TOML syntax error"),
])
def test_bad_config_exits_before_start_with_one_line(tmp_path, args, toml, needle):
    if toml is not None:
        path = tmp_path / "bad.toml"
        path.write_text(toml)
        args = ["--config", str(path), *args]
    out = mtpserve("serve", *args)
    assert out.returncode == 2
    assert needle in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stderr + out.stdout


def test_config_prints_effective_values():
    out = mtpserve("config", "--max-num-seqs", "7", "--api-key", "s3cret")
    assert out.returncode == 0
    assert "max_num_seqs = 7" in out.stdout
    assert "s3cret" not in out.stdout


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_dtype_the_host_cannot_compute_in_is_refused_in_one_line(dtype):
    """Never silently float32: the daemon stops before anything starts, naming the key and the fix."""
    out = mtpserve("serve", "--dtype", dtype, "--port", "1")
    lines = [line for line in out.stderr.splitlines() if "warn" not in line.lower()]
    assert out.returncode == 2
    assert len(lines) == 1 and "engine.dtype" in lines[0] and "--dtype float32" in lines[0]


def test_paddles_cpu_build_has_no_bfloat16_matmul():
    """Why the refusal above: the kernel a bfloat16 model would need does not exist on this host."""
    probe = ("import paddle\n"
             "x = paddle.ones([2, 2]).astype('bfloat16')\n"
             "try:\n    paddle.matmul(x, x)\nexcept RuntimeError as e:\n    print('not registered' in str(e))\n"
             "else:\n    print('computed')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if "computed" in out.stdout:
        pytest.fail("this Paddle computes bfloat16 matmul: engine.dtype=bfloat16 can be implemented now")
    assert out.stdout.strip() == "True", out.stderr
