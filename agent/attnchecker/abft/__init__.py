"""Pure EEC-ABFT math: checksums, tolerances, locate/correct. Tensors in, tensors and reports out; no modules,
no I/O."""
from .checksum import (
    DirectionCheck,
    VectorSums,
    acc_dtype,
    checksum_weights,
    checksums_of,
    col_norms,
    times_skinny,
    vector_sums,
    verify_direction,
    weighted_cols,
    weighted_rows,
)
from .repair import MatrixReport, locate_and_fix, repair
from .tolerance import CALIBRATED_SIGMAS, NEAR_INF, Bound, Tolerance, bounds, gamma

__all__ = [
    "CALIBRATED_SIGMAS",
    "NEAR_INF",
    "Bound",
    "DirectionCheck",
    "MatrixReport",
    "Tolerance",
    "VectorSums",
    "acc_dtype",
    "bounds",
    "checksum_weights",
    "checksums_of",
    "col_norms",
    "gamma",
    "locate_and_fix",
    "repair",
    "times_skinny",
    "vector_sums",
    "verify_direction",
    "weighted_cols",
    "weighted_rows",
]
