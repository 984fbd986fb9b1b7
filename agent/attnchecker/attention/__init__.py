"""The checked attention: ``pipeline`` (the protected call: tier 1, dispatch to a backend, events), ``tripwire`` (tier 1
on the fused kernel), ``backends/`` (every way of computing a checked forward, behind one contract) and ``backward/``
(the checked attention backward)."""
