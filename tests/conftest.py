"""Makes the shared test helpers in tests/ (tiny_runs) importable from tests/unit/** and tests/e2e/."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
