"""Each catalog GPU's dense peak FLOP/s per precision and its memory bandwidth, from the vendors' datasheets. No torch.

Dense figures only: NVIDIA prints Ampere-and-later tensor-core rates "with sparsity" (2:4, unused in training), twice
the dense rate kept here (494.5: a printed figure halved). GeForce FP16/BF16 figures are the FP32-accumulate rate
(what PyTorch asks for), from the architecture whitepaper. A figure not known exactly for the named card is None:
its MFU is then null, never a guess. `precision` keys: `fp32`, `tf32`, `bf16`, `fp16` (FP32 accumulation).
Bandwidth in bytes per second (decimal TB/s, GB/s)."""

from __future__ import annotations

from dataclasses import dataclass

T = 1e12  # TFLOPS
G = 1e9  # GB/s


@dataclass(frozen=True)
class Peaks:
    fp32: float | None
    tf32: float | None
    bf16: float | None
    fp16: float | None
    bandwidth: float | None  # bytes/s
    source: str  # the datasheet the figures come from

    def flops(self, precision: str) -> float | None:
        """The peak of `precision` (fp32, tf32, bf16, fp16); None where the datasheet gives none."""
        return {"fp32": self.fp32, "tf32": self.tf32, "bf16": self.bf16, "fp16": self.fp16}[precision]


PEAKS = {
    # NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column: FP32 67 TFLOPS; TF32 989, BF16/FP16 1,979
    # TFLOPS "with sparsity"; 4.8 TB/s. The H200 NVL (PCIe) card has lower rates, so this is the SXM card.
    "h200": Peaks(67 * T, 494.5 * T, 989.5 * T, 989.5 * T, 4.8e12, "NVIDIA H200 datasheet, H200 SXM"),
    # NVIDIA H100 Tensor Core GPU datasheet: SXM and PCIe differ (SXM 67 / 989 TF32 sparse / 1,979 BF16 sparse,
    # 3.35 TB/s; PCIe 51 / 756 / 1,513, 2 TB/s): the catalog's h100-80gb names both, so no single peak holds.
    "h100-80gb": Peaks(None, None, None, None, None,
                       "NVIDIA H100 datasheet: SXM and PCIe cards differ; name h100-sxm or h100-pcie"),
    "h100-sxm": Peaks(67 * T, 494.5 * T, 989.5 * T, 989.5 * T, 3.35e12, "NVIDIA H100 datasheet, H100 SXM"),
    "h100-pcie": Peaks(51 * T, 378 * T, 756.5 * T, 756.5 * T, 2.0e12, "NVIDIA H100 datasheet, H100 PCIe"),
    "h100-nvl": Peaks(None, None, None, None, None, "NVIDIA H100 NVL datasheet (figures not at hand: left unknown)"),
    # NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5 TFLOPS, TF32 156 (312 sparse), BF16/FP16 312 (624 sparse) for
    # every A100; bandwidth 1,555 GB/s for the 40GB cards, 2,039 GB/s for the 80GB SXM (1,935 GB/s 80GB PCIe).
    "a100-80gb": Peaks(19.5 * T, 156 * T, 312 * T, 312 * T, 2039 * G, "NVIDIA A100 datasheet, A100 80GB SXM"),
    "a100-40gb": Peaks(19.5 * T, 156 * T, 312 * T, 312 * T, 1555 * G, "NVIDIA A100 datasheet, A100 40GB"),
    # NVIDIA L40S datasheet: FP32 91.6 TFLOPS, TF32 366, BF16/FP16 733 "with sparsity"; 864 GB/s.
    "l40s": Peaks(91.6 * T, 183 * T, 366.5 * T, 366.5 * T, 864 * G, "NVIDIA L40S datasheet"),
    # NVIDIA L4 datasheet: FP32 30.3 TFLOPS, TF32 120, BF16/FP16 242 "with sparsity"; 300 GB/s.
    "l4": Peaks(30.3 * T, 60 * T, 121 * T, 121 * T, 300 * G, "NVIDIA L4 datasheet"),
    "a10g": Peaks(None, None, None, None, None, "AWS publishes no per-precision datasheet for the A10G"),
    "a10": Peaks(31.2 * T, 62.5 * T, 125 * T, 125 * T, 600 * G, "NVIDIA A10 datasheet"),
    "a40": Peaks(37.4 * T, 74.8 * T, 149.7 * T, 149.7 * T, 696 * G, "NVIDIA A40 datasheet"),
    # NVIDIA RTX A6000 datasheet: FP32 38.7 TFLOPS, 768 GB/s (its tensor rates are printed with sparsity only).
    "rtx-a6000": Peaks(38.7 * T, None, None, None, 768 * G, "NVIDIA RTX A6000 datasheet"),
    # NVIDIA T4 datasheet: FP32 8.1 TFLOPS, mixed-precision (FP16/FP32) 65 TFLOPS; 320 GB/s; no TF32 or BF16.
    "t4": Peaks(8.1 * T, None, None, 65 * T, 320 * G, "NVIDIA T4 datasheet"),
    # NVIDIA V100 datasheet, SXM2 column (the DGX-1 card of the papers' clusters): FP32 15.7 TFLOPS, tensor 125
    # TFLOPS (FP16 inputs); 900 GB/s for both memory sizes. Volta has no TF32 or BF16.
    "v100-32gb": Peaks(15.7 * T, None, None, 125 * T, 900 * G, "NVIDIA V100 datasheet, V100 SXM2"),
    "v100-16gb": Peaks(15.7 * T, None, None, 125 * T, 900 * G, "NVIDIA V100 datasheet, V100 SXM2"),
    # NVIDIA Tesla P100 datasheet: "P100 for NVLink-optimized servers" (SXM2) FP32 10.6 TFLOPS, "P100 for PCIe-based
    # servers" 9.3 TFLOPS (p100-16gb does not say which); 732 GB/s for both 16GB cards. Pascal has no tensor cores (so
    # no TF32, BF16, or FP16 with FP32 accumulation: its printed 21.2 / 18.7 half-precision TFLOPS accumulate in FP16,
    # which PyTorch does not use).
    "p100-16gb": Peaks(None, None, None, None, 732 * G, "NVIDIA Tesla P100 datasheet (SXM2 or PCIe rates differ)"),
    "p100-sxm2": Peaks(10.6 * T, None, None, None, 732 * G, "NVIDIA Tesla P100 datasheet, P100 SXM2 (NVLink)"),
    "p100-pcie": Peaks(9.3 * T, None, None, None, 732 * G, "NVIDIA Tesla P100 datasheet, P100 PCIe 16GB"),
    "rtx4090": Peaks(82.6 * T, 82.6 * T, 165.2 * T, 165.2 * T, 1008 * G, "NVIDIA Ada GPU architecture whitepaper"),
    "rtx4080": Peaks(None, None, None, None, None, "NVIDIA Ada whitepaper (RTX 4080 figures not at hand: unknown)"),
    "rtx3090": Peaks(35.6 * T, 35.6 * T, 71 * T, 71 * T, 936 * G, "NVIDIA Ampere GA102 whitepaper"),
    "rtx3080-10gb": Peaks(29.8 * T, 29.8 * T, 59.5 * T, 59.5 * T, 760 * G, "NVIDIA Ampere GA102 whitepaper"),
    "mi300x": Peaks(163.4 * T, 653.7 * T, 1307.4 * T, 1307.4 * T, 5.3e12, "AMD Instinct MI300X data sheet"),
}


