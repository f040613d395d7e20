"""What names the machine in a profile's fingerprint: the CUDA device's name (index 0 where none
is given), else the CPU's model name from /proc/cpuinfo, else what `platform` says."""

import pytest
import torch

from rekv_core.plan import profile_cache
from rekv_core.plan.profile_cache import fingerprint, machine_name

CPUINFO = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14: 96-Core\n"
           "flags\t\t: fpu avx2\n")


class _Files:
    def __init__(self, text):
        self.text, self.opened = text, []

    def __call__(self, path):
        self.opened.append(path)
        return self

    def read_text(self):
        if self.text is None:
            raise OSError("no such file")
        return self.text


@pytest.fixture
def platform_says(monkeypatch):
    def says(processor, machine):
        monkeypatch.setattr(profile_cache.platform, "processor", lambda: processor)
        monkeypatch.setattr(profile_cache.platform, "machine", lambda: machine)
    says("Intel64 Family 6", "x86_64")
    return says


def test_the_cpu_is_named_by_its_model_name_line(monkeypatch, platform_says):
    files = _Files(CPUINFO)
    monkeypatch.setattr(profile_cache, "Path", files)
    assert machine_name() == "AMD EPYC 9R14: 96-Core"  # the first colon splits, no other
    assert machine_name("cpu") == "AMD EPYC 9R14: 96-Core"
    assert files.opened == ["/proc/cpuinfo"] * 2
    files.text = "processor\t: 0\nmodel name without a colon\n"
    assert machine_name() == "Intel64 Family 6"


def test_without_cpuinfo_platform_names_it(monkeypatch, platform_says):
    monkeypatch.setattr(profile_cache, "Path", _Files(None))
    assert machine_name() == "Intel64 Family 6"
    platform_says("", "aarch64")
    assert machine_name() == "aarch64"
    platform_says("", "")
    assert machine_name() == "unknown"


def test_a_cuda_device_is_named_by_cuda_and_defaults_to_index_0(monkeypatch):
    asked = []
    monkeypatch.setattr(profile_cache.torch.cuda, "get_device_name",
                        lambda device: asked.append(device) or "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(profile_cache, "Path", _Files(CPUINFO))
    assert machine_name("cuda:1") == "NVIDIA H100 80GB HBM3"
    assert asked == [torch.device("cuda", 1)]
    assert machine_name(torch.device("cpu")) == "AMD EPYC 9R14: 96-Core" and len(asked) == 1
    print_ = fingerprint("m", "cuda", torch.bfloat16, 2)
    assert print_["device"] == "cuda:0" and asked[-1] == torch.device("cuda", 0)
    assert fingerprint("m", "cuda:1", "torch.bfloat16", 2)["device"] == "cuda:1"
    assert asked[-1] == torch.device("cuda", 1)
    assert fingerprint("m", "cpu", torch.float32, 3) == {
        "model": "m", "machine": "AMD EPYC 9R14: 96-Core", "torch": torch.__version__,
        "device": "cpu", "dtype": "float32", "torch_threads": 3}
