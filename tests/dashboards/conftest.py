"""Makes dashboard_queries importable from these tests under either pytest import mode (prepend or importlib)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
