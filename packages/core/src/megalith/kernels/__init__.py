"""Triton kernels with torch fallbacks behind one registry (layer 3).

Kernels: RMSNorm (fwd+bwd), rotary embedding (HF rotate_half convention), SwiGLU (alone or fused
with the gate/up matmul of a Llama MLP), fused linear + cross-entropy over row chunks (no [T, V]
logits), fused AdamW. Triton is imported only when a Triton backend runs; see `registry` for how
the backend is chosen (`MEGALITH_KERNELS=torch` forces the fallbacks).
"""

from megalith.kernels.adamw import FusedAdamW, adamw_step
from megalith.kernels.functional import (
    apply_rotary,
    fused_linear_cross_entropy,
    rms_norm,
    swiglu,
    swiglu_mlp,
)
from megalith.kernels.modules import KernelRMSNorm
from megalith.kernels.registry import (
    get_kernel,
    interpret_mode,
    kernel_names,
    pick_backend,
    register_kernel,
    triton_available,
)

__all__ = [
    "FusedAdamW",
    "KernelRMSNorm",
    "adamw_step",
    "apply_rotary",
    "fused_linear_cross_entropy",
    "get_kernel",
    "interpret_mode",
    "kernel_names",
    "pick_backend",
    "register_kernel",
    "rms_norm",
    "swiglu",
    "swiglu_mlp",
    "triton_available",
]
