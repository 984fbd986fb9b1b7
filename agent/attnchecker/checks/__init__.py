"""What every checked product shares: the per-call context (``context``), one product's check (``product``), the
records a check leaves (``records``), checksums passed from a projection to its attention (``passed``) and the engine's
caches (``caches``)."""
