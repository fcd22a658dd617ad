"""device_peak_flops: the dense datasheet peak of each GPU torch can name, None elsewhere."""

import pytest
import torch

from pipeline.train.metrics import device_peak_flops

T = 1e12

# (name as torch.cuda.get_device_name() reports it, bf16, fp16, fp32) in dense TFLOPS
KNOWN = [
    ("NVIDIA H100 80GB HBM3", 989.5, 989.5, 67),  # SXM5
    ("NVIDIA H100 PCIe", 756.5, 756.5, 51),
    ("NVIDIA H100 NVL", 835.5, 835.5, 60),
    ("NVIDIA H200", 989.5, 989.5, 67),  # SXM
    ("NVIDIA H200 NVL", 835.5, 835.5, 60),
    ("NVIDIA GH200 480GB", 989.5, 989.5, 67),
    ("NVIDIA A100-SXM4-40GB", 312, 312, 19.5),
    ("NVIDIA A100-SXM4-80GB", 312, 312, 19.5),
    ("NVIDIA A100-PCIE-40GB", 312, 312, 19.5),
    ("NVIDIA A100 80GB PCIe", 312, 312, 19.5),
    ("NVIDIA A10G", 70, 70, 35),
    ("NVIDIA A10", 125, 125, 31.2),
    ("NVIDIA L4", 121, 121, 30.3),
    ("NVIDIA L40S", 362.05, 362.05, 91.6),
    ("NVIDIA RTX 6000 Ada Generation", 364.2, 364.2, 91.1),
    ("Tesla V100-SXM2-16GB", None, 125, 15.7),
    ("Tesla V100-SXM2-32GB", None, 125, 15.7),
    ("Tesla V100-PCIE-16GB", None, 112, 14),
    ("Tesla V100S-PCIE-32GB", None, 130, 16.4),
]


@pytest.mark.parametrize(("name", "bf16", "fp16", "fp32"), KNOWN)
def test_known_devices_get_their_datasheet_dense_peak(name, bf16, fp16, fp32):
    for precision, want in (("bf16", bf16), ("fp16", fp16), ("fp32", fp32)):
        got = device_peak_flops(precision, name)
        if want is None:
            assert got is None, (name, precision)
        else:
            assert got == pytest.approx(want * T, rel=1e-9), (name, precision)


def test_figures_the_issue_quotes():
    assert device_peak_flops("bf16", "NVIDIA H100 80GB HBM3") == pytest.approx(989e12, rel=1e-3)
    assert device_peak_flops("bf16", "NVIDIA H100 PCIe") == pytest.approx(756e12, rel=1e-3)
    assert device_peak_flops("bf16", "NVIDIA H100 NVL") == pytest.approx(835e12, rel=1e-3)
    # a PCIe H100 is no longer taken for an SXM one
    assert device_peak_flops("bf16", "NVIDIA H100 PCIe") < device_peak_flops(
        "bf16", "NVIDIA H100 80GB HBM3"
    )


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA GeForce RTX 4090",
        "NVIDIA H100",  # form factor unknown
        "NVIDIA H800",
        "NVIDIA H20",
        "NVIDIA A800-SXM4-80GB",
        "NVIDIA L40",
        "Quadro RTX 6000",  # Turing, not the Ada card
        "Tesla V100-SXM3-32GB",
        "NVIDIA A100-SXM4-40GB MIG 3g.20gb",  # a slice of the GPU
        "",
    ],
)
def test_unknown_names_give_none(name):
    assert all(device_peak_flops(p, name) is None for p in ("bf16", "fp16", "fp32"))


def test_unknown_precision_gives_none():
    assert device_peak_flops("fp8", "NVIDIA H100 80GB HBM3") is None


def test_without_a_name_it_asks_torch():
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        assert device_peak_flops("bf16") == device_peak_flops("bf16", name)
    else:
        assert device_peak_flops("bf16") is None
