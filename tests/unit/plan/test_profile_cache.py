"""The machine profile cached on the machine that serves (`rekv_core.plan.profile_cache`): measured
once then loaded, the least of its rounds kept, another machine measured anew, an unwritable cache
only warned about, and a cached profile checked against the live layer and measured again when the
machine disagrees."""

import json
import logging

import pytest
import torch

from rekv_core.model import Model, load_weights
from rekv_core.plan import profile_cache as cache
from rekv_core.plan.calibration import DecodeCalibration, PrefillCalibration
from rekv_core.plan.estimates import LayerCost

@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return Model(load_weights("synthetic:mini-qwen2.5-7b"))


@pytest.fixture
def counted(monkeypatch):
    """Short measurements, counted: {"profiles": n, "codecs": [codec, ...]}."""
    calls = {"profiles": 0, "codecs": []}
    real_profile, real_codec = cache.measure_profile, cache.measure_codec_costs

    def profile(model, codecs, *args, **kwargs):
        calls["profiles"] += 1
        calls["codecs"] += list(codecs)
        return real_profile(model, codecs, *args, **kwargs)

    def codec(name, *args, **kwargs):
        calls["codecs"].append(name)
        return real_codec(name, *args, **kwargs)

    monkeypatch.setattr(cache, "STARTUP_LAYER_LENGTHS", (16, 64))
    monkeypatch.setattr(cache, "STARTUP_CODEC_LENGTH", 64)
    monkeypatch.setattr(cache, "MEASURE_ROUNDS", 1)
    monkeypatch.setattr(cache, "measure_profile", profile)
    monkeypatch.setattr(cache, "measure_codec_costs", codec)
    # the freshness check has tests of its own (below): here a cached profile stays true
    monkeypatch.setattr(cache, "live_layer_ms", lambda model, length=cache.CHECK_LENGTH: 1.0)
    monkeypatch.setattr(cache, "stale", lambda *args, **kwargs: False)
    monkeypatch.setattr(cache, "machine_busy", lambda window_s=0.0: False)
    return calls


def test_the_profile_cache_measures_once_then_loads(tiny_model, counted, tmp_path, monkeypatch):
    first = cache.cached_profile(tiny_model, ["int8"], tmp_path)
    assert counted == {"profiles": 1, "codecs": ["int8"]}
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith("mini-qwen2.5-7b-")
    assert json.loads(path.read_text())["meta"]["fingerprint"] == cache.model_fingerprint(
        tiny_model)
    second = cache.cached_profile(tiny_model, ["int8"], tmp_path)
    assert counted["profiles"] == 1 and second.layer_cost.ms == first.layer_cost.ms
    assert second.quantize_ms_per_mib == first.quantize_ms_per_mib
    # a codec the cached profile lacks is measured alone and kept
    third = cache.cached_profile(tiny_model, ["int8", "int4"], tmp_path)
    assert counted == {"profiles": 1, "codecs": ["int8", "int4"]}
    assert third.layer_cost.ms == first.layer_cost.ms and third.restore_ms_per_mib["int4"] > 0
    cache.cached_profile(tiny_model, ["int4", "int8"], tmp_path)
    assert counted["codecs"] == ["int8", "int4"]
    # another machine (or torch, device, dtype, threads, model) measures anew, beside it
    monkeypatch.setattr(cache, "machine_name", lambda device="cpu": "Another CPU @ 1 GHz")
    cache.cached_profile(tiny_model, ["int8"], tmp_path)
    assert counted["profiles"] == 2 and len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.parametrize("verdict, busy, dated", [(True, True, True), (True, False, False),
                                                  (False, True, True)])
