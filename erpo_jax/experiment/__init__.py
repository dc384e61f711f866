"""The paper's ablation at any scale: `erpo-jax experiment` (grid, eval, report) and `erpo-jax analyze`.

grid.py (variants and run folders), stats.py and report.py (pure numbers and markdown),
plots.py (matplotlib), analyze.py (question vs response NLL), runner.py (orchestration).
"""