def peaks_of(name: str | None) -> Peaks | None:
    """The peaks of the catalog GPU `name` (a catalog key), None when it has none."""
    return PEAKS.get(name) if name else None


def on_card(key: str, capability: tuple[int, int]) -> str:
    """The datasheet column `key` runs in on a card of this CUDA compute capability: before Ampere (8.0) there are no
    TF32 tensor cores, and FP32 products (cuDNN's TF32 default for convolutions included) run on the CUDA cores, the
    fp32 column."""
    return "fp32" if key == "tf32" and capability < (8, 0) else key


def precision_key(precision: str, tf32: bool = False) -> str:
    """The datasheet column a run's matrix products use: bf16/fp16 as the recipe says; fp32 runs on TF32 tensor cores
    when PyTorch lets them (`torch.backends.cuda.matmul.allow_tf32`, or cuDNN's default for convolutions)."""
    if precision in ("bf16", "fp16"):
        return precision
    return "tf32" if tf32 else "fp32"


# torch.cuda.get_device_name() of the cards whose peaks are known, by the words it contains (first match wins);
# memory (GiB, from torch.cuda.get_device_properties) tells the 40 and 80 GB A100s and 16 and 32 GB V100s apart.
_DEVICE_NAMES = (
    (("h200", "nvl"), None), (("h200",), "h200"),
    (("h100", "nvl"), "h100-nvl"), (("h100", "pcie"), "h100-pcie"), (("h100",), "h100-sxm"),
    (("a100",), "a100"), (("l40s",), "l40s"), (("l4",), "l4"), (("a10g",), "a10g"), (("a40",), "a40"),
    (("a10",), "a10"), (("rtx a6000",), "rtx-a6000"), (("t4",), "t4"), (("v100", "pcie"), None),
    (("v100",), "v100"), (("p100", "sxm2"), "p100-sxm2"), (("p100", "pcie"), "p100-pcie"), (("rtx 4090",), "rtx4090"),
    (("rtx 4080",), "rtx4080"), (("rtx 3090",), "rtx3090"),
    (("rtx 3080",), "rtx3080-10gb"), (("mi300x",), "mi300x"),
)


def identify(device_name: str, memory_gib: float) -> str | None:
    """The catalog key of a local GPU from its name (`torch.cuda.get_device_name`); None when its peaks are unknown."""
    name = device_name.lower()
    for words, key in _DEVICE_NAMES:
        if all(word in name for word in words):
            if key == "a100":
                return "a100-80gb" if memory_gib > 48 else "a100-40gb"
            if key == "v100":
                return "v100-32gb" if memory_gib > 20 else "v100-16gb"
            return key
    return None
