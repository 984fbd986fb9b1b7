"""What runs around the engine: ``guard`` (protect() and the step clock), ``attach``, ``link`` (the collector),
``response`` (to faults), ``report``, ``coverage`` and ``streaming`` (interval statistics)."""
