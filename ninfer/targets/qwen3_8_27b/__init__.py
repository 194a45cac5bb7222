"""Qwen3.8-27B: the Qwen3.6-27B architecture and dims under its own model_type and chat template."""

from ninfer.targets.package import Package
from ninfer.targets.qwen3_6_27b import VARIANT

PACKAGE = Package(
    name="qwen3_8_27b",
    variant=VARIANT,
    description="Qwen3.8-27B (dense, Qwen3.6 architecture; DFlash2 drafter target)",
    hf_model_type="qwen4_exp",
    chat_template="qwen3_8",
)
