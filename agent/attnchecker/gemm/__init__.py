"""Checked GEMMs: the attention projections (``projection``), every Linear/Conv1D under protect(scope="all")
(``linear``, ``check``) and the whole-step schedule (``schedule``)."""
