"""The `rekv` command as a user runs it: a real subprocess."""

import json
import subprocess
import sys

from rekv_core.model.shapes import PRESETS

MiB = 1 << 20


def _rekv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rekv_cli", *args], capture_output=True,
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


def test_demo_runs_both_services_and_stops_them(tmp_path):
    out = tmp_path / "demo.json"
    result = _rekv("demo", "--filler", "0,8", "--max-new-tokens", "6", "--log-dir",
                   str(tmp_path / "logs"), "--json", str(out))
    assert result.returncode == 0, result.stderr + result.stdout
    assert "prefill exit 0, decode exit 0" in result.stdout
    report = json.loads(out.read_text())
    assert report["exit_codes"] == {"prefill": 0, "decode": 0}
    assert [r["prompt_tokens"] for r in report["requests"]][0] < report["requests"][1][
        "prompt_tokens"]
    for row in report["requests"]:
        assert row["bf16"]["action"] == "bf16_transfer" and row["bf16"]["passkey_found"]
        assert row["planned"]["handoff_ms"] > 0 and not row["planned"]["fallback"]
    assert "request=demo-0-planned" in (tmp_path / "logs" / "decode.log").read_text()


def test_serve_rejects_bad_settings_by_name():
    result = _rekv("serve", "decode", "--max-new-tokens", "0", "--prefill-address", "x:1")
    assert result.returncode == 2 and "max_new_tokens" in result.stderr
    result = _rekv("serve", "decode")
    assert result.returncode == 2 and "prefill_address" in result.stderr
    result = _rekv("serve", "prefill", "--codecs", "int3")
    assert result.returncode == 2 and "codecs" in result.stderr
    result = _rekv("serve", "prefill")  # neither certificates nor an explicit plaintext
    assert result.returncode == 2 and "tls_cert: required" in result.stderr


def test_gate_on_synthetic_weights_needs_and_takes_a_tokenizer(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog near the river bank. " * 300)
    out = tmp_path / "policy.json"
    base = ("gate", "--model", "synthetic:mini-qwen2.5-7b", "--text", str(text), "--prompt-len",
            "48", "--prompts", "2", "--continuation", "4", "--codecs", "int8", "--cuts", "14,28",
            "--out", str(out))
    result = _rekv(*base)
    assert result.returncode == 2 and "tokenizer" in result.stderr
    result = _rekv(*base, "--tokenizer", "embedded")
    assert result.returncode == 0, result.stderr[-3000:]
    policy = json.loads(out.read_text())
    assert policy["model"] == "mini-qwen2.5-7b"
    assert {(v["codec"], v["cut"]) for v in policy["verdicts"]} == {("int8", 14), ("int8", 28)}
