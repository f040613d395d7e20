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
    result = _rekv("demo", "--filler", "0,4", "--max-new-tokens", "6", "--log-dir",
                   str(tmp_path / "logs"), "--json", str(out))
    assert result.returncode == 0, result.stderr + result.stdout
    assert "prefill exit 0, decode exit 0; 0 failed requests" in result.stdout
    report = json.loads(out.read_text())
    assert report["exit_codes"] == {"prefill": 0, "decode": 0}
    assert report["failed_requests"] == 0
    assert {"commit", "tree_clean", "started"} <= set(report["meta"])
    link = report["meta"]["link"]
    assert link["kind"] in ("netns", "paced") and f"link: {link['kind']}:" in result.stdout
    assert link["chosen"] == "balanced" and link["gbps"] > 0 and link["compute_ms"] > 0
    prompts, rows = report["prompts"], report["requests"]
    assert len(prompts) == 2 and prompts[0]["prompt_tokens"] < prompts[1]["prompt_tokens"]
    assert [p["order"] for p in prompts] == [["baseline", "seed", "streamed"],
                                             ["seed", "streamed", "baseline"]]
    assert len(rows) == 6 and len(report["warmups"]) == 6 + 4  # code paths, then both schedules
    assert report["warmups"][3]["pipelined"] and not report["warmups"][2]["pipelined"]
    for p in prompts:
        mine = {r["way"]: r for r in rows if r["prompt_index"] == p["prompt_index"]}
        assert set(mine) == {"baseline", "seed", "streamed"}
        assert all(r["ttft_ms"] > 0 and not r["fallback"] for r in mine.values())
        assert mine["baseline"]["action_kind"] == "bf16_transfer"
        assert not mine["baseline"]["streamed"] and not mine["seed"]["streamed"]
        assert mine["streamed"]["streamed"] or mine["streamed"]["action_kind"] == "token_recompute"
        assert all(r["same_tokens"] for r in mine.values() if r["lossless"])
        assert mine["baseline"]["passkey_found"]
        assert p["baseline_over_streamed"] == mine["baseline"]["ttft_ms"] / mine["streamed"][
            "ttft_ms"]
    assert "request=demo-0-streamed" in (tmp_path / "logs" / "decode.log").read_text()
    # the services' default quality setting applied, and the demo says what it may change
    assert all(r["quality"] == "gated" for r in rows) and "quality setting: gated." in result.stdout


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
            "--generation-tokens", "8", "--out", str(out))
    result = _rekv(*base)
    assert result.returncode == 2 and "tokenizer" in result.stderr
    result = _rekv(*base, "--tokenizer", "embedded")
    assert result.returncode == 0, result.stderr[-3000:]
    policy = json.loads(out.read_text())
    assert policy["model"] == "mini-qwen2.5-7b"
    assert {"commit", "tree_clean", "started"} <= set(policy["meta"])
    assert {(v["codec"], v["cut"]) for v in policy["verdicts"]} == {("int8", 14), ("int8", 28)}
    # greedy continuations of the generation set, judged against the floor
    assert all(len(v["generation_divergences"]) == 10 and v["generation_tokens"] == 8
               for v in policy["verdicts"])
    assert policy["meta"]["generation"]["floor"] == {"min_agreed_tokens": 16,
                                                     "min_exact_share": 0.75}
