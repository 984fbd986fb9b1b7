"""Native kernels and how they are built and loaded (``build``): the one-pass checksum (``fused_pass``), the row
verdicts (``row_verify``) and the C sources beside them."""