def test_a_cached_profile_is_checked_against_the_live_layer_and_says_why_it_is_measured_again(
        tiny_model, counted, tmp_path, monkeypatch, caplog, verdict, busy, dated):
    """The freshness check gets the cached layer's cost at CHECK_LENGTH, the live layer's, whether
    the machine is busy now and whether the profile was measured busy; a stale profile is
    measured again, with a warning that says what disagreed, and a fresh one is loaded. `dated`:
    the profile says when it was measured, and that it was measured on a busy machine."""
    cache.cached_profile(tiny_model, ["int8"], tmp_path)
    (path,) = tmp_path.glob("*.json")
    kept = json.loads(path.read_text())
    kept["meta"].update(measured_busy=dated, measured_at="2026-01-02T03:04:05+00:00")
    if not dated:
        del kept["meta"]["measured_at"]
    path.write_text(json.dumps(kept))
    cached_ms = LayerCost(kept["layer_ms"]["lengths"], kept["layer_ms"]["ms"]).at(
        cache.CHECK_LENGTH)
    timed, checked = [], []
    monkeypatch.setattr(cache, "live_layer_ms",
                        lambda model, length=cache.CHECK_LENGTH: timed.append(model) or 123.0)
    monkeypatch.setattr(cache, "machine_busy", lambda window_s=0.0: busy)
    monkeypatch.setattr(cache, "stale", lambda *args: checked.append(args) or verdict)
    with caplog.at_level(logging.WARNING, logger="rekv.plan.profile_cache"):
        profile = cache.cached_profile(tiny_model, ["int8"], tmp_path)
    assert timed == [tiny_model] and checked == [(cached_ms, 123.0, busy, dated)]
    assert counted["profiles"] == (2 if verdict else 1)
    assert profile.meta["source"] == ("measured" if verdict else "cache")
    warned = (f"profile cache: {path} is stale (one layer at {cache.CHECK_LENGTH} tokens: "
              f"123.00 ms now, {cached_ms:.2f} ms in the profile measured "
              + ("2026-01-02T03:04:05+00:00 on a busy machine" if dated else "?")
              + "; the machine is "
              f"{'busy' if busy else 'idle'} now): "
              f"measuring again")
    assert [r.getMessage() for r in caplog.records] == ([warned] if verdict else [])


def test_the_cache_keeps_the_least_of_its_rounds(tiny_model, tmp_path, monkeypatch):
    """A round slowed down by another process's work is not what the cache keeps."""
    from rekv_core.plan.profile import Profile

    slow = iter([5.0, 1.0])

    def measure(model, codecs, lengths, codec_len):
        k = next(slow)
        return Profile("m", "cpu", "float32", 2, LayerCost([16, 64], [k, 3 * k]),
                       {c: 2 * k for c in codecs}, {c: k / 2 for c in codecs})

    monkeypatch.setattr(cache, "measure_profile", measure)
    monkeypatch.setattr(cache, "MEASURE_ROUNDS", 2)
    profile = cache.cached_profile(tiny_model, ["int8"], tmp_path)
    assert profile.layer_cost.ms == [1.0, 3.0]
    assert (profile.quantize_ms_per_mib, profile.restore_ms_per_mib) == ({"int8": 2.0},
                                                                          {"int8": 0.5})


