"""Keyword-only services over one Session; they raise errors.CollectorError subclasses, never HTTPException."""
