"""The one GPU table: what the planner plans with and what a run's MFU divides by.

Each row is one NVIDIA part: a key (`meshforge plan --gpu KEY`, `gpus.kind` in a
cost file), a label (what `report.json` names as the peak's source), a regular
expression that fully matches the normalised CUDA device name
(`torch.cuda.get_device_name`, upper-cased, `NVIDIA`/`Tesla`/`GeForce` dropped,
separators folded to one space), dense peaks by dtype, memory, memory bandwidth,
architecture, the link between GPUs of one node that the part usually comes with,
and the datasheet the figures come from.

Figures are the vendor datasheets', dense (no sparsity): where a datasheet prints
only the sparse figure (marked * there) the dense one is half of it. fp32 is plain
FP32 on CUDA cores; tf32 is FP32 matmuls on tensor cores (what PyTorch runs when
`torch.backends.cuda.matmul.allow_tf32` is on). GeForce figures are FP16/BF16 with
FP32 accumulate, what PyTorch uses. None where the part has no such unit (bf16 on
Volta and Turing). Memory is in GB (10^9 bytes) and bandwidth in TB/s, as the
datasheets print them. A GPU that is not here has no peak: never another's figure.

Pure Python, no torch import: `meshforge plan` reads it without starting torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DTYPES = ("bf16", "fp16", "tf32", "fp32")


@dataclass(frozen=True)
class Gpu:
    key: str  # catalogue key: --gpu KEY
    label: str  # in PeakFlops sources: "table:<label> <dtype> dense"
    cuda_name: str  # full match against the normalised CUDA device name
    bf16: float | None  # dense TFLOP/s; None: no such unit
    fp16: float | None
    tf32: float | None
    fp32: float
    memory_gb: float
    memory_bandwidth_tbs: float
    architecture: str  # volta | turing | ampere | ada | hopper
    intra_link: str  # link preset between the GPUs of one node (plan/core/hardware.py)
    source: str  # the datasheet the figures come from

    def peak_tflops(self, dtype: str) -> float | None:
        """Dense TFLOP/s for a canonical dtype (bf16, fp16, tf32, fp32)."""
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
        return getattr(self, dtype)

    def peak_flops_per_s(self) -> dict[str, float]:
        """Dense FLOP/s by dtype, for the dtypes the part has."""
        peaks = {dtype: self.peak_tflops(dtype) for dtype in DTYPES}
        return {dtype: tflops * 1e12 for dtype, tflops in peaks.items() if tflops is not None}


_A100 = "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100/)"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/)"
_GH200 = (
    "NVIDIA GH200 Grace Hopper Superchip datasheet "
    "(nvidia.com/en-us/data-center/grace-hopper-superchip/)"
)
_L4 = "NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4/)"
_L40 = "NVIDIA L40 GPU datasheet (nvidia.com/en-us/data-center/l40/)"
_L40S = "NVIDIA L40S GPU datasheet (nvidia.com/en-us/data-center/l40s/)"
_A10 = "NVIDIA A10 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/products/a10-gpu/)"
_A30 = "NVIDIA A30 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/products/a30-gpu/)"
_A40 = "NVIDIA A40 GPU datasheet (nvidia.com/en-us/data-center/a40/)"
_V100 = "NVIDIA V100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/v100/)"
_T4 = "NVIDIA T4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/tesla-t4/)"
_ADA = "NVIDIA Ada GPU architecture whitepaper, RTX 4090 (FP16/BF16 with FP32 accumulate)"
_GA102 = "NVIDIA Ampere GA102 GPU architecture whitepaper, RTX 3090 (FP16 with FP32 accumulate)"

# fmt: off
GPUS: tuple[Gpu, ...] = (
    # key, label, CUDA name (normalised)
    #   bf16, fp16, tf32, fp32 (dense TFLOP/s), GB, TB/s, architecture, intra link, source
    Gpu("a100-40gb", "A100 SXM 40GB", r"A100 SXM4? 40GB",
        312, 312, 156, 19.5, 40, 1.555, "ampere", "nvlink3", _A100),
    Gpu("a100-80gb", "A100 SXM 80GB", r"A100 SXM4? 80GB",
        312, 312, 156, 19.5, 80, 2.039, "ampere", "nvlink3", _A100),
    Gpu("a100-pcie-40gb", "A100 PCIe 40GB", r"A100 (PCIE 40GB|40GB PCIE)",
        312, 312, 156, 19.5, 40, 1.555, "ampere", "pcie4", _A100),
    Gpu("a100-pcie-80gb", "A100 PCIe 80GB", r"A100 (PCIE 80GB|80GB PCIE)",
        312, 312, 156, 19.5, 80, 1.935, "ampere", "pcie4", _A100),
    Gpu("h100", "H100 SXM", r"H100( SXM5?)?( \d+GB)?( HBM3)?",
        989, 989, 494.5, 67, 80, 3.35, "hopper", "nvlink4", _H100),
    Gpu("h100-pcie", "H100 PCIe", r"H100( \d+GB)? (PCIE|HBM2E)|H100 PCIE( \d+GB)?",
        756, 756, 378, 51, 80, 2.0, "hopper", "pcie5", _H100),
    Gpu("h100-nvl", "H100 NVL", r"H100 NVL( \d+GB)?",
        835.5, 835.5, 417.5, 60, 94, 3.9, "hopper", "pcie5", _H100),
    Gpu("h200", "H200 SXM", r"H200( SXM5?)?( \d+GB)?( HBM3E)?",
        989, 989, 494.5, 67, 141, 4.8, "hopper", "nvlink4", _H200),
    Gpu("h200-nvl", "H200 NVL", r"H200 NVL( \d+GB)?",
        835.5, 835.5, 417.5, 60, 141, 4.8, "hopper", "pcie5", _H200),
    Gpu("gh200", "GH200", r"GH200( (96|480)GB)?( HBM3)?",
        989, 989, 494.5, 67, 96, 4.0, "hopper", "nvlink4", _GH200),
    Gpu("gh200-144gb", "GH200 144GB", r"GH200 144GB?( HBM3E)?|GH200( \d+GB?)? HBM3E",
        989, 989, 494.5, 67, 144, 4.9, "hopper", "nvlink4", _GH200),
    Gpu("l4", "L4", r"L4",
        121, 121, 60, 30.3, 24, 0.3, "ada", "pcie4", _L4),
    Gpu("l40", "L40", r"L40",
        181.05, 181.05, 90.5, 90.5, 48, 0.864, "ada", "pcie4", _L40),
    Gpu("l40s", "L40S", r"L40S",
        362.05, 362.05, 183, 91.6, 48, 0.864, "ada", "pcie4", _L40S),
    Gpu("a10", "A10", r"A10",
        125, 125, 62.5, 31.2, 24, 0.6, "ampere", "pcie4", _A10),
    Gpu("a30", "A30", r"A30",
        165, 165, 82, 10.3, 24, 0.933, "ampere", "pcie4", _A30),
    Gpu("a40", "A40", r"A40",
        149.7, 149.7, 74.8, 37.4, 48, 0.696, "ampere", "pcie4", _A40),
    Gpu("v100-sxm2-16gb", "V100 SXM2 16GB", r"V100 SXM2( 16GB)?",
        None, 125, None, 15.7, 16, 0.9, "volta", "nvlink2", _V100),
    Gpu("v100-sxm2-32gb", "V100 SXM2 32GB", r"V100 SXM2 32GB",
        None, 125, None, 15.7, 32, 0.9, "volta", "nvlink2", _V100),
    Gpu("v100-pcie-16gb", "V100 PCIe 16GB", r"V100 PCIE( 16GB)?",
        None, 112, None, 14, 16, 0.9, "volta", "pcie3", _V100),
    Gpu("v100-pcie-32gb", "V100 PCIe 32GB", r"V100 PCIE 32GB",
        None, 112, None, 14, 32, 0.9, "volta", "pcie3", _V100),
    Gpu("v100s-pcie", "V100S PCIe", r"V100S PCIE( 32GB)?",
        None, 130, None, 16.4, 32, 1.134, "volta", "pcie3", _V100),
    Gpu("t4", "T4", r"T4",
        None, 65, None, 8.1, 16, 0.32, "turing", "pcie3", _T4),
    Gpu("rtx-4090", "RTX 4090", r"RTX 4090",
        165.2, 165.2, 82.6, 82.6, 24, 1.008, "ada", "pcie4", _ADA),
    Gpu("rtx-3090", "RTX 3090", r"RTX 3090",
        71, 71, 35.6, 35.6, 24, 0.936, "ampere", "pcie4", _GA102),
)
# fmt: on

GPU_BY_KEY: dict[str, Gpu] = {gpu.key: gpu for gpu in GPUS}
# Other spellings of a key that users type.
ALIASES = {"a100": "a100-80gb", "h100-sxm": "h100", "h200-sxm": "h200"}


def gpu_key(name: str) -> str | None:
    """The table's key for `name` (a key or an alias, any case), or None."""
    key = ALIASES.get(name.lower(), name.lower())
    return key if key in GPU_BY_KEY else None


def normalise_cuda_name(name: str) -> str:
    """'NVIDIA A100-SXM4-80GB' -> 'A100 SXM4 80GB'; 'Tesla V100-PCIE-32GB' -> 'V100 PCIE 32GB'."""
    text = re.sub(r"[\s\-_]+", " ", name.upper()).strip()
    for prefix in ("NVIDIA ", "TESLA ", "GEFORCE "):
        text = text.removeprefix(prefix)
    return text


def match_cuda_name(name: str) -> Gpu | None:
    """The row whose pattern fully matches the CUDA device name `name`, or None."""
    normalised = normalise_cuda_name(name)
    matches = [gpu for gpu in GPUS if re.fullmatch(gpu.cuda_name, normalised)]
    # Patterns are exclusive by construction (a test checks it); two would be a table bug.
    return matches[0] if len(matches) == 1 else None
