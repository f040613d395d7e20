"""Shared fixtures, the `system` marker on every test under tests/system (so `-m "not system"`
and `pytest tests/unit` select the same tests) and the `numerics` marker on the files of NUMERICS
(`make test-isa` runs them under each instruction set the CPU's kernels can be held to), the
test files in the order of their measured time, longest first (`_slowest_files_first`). Under
`make mutate` a mutant's tests run fastest first (`_fastest_first`), on one torch thread, with the
embedded model loaded before mutmut forks (`PRELOADED`). Triton runs in interpreter
mode on machines without CUDA; that must be decided before anything imports triton."""

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the services this session starts share one profile measurement, made here and not kept, and one
# conversion of the embedded GGUF per dtype (about 270 MB in BF16), removed when the session ends
os.environ.setdefault("REKV_PROFILE_CACHE", tempfile.mkdtemp(prefix="rekv-test-profiles-"))
if "REKV_MODEL_CACHE" not in os.environ:
    os.environ["REKV_MODEL_CACHE"] = tempfile.mkdtemp(prefix="rekv-test-models-")
    atexit.register(shutil.rmtree, os.environ["REKV_MODEL_CACHE"], ignore_errors=True)
# every test computes in float32 on the CPU unless it names its dtype: `auto` picks BF16 on a CPU
# with native BF16 dot products and float32 on others, and the suite gives one verdict on every
# CPU (tests/unit/test_cpu_bf16.py and test_services_lifecycle.py test `auto` itself)
os.environ.setdefault("REKV_DTYPE", "float32")

import pytest  # noqa: E402

from rekv_core.model import Model, embedded_gguf_path, load_weights  # noqa: E402
from rekv_core.model.tokenizer import GGUFTokenizer  # noqa: E402

# mutmut puts it in the environment of each of its processes (`make mutate`); in the fork server
# that collects the tests before forking a process per mutant it is still empty, so its presence,
# not its value, tells (with mutmut 3.8's fork server, a value test found no mutmut at all)
def under_mutmut(environ) -> bool:
    return "MUTANT_UNDER_TEST" in environ


UNDER_MUTMUT = under_mutmut(os.environ)
# two threads at most, and the cores shared out among pytest-xdist's workers (`make test` runs two)
# or mutmut's (a mutant to each core: one thread each)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = 1 if UNDER_MUTMUT else max(1, min(2, (os.cpu_count() or 1) // WORKERS))
torch.set_num_threads(THREADS)

SYSTEM = Path(__file__).resolve().parent / "system"
FILE_SECONDS = SYSTEM.parent / "file_seconds.json"
# The tests whose verdict rests on floating-point results of the real model's layers: exactness
# where the code promises it, bounds and agreement with the same machine's reference elsewhere.
# Which kernels torch and oneDNN pick (and so every BF16 rounding) changes with the CPU's
# instruction set; these must pass under each (tests/README.md, `make test-isa`).
NUMERICS = {f"tests/unit/{name}.py" for name in (
    "model/test_executor_exactness", "model/test_executor_oracle", "model/test_static_decode",
    "model/test_speculation", "model/test_layer_batch", "engine/test_engine_reference", "plan/test_canary",
    "plan/test_generations", "plan/test_gate_and_planner", "plan/test_quality",
    "handoff/test_layer_split", "handoff/test_token_split_cache", "codecs/test_lynx_streams",
)}


def pytest_collection_modifyitems(items):
    """Marks `system` every test whose file is under tests/system (the folder is the marker) and
    `numerics` every test of a NUMERICS file."""
    root = SYSTEM.parents[1]
    for item in items:
        path = Path(item.path).resolve()
        if SYSTEM in path.parents:
            item.add_marker(pytest.mark.system)
        if path.relative_to(root).as_posix() in NUMERICS:
            item.add_marker(pytest.mark.numerics)
    if UNDER_MUTMUT:
        items[:] = _fastest_first(items, Path("mutmut-stats.json"))
    else:
        items[:] = _slowest_files_first(items, FILE_SECONDS)


def _slowest_files_first(items: list, costs: Path) -> list:
    """`items` file by file, the files in the order of their measured seconds (`costs`, written by
    tools/file_seconds.py), longest first, files it does not know before them all; within a file
    the order stands. `make test` hands the files to its pytest-xdist workers in this order
    (`--no-loadscope-reorder`), so that no long file starts last and runs alone at the end."""
    try:
        seconds = json.loads(costs.read_text())["seconds_by_file"]
    except (OSError, ValueError, KeyError):
        return items
    rank = {}
    for item in items:
        name = item.nodeid.split("::", 1)[0]
        rank.setdefault(name, (-seconds.get(name, float("inf")), len(rank)))
    return sorted(items, key=lambda item: rank[item.nodeid.split("::", 1)[0]])


def _fastest_first(items: list, stats: Path) -> list:
    """`items` in the order of their duration in mutmut's traced run (`stats`, in mutmut's working
    directory), shortest first, unknown ones last. mutmut runs a mutant's tests with `-x` in the
    order it lists them (a set's), so a mutant that a quick test kills is spent on that test
    alone rather than on the slow handoff tests listed before it."""
    try:
        duration = json.loads(stats.read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return items
    return sorted(items, key=lambda item: duration.get(item.nodeid, float("inf")))


def _load_fp32() -> Model:
    return Model(load_weights("smollm2-135m", torch.float32))


def _cast(fp32: Model, dtype: torch.dtype) -> Model:
    """The same weights in another dtype (the LM head stays tied to the embedding)."""
    from dataclasses import fields

    from rekv_core.model.weights import LayerWeights, ModelWeights

    w = fp32.weights

    def cast(t):
        return None if t is None else t.to(dtype)

    layers = [LayerWeights(**{f.name: cast(getattr(lw, f.name)) for f in fields(LayerWeights)})
              for lw in w.layers]
    embed = cast(w.embed)
    return Model(ModelWeights(shape=w.shape, embed=embed, layers=layers,
                              final_norm=cast(w.final_norm), lm_head=embed))


def _load_tokenizer() -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(embedded_gguf_path())


# Under `make mutate`, loaded once here, at collection, by mutmut's fork server, which then forks
# a process per mutant: each starts with the embedded model and its tokenizer in memory
# (copy-on-write) instead of spending about ten seconds loading them again. With one torch thread
# (THREADS) no OpenMP pool has started, so the fork is safe.
PRELOADED: dict = {}
if UNDER_MUTMUT:
    PRELOADED["fp32"] = _load_fp32()
    PRELOADED["bf16"] = _cast(PRELOADED["fp32"], torch.bfloat16)
    PRELOADED["tokenizer"] = _load_tokenizer()


@pytest.fixture(scope="session")
def smollm_fp32() -> Model:
    return PRELOADED["fp32"] if "fp32" in PRELOADED else _load_fp32()


@pytest.fixture(scope="session")
def smollm_bf16(smollm_fp32) -> Model:
    return PRELOADED["bf16"] if "bf16" in PRELOADED else _cast(smollm_fp32, torch.bfloat16)


@pytest.fixture(scope="session")
def smollm_fp64(smollm_fp32) -> Model:
    """Float64: where two summation orders must agree to far below float32's rounding."""
    return _cast(smollm_fp32, torch.float64)


@pytest.fixture(scope="session")
def tokenizer() -> GGUFTokenizer:
    return PRELOADED["tokenizer"] if "tokenizer" in PRELOADED else _load_tokenizer()


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' own load of the same GGUF file: the oracle."""
    from transformers import AutoModelForCausalLM

    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
