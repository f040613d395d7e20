"""A policy's `meta` object (`PolicyMeta`, `SplitZipCalibration`, `SpectrumProbe`): every field
read back as written, unset fields left out of the file, and keys of other writers kept."""

from rekv_core.plan.policy_meta import PolicyMeta, SpectrumProbe, SplitZipCalibration

TRIAL = {"depth": 0.5, "passkey": 31415, "answer": "31415", "found": True}


def _full() -> PolicyMeta:
    return PolicyMeta(prompt_len=512, prompts=4, continuation=8, needle_depths=(0.25, 0.75),
                      bf16_needles=({"depth": 0.25, "found": True},), dtype="bfloat16",
                      text="wiki.txt", command="rekv gate", commit="abc123", tree_clean=True,
                      started="2026-01-01T00:00:00Z",
                      splitzip=SplitZipCalibration((3, 1, 2), (5, 4), prompts=8, prompt_len=256),
                      spectrum_probe=SpectrumProbe(False, 2, budget=0.3, context_len=2048,
                                                   trials=(TRIAL,)),
                      generation={"tokens": 48, "codecs": {}},
                      extra={"written_by": "a newer rekv"})


def test_every_field_reads_back_as_written():
    meta = _full()
    written = meta.to_json()
    assert written["needle_depths"] == [0.25, 0.75] and written["written_by"] == "a newer rekv"
    assert written["splitzip"] == {"kv": [3, 1, 2], "boundary": [5, 4], "prompts": 8,
                                   "prompt_len": 256}
    assert written["spectrum_probe"] == {"int4_tolerated": False, "tiers": 2, "budget": 0.3,
                                         "context_len": 2048, "trials": [TRIAL]}
    read = PolicyMeta.from_json(written)
    assert read == meta and read.extra == meta.extra  # `extra` is left out of ==


def test_unset_fields_are_left_out_of_the_file():
    assert PolicyMeta().to_json() == {}
    assert PolicyMeta(prompt_len=64, extra={"k": 1}).to_json() == {"k": 1, "prompt_len": 64}
    assert SplitZipCalibration().to_json() == {}
    assert SplitZipCalibration(boundary=(7,)).to_json() == {"boundary": [7]}
    assert SplitZipCalibration(kv=(7,)).to_json() == {"kv": [7]}
    assert SpectrumProbe(True, 3).to_json() == {"int4_tolerated": True, "tiers": 3}
    # a calibration that holds only a KV codebook round-trips with its boundary unset
    only_kv = PolicyMeta(splitzip=SplitZipCalibration(kv=(2, 0)))
    assert PolicyMeta.from_json(only_kv.to_json()) == only_kv