def test_the_services_use_the_cache_when_no_profile_is_given(tiny_model, counted, tmp_path,
                                                              monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    decode = DecodeCalibration.for_model(tiny_model, ("int8",), "")
    prefill = PrefillCalibration.for_model(tiny_model, ("int8",), "", 10.0)
    assert counted["profiles"] == 1  # the second worker loaded what the first measured
    assert decode.layer_cost.ms == prefill.layer_cost.ms
    assert decode.restore_ms_per_mib["int8"] > 0 and prefill.quantize_ms_per_mib["int8"] > 0


def test_an_unwritable_cache_only_warns(tiny_model, counted, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="rekv.plan.profile_cache"):
        profile = cache.cached_profile(tiny_model, ["int8"], blocker / "profiles")
    assert profile.quantize_ms_per_mib["int8"] > 0 and counted["profiles"] == 1
    assert "cannot keep the profile" in caplog.text


def test_rekv_plan_warns_on_the_shipped_profile_and_measures_on_request(tmp_path, monkeypatch,
                                                                        capsys, counted):
    from rekv_cli.main import main

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    args = ["plan", "--prompt-len", "512", "--link-gbps", "1", "--threads", "2", "--json"]
    assert main(args + ["--unmeasured-link"]) == 0
    out = capsys.readouterr()
    assert "warning: the shipped profile" in out.err and "--measure" in out.err
    assert json.loads(out.out)["rule"] == "unmeasured_link"
    mini = ["--model", "mini-qwen2.5-7b", "--codecs", "bf16"]
    assert main(args + mini) == 2  # no profile ships for it
    assert "--measure" in capsys.readouterr().err
    assert main(args + mini + ["--measure"]) == 0 and counted["profiles"] == 1
    answer = json.loads(capsys.readouterr().out)
    assert answer["rule"] == "best"
    assert answer["profile"]["source"] == "measured on this machine"
    assert 0 <= answer["profile"]["age_s"] < 600 and answer["profile"]["measured_busy"] is False
    assert main(args + mini) == 0 and counted["profiles"] == 1  # cached for this machine now
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("cached, live, busy, measured_busy, expected", [
    (17.7, 1.87, False, False, True),  # cached during other load: far slower than the machine
    (17.7, 1.87, True, False, True),  # ... whatever the machine does now
    (1.0, 1.5, False, False, False),  # within the factor
    (2.0, 1.0, True, False, False),  # exactly the factor faster: within it
    (1.0, 2.0, False, False, False),  # exactly the factor slower: within it
    (1.0, 2.5, False, False, True),  # slower on an idle machine: the machine changed
    (1.0, 2.5, True, False, False),  # slower on a busy one: the load changed, not the profile
    (1.0, 1.0, False, True, True),  # measured busy, idle now: measure it properly
    (1.0, 1.0, True, True, False),  # ... but not while still busy
])
def test_a_cached_profile_is_stale_when_the_machine_disagrees(cached, live, busy, measured_busy,
                                                              expected):
    assert cache.stale(cached, live, busy, measured_busy) is expected


def test_a_profile_measured_under_load_is_measured_again_and_replaced(tiny_model, tmp_path,
                                                                      monkeypatch):
    """The cached profile's layer is 10x slower than a live one: the next start measures again,
    keeps the new profile, and says where each came from."""
    monkeypatch.setattr(cache, "STARTUP_LAYER_LENGTHS", (64, 256))
    monkeypatch.setattr(cache, "STARTUP_CODEC_LENGTH", 64)
    monkeypatch.setattr(cache, "MEASURE_ROUNDS", 1)
    monkeypatch.setattr(cache, "machine_busy", lambda window_s=0.0: False)
    first = cache.cached_profile(tiny_model, ["int8"], tmp_path)
    assert first.meta["source"] == "measured" and first.meta["measured_busy"] is False
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    assert "source" not in data["meta"]  # where it came from belongs to the one in hand
    data["meta"]["measured_at"] = "2026-01-01T00:00:00+00:00"
    data["layer_ms"]["ms"] = [10 * ms for ms in data["layer_ms"]["ms"]]
    path.write_text(json.dumps(data))
    monkeypatch.setattr(cache, "live_layer_ms", lambda model, length=256: (
        first.layer_cost.at(length)))
    again = cache.cached_profile(tiny_model, ["int8"], tmp_path)
    assert again.meta["source"] == "measured"
    assert again.meta["measured_at"] != data["meta"]["measured_at"]
    assert again.layer_cost.at(256) < data["layer_ms"]["ms"][1] / 2
    monkeypatch.setattr(cache, "live_layer_ms", lambda model, length=256: (
        again.layer_cost.at(length)))
    kept = cache.cached_profile(tiny_model, ["int8"], tmp_path)
    assert kept.meta["source"] == "cache" and kept.layer_cost.ms == again.layer_cost.ms


def test_the_cache_logs_what_it_loads_measures_and_ignores(tiny_model, counted, tmp_path,
                                                          caplog, monkeypatch):
    """Each line names the file or the model, the machine and the codecs; a profile lacking a
    codec's restore figure (its encode figure kept) is measured again for that codec; a profile
    measured on a busy machine says so, and keeps saying so when a codec is added to it."""
    print_ = cache.model_fingerprint(tiny_model)
    path = cache.cache_path(print_, tmp_path)
    with caplog.at_level(logging.INFO, logger="rekv.plan.profile_cache"):
        monkeypatch.setattr(cache, "machine_busy", lambda window_s=0.0: True)
        cache.cached_profile(tiny_model, [], tmp_path)
        monkeypatch.setattr(cache, "machine_busy", lambda window_s=0.0: False)
        measured_at = json.loads(path.read_text())["meta"]["measured_at"]
        assert json.loads(path.read_text())["meta"]["measured_busy"] is True
        cache.cached_profile(tiny_model, [], tmp_path)
        saved = json.loads(path.read_text())
        saved["quantize_ms_per_mib"]["int8"] = 1.0  # an encode figure without a restore one
        path.write_text(json.dumps(saved))
        cache.cached_profile(tiny_model, ["int8", "int4"], tmp_path)
        assert json.loads(path.read_text())["meta"]["measured_busy"] is True
        saved = json.loads(path.read_text())
        del saved["meta"]["measured_at"]
        path.write_text(json.dumps(saved))
        cache.cached_profile(tiny_model, [], tmp_path)
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
        "profile cache: ") and "one layer" not in r.getMessage()]
    machine = print_["machine"]
    assert messages == [
        f"profile cache: measuring mini-qwen2.5-7b on {machine} (no codecs)",
        f"profile cache: loaded {path} (measured {measured_at})",
        f"profile cache: measuring mini-qwen2.5-7b on {machine} (int8, int4)",
        f"profile cache: loaded {path} (measured at an unknown time)"]
    assert counted["codecs"] == ["int8", "int4"]


