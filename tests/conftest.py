"""Shared fixtures, and the `system` marker on every test under tests/system (so `-m "not system"`
and `pytest tests/unit` select the same tests). Triton runs in interpreter mode on machines without
CUDA; that must be decided before anything imports triton."""

import atexit
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

import pytest  # noqa: E402

from rekv_core.model import Model, embedded_gguf_path, load_weights  # noqa: E402
from rekv_core.model.tokenizer import GGUFTokenizer  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SYSTEM = Path(__file__).resolve().parent / "system"


def pytest_collection_modifyitems(items):
    """Marks `system` every test whose file is under tests/system: the folder is the marker."""
    for item in items:
        if SYSTEM in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.system)


@pytest.fixture(scope="session")
def smollm_fp32() -> Model:
    return Model(load_weights("smollm2-135m", torch.float32))


@pytest.fixture(scope="session")
def smollm_bf16(smollm_fp32) -> Model:
    from dataclasses import fields

    from rekv_core.model.weights import LayerWeights, ModelWeights

    w = smollm_fp32.weights

    def cast(t):
        return None if t is None else t.to(torch.bfloat16)

    layers = [LayerWeights(**{f.name: cast(getattr(lw, f.name)) for f in fields(LayerWeights)})
              for lw in w.layers]
    embed = cast(w.embed)
    return Model(ModelWeights(shape=w.shape, embed=embed, layers=layers,
                              final_norm=cast(w.final_norm), lm_head=embed))


@pytest.fixture(scope="session")
def tokenizer() -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(embedded_gguf_path())


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
