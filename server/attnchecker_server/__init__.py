"""ATTNChecker collector: stores agents' fault events and interval statistics, serves the policy API and metrics.

Never imports torch or the agent package; the wire contract is docs/wire.md.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