def test_an_unreadable_or_foreign_entry_is_ignored(tiny_model, tmp_path, caplog):
    print_ = cache.model_fingerprint(tiny_model)
    path = cache.cache_path(print_, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="rekv.plan.profile_cache"):
        assert cache.load_cached(print_, tmp_path) is None
    (record,) = caplog.records
    with pytest.raises(ValueError) as error:
        cache.Profile.load(path)
    assert record.getMessage() == f"profile cache: ignoring {path} ({error.value})"
    foreign = cache.Profile(model="mini-qwen2.5-7b", device="cpu", dtype="float32",
                            torch_threads=1, layer_cost=LayerCost([16], [1.0]),
                            quantize_ms_per_mib={}, restore_ms_per_mib={},
                            meta={"fingerprint": {**print_, "torch_threads": 99}})
    foreign.save(path)
    assert cache.load_cached(print_, tmp_path) is None
    foreign.meta["fingerprint"] = print_
    foreign.save(path)
    assert cache.load_cached(print_, tmp_path) is not None


def test_the_file_name_is_the_model_made_safe_and_the_sorted_fingerprints_digest(tmp_path):
    import hashlib

    print_ = {"model": "Qwen/Qwen2.5 7B:int", "machine": "m", "torch": "2", "device": "cpu",
              "dtype": "bfloat16", "torch_threads": 2}
    digest = hashlib.sha256(json.dumps(print_, sort_keys=True).encode()).hexdigest()[:16]
    assert cache.cache_path(print_, tmp_path) == tmp_path / f"Qwen_Qwen2.5_7B_int-{digest}.json"
    reordered = dict(reversed(list(print_.items())))
    assert cache.cache_path(reordered, tmp_path) == cache.cache_path(print_, tmp_path)


