"""The `rekv` command as a user runs it: a real subprocess."""

import json
import subprocess
import sys

from rekv_core.model.shapes import PRESETS

MiB = 1 << 20


def _rekv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_codecs_table_and_json(tmp_path):
    out = tmp_path / "codecs.json"
    result = _rekv("codecs", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "qwen2.5-7b" in result.stdout
    rows = json.loads(out.read_text())
    assert {r["model"] for r in rows} == set(PRESETS)
    assert {r["prompt_len"] for r in rows} == {8192}
    by_key = {(r["model"], r["codec"]): r for r in rows}
    assert by_key["qwen2.5-7b", "int8"]["layer_bytes"] == 8.25 * MiB
    assert by_key["qwen2.5-7b", "bf16"]["boundary_bytes"] == 56 * MiB
    assert set(rows[0]) == {"model", "prompt_len", "codec", "layer_bytes", "boundary_bytes"}


def test_codecs_bad_arguments_are_named():
    result = _rekv("codecs", "--model", "gpt-5")
    assert result.returncode == 2 and "unknown model preset 'gpt-5'" in result.stderr
    result = _rekv("codecs", "--prompt-len", "0")
    assert result.returncode == 2 and "prompt_len" in result.stderr


def test_demo_generates_and_writes_json(tmp_path):
    out = tmp_path / "demo.json"
    result = _rekv("demo", "--max-new-tokens", "8", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    france = report["generations"][0]
    assert france["prompt"] == "The capital of France is"
    assert "Paris" in france["output_text"]
    codecs = {r["codec"]: r for r in report["codec_roundtrip"]}
    assert codecs["int8"]["bytes"] < codecs["bf16"]["bytes"] / 1.9
    assert codecs["int4"]["max_abs_error"] > codecs["int8"]["max_abs_error"]
