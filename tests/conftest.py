"""Makes the shared test helpers in tests/ (tiny_runs) importable from tests/unit/** and tests/e2e/.

Tests never write to the user's compilation cache (~/.cache/erpo-jax/xla): erpo-jax sets up none
unless a test asks for one (tests/tiny_runs.py gives its runs a shared cache through JAX's own variable).
"""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
os.environ.setdefault("ERPO_JAX_CACHE_DIR", "off")