def test_a_measurement_is_logged_rounded_and_a_missing_codec_measured_on_the_models_device(
        tiny_model, tmp_path, monkeypatch, caplog):
    """The measured figures logged to 3 decimals; a codec added to a cached profile is timed on
    the model's device, as the first measurement times them."""
    asked = []

    def profile(model, codecs, lengths, codec_len):
        return cache.Profile(model=model.shape.name, device="cpu", dtype="float32",
                             torch_threads=1, layer_cost=LayerCost(list(lengths), [1.23456, 2.0]),
                             quantize_ms_per_mib={c: 0.98765 for c in codecs},
                             restore_ms_per_mib={c: 0.5 for c in codecs})

    def codec_costs(name, shape, length, device="the default"):
        asked.append((name, length, device))
        return 3.14159, 2.71828

    monkeypatch.setattr(cache, "STARTUP_LAYER_LENGTHS", (16, 64))
    monkeypatch.setattr(cache, "MEASURE_ROUNDS", 1)
    monkeypatch.setattr(cache, "measure_profile", profile)
    monkeypatch.setattr(cache, "measure_codec_costs", codec_costs)
    monkeypatch.setattr(cache, "stale", lambda *args, **kwargs: False)
    monkeypatch.setattr(cache, "live_layer_ms", lambda model, length=cache.CHECK_LENGTH: 1.0)
    monkeypatch.setattr(cache, "machine_busy", lambda window_s=0.0: False)
    with caplog.at_level(logging.INFO, logger="rekv.plan.profile_cache"):
        cache.cached_profile(tiny_model, ["int8"], tmp_path)
        cache.cached_profile(tiny_model, ["int8", "int4"], tmp_path)
    lines = [r.getMessage() for r in caplog.records if "one layer" in r.getMessage()]
    assert lines == [
        "profile cache: mini-qwen2.5-7b, one layer [1.235, 2.0] ms at [16, 64] tokens; encode "
        "{'int8': 0.988}, restore {'int8': 0.5} ms/MiB",
        "profile cache: mini-qwen2.5-7b, one layer [1.235, 2.0] ms at [16, 64] tokens; encode "
        "{'int8': 0.988, 'int4': 3.142}, restore {'int8': 0.5, 'int4': 2.718} ms/MiB"]
    assert asked == [("int4", cache.STARTUP_CODEC_LENGTH, tiny_model.device)]


def test_a_profile_is_written_whole_beside_its_entry_into_a_new_folder(tmp_path, monkeypatch):
    """The folder made with its parents; the file written to a temporary file named after the
    entry (never *.json) in the same folder, then renamed over it (atomic on one file system)."""
    made = []
    real = cache.tempfile.mkstemp

    def mkstemp(**kwargs):
        made.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(cache.tempfile, "mkstemp", mkstemp)
    path = tmp_path / "a" / "b" / "entry-0123.json"
    profile = cache.Profile(model="m", device="cpu", dtype="float32", torch_threads=1,
                            layer_cost=LayerCost([16], [1.0]), quantize_ms_per_mib={},
                            restore_ms_per_mib={})
    cache._save(profile, path)
    assert made == [{"prefix": "entry-0123.json", "suffix": ".tmp", "dir": path.parent}]
    assert path.read_text() == json.dumps(profile.to_json(), indent=1) + "\n"
    assert path.stat().st_mode & 0o777 == 0o644  # readable by the machine's other users
    assert sorted(path.parent.iterdir()) == [path]


def test_a_profile_that_cannot_be_kept_says_where_and_why(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    path = blocker / "entry.json"
    with pytest.raises(OSError) as error:
        path.parent.mkdir(parents=True, exist_ok=True)
    profile = cache.Profile(model="m", device="cpu", dtype="float32", torch_threads=1,
                            layer_cost=LayerCost([16], [1.0]), quantize_ms_per_mib={},
                            restore_ms_per_mib={})
    with caplog.at_level(logging.WARNING, logger="rekv.plan.profile_cache"):
        cache._save(profile, path)
    assert [r.getMessage() for r in caplog.records] == [
        f"profile cache: cannot keep the profile in {blocker} ({error.value}); measuring again "
        f"at the next start"]
