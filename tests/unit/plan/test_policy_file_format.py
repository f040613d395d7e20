"""The policy file as `rekv gate` writes it: every field kept through save and load, the shipped
file written back byte for byte, and a merge of two gate runs keeping what identifies the policy
or naming why it cannot."""

import json
from importlib import resources

import pytest

from rekv_core.plan.policy import Policy, shipped_policy
from rekv_core.plan.policy_meta import PolicyMeta


def _verdict(codec: str, cut: int) -> dict:
    return {"codec": codec, "cut": cut, "eligible": True, "reasons": [], "bf16_perplexity": 16.9}


def test_every_field_survives_save_and_load_into_a_new_folder(tmp_path):
    policy = Policy("smollm2-135m", (64, 1024), {"int8": 24, "int4": 0}, epsilon=0.02,
                    verdicts=[_verdict("int8", 24)],
                    meta={"prompt_len": 512, "generation": {"tokens": 48}})
    path = tmp_path / "runs" / "today" / "policy.json"  # folders that do not exist yet
    policy.save(path)
    written = json.loads(path.read_text())
    assert set(written) == {"model", "prompt_len_range", "epsilon", "eligible", "verdicts", "meta"}
    loaded = Policy.load(path)
    assert (loaded.model, loaded.prompt_len_range, loaded.max_cut, loaded.epsilon) == (
        "smollm2-135m", (64, 1024), {"int8": 24, "int4": 0}, 0.02)
    assert loaded.verdicts == [_verdict("int8", 24)] and loaded.meta == policy.meta


def test_the_shipped_policy_is_written_back_byte_for_byte(tmp_path):
    # a gate run that changes nothing leaves the committed file unchanged: same keys, same
    # order, same indentation
    shipped = resources.files("rekv_core.plan").joinpath("policies", "smollm2-135m.json")
    shipped_policy("smollm2-135m").save(tmp_path / "p.json")
    assert (tmp_path / "p.json").read_text() == shipped.read_text()


def test_a_merge_keeps_the_model_its_prompt_lengths_and_epsilon():
    old = Policy("m", (64, 1024), {"int8": 30}, epsilon=0.02, verdicts=[_verdict("int8", 30)])
    new = Policy("m", (64, 1024), {"int4": 6}, epsilon=0.02, verdicts=[_verdict("int4", 6)])
    merged = old.merged(new)
    assert (merged.model, merged.prompt_len_range, merged.epsilon) == ("m", (64, 1024), 0.02)
    assert merged.max_cut == {"int8": 30, "int4": 6}


def test_a_merged_meta_keeps_the_keys_either_writer_did_not_know():
    older = PolicyMeta.from_json({"prompts": 4, "from_an_older_writer": 1})
    newer = PolicyMeta.from_json({"prompts": 8, "from_a_newer_writer": 2})
    merged = older.merged(newer)
    assert merged.prompts == 8
    assert merged.to_json() == {"prompts": 8, "from_an_older_writer": 1,
                                "from_a_newer_writer": 2}


def test_a_merge_that_cannot_be_made_says_why():
    old = Policy("m", (1, 2048), {"int8": 30}, verdicts=[_verdict("int8", 30)])
    with pytest.raises(ValueError,
                       match=r"^policy: the two come from different models or evaluations$"):
        old.merged(Policy("other", (1, 2048), {"int8": 30}, verdicts=[_verdict("int8", 30)]))
    # both SpectrumKV codecs scored under 3 tiers, a newer run whose probe gives 2 re-gates neither
    probed = {"int4_tolerated": True, "tiers": 3}
    older = Policy("m", (1, 2048), {"spectrum30": 18, "spectrum50": 30, "int8": 30},
                   meta={"spectrum_probe": probed})
    newer = Policy("m", (1, 2048), {"int4h": 30},
                   meta={"spectrum_probe": {**probed, "int4_tolerated": False, "tiers": 2}})
    with pytest.raises(ValueError, match=r"now gives 2 tiers, not 3; "
                                         r"gate spectrum30, spectrum50 again in this run$"):
        older.merged(newer)
