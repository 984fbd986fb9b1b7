"""What a layer's q/k/v projections hand its attention in paper-faithful mode (config.source_repair False): per op, the
input-derived checksums of the projection output (PassedProjection), in a typed holder on the LayerContext
(PassedChecksums) that the attention empties. Legend as in attention.py."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..abft import Tolerance, checksum_weights, direction_bounds, times_skinny

__all__ = ["PassedChecksums", "PassedProjection"]


@dataclass(slots=True, kw_only=True)
class PassedProjection:
    """Checksum passing (paper-faithful mode): what a q/k/v projection hands to the attention of its layer.

    Stored in ``ctx.passed`` by check_linear; protected_sdpa takes it. All derived from the projection's input X
    and weights, never from its (unverified) output.
    """

    token_ref_NO2: torch.Tensor
    """Token-direction checksums (wᵀX)Wᵀ + (Σw)b of the projection output, acc dtype."""
    token_bound_NO: torch.Tensor
    """Round-off bound on their d1, to tell whether the actual output agrees (slow path only)."""
    x_NTI: torch.Tensor
    weight_OI: torch.Tensor
    bias_O: torch.Tensor | None
    x_norm_NT: torch.Tensor
    out_dtype: torch.dtype
    tol: Tolerance

    @property
    def tokens(self) -> int:
        return self.x_NTI.shape[-2]

    def token_bound_norm(self, heads: int) -> torch.Tensor:
        """(N, heads, 1): ‖per-feature bound‖₂ over each head's features. The passed q̄ (k̄) differs from wᵀQ (wᵀK)
        as computed by up to the projection's bound per feature, so a reference q̄ Kᵀ is off by up to this × ‖K_s‖."""
        n = self.token_bound_NO.shape[0]
        norm_NH1: torch.Tensor = torch.linalg.vector_norm(self.token_bound_NO.view(n, heads, -1), dim=-1, keepdim=True)
        return norm_NH1

    def feature_bound(self, heads: int) -> torch.Tensor:
        """(N, heads, T): bound on |v̂ - V w| per token and head (the projection's round-off, per head)."""
        in_features = self.weight_OI.shape[1]
        acc = self.token_ref_NO2.dtype
        w_norm_HD = torch.linalg.vector_norm(self.weight_OI.to(acc), dim=-1).view(heads, -1)
        bias_abs_HD = None if self.bias_O is None else self.bias_O.to(acc).abs().view(heads, -1)
        rules = direction_bounds(("row",), self.x_norm_NT[:, None, :], w_norm_HD[None], k=in_features,
                                 out_dtype=self.out_dtype, tol=self.tol, bias_abs_C=bias_abs_HD)
        return rules["row"].of(None)

    def feature_ref(self, heads: int) -> torch.Tensor:
        """(N, heads, T, 2): per-token, per-head feature-direction checksums X (W_hᵀ w) + b_h·w (V's v̂)."""
        acc = self.token_ref_NO2.dtype
        out_features, in_features = self.weight_OI.shape
        d = out_features // heads
        w_D2 = checksum_weights(d, self.x_NTI.device, acc)
        w_HDI = self.weight_OI.to(acc).view(heads, d, in_features)
        ww_IH2 = torch.einsum("hdi,dc->ihc", w_HDI, w_D2).reshape(in_features, heads * 2)
        ref_NTH2 = times_skinny(self.x_NTI.to(acc), ww_IH2).view(*self.x_NTI.shape[:-1], heads, 2)
        if self.bias_O is not None:
            ref_NTH2 = ref_NTH2 + self.bias_O.to(acc).view(heads, d) @ w_D2
        return ref_NTH2.transpose(-3, -2)


@dataclass(slots=True)
class PassedChecksums:
    """The checksums passed within one forward of a layer, by op ("q", "k", "v"): check_linear puts, the attention
    takes (each once); what an attention call does not use is dropped by it, never carried to the next forward."""

    by_op: dict[str, PassedProjection] = field(default_factory=dict)

    def put(self, op: str, passed: PassedProjection) -> None:
        self.by_op[op] = passed

    def take(self, op: str) -> PassedProjection | None:
        return self.by_op.pop(op, None)

    def __bool__(self) -> bool:
        return bool(self.by_op)
