"""The attention backward: ``fused`` (the fused CPU kernel at the verified forward), ``encoded`` (that kernel on
checksum-encoded operands, under protect(scope="all")) and ``checked`` (the checked products it recovers through)."""
