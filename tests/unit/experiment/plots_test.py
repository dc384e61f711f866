"""Each model keeps one colour in every plot of a report, whichever plots and grids it appears in."""

import matplotlib.colors
import matplotlib.image
import numpy as np

from erpo_jax.experiment import plots


def has_color(png, color: str) -> bool:
  """Whether some pixel of the PNG is (within rounding) exactly this colour."""
  rgb = np.asarray(matplotlib.colors.to_rgb(color))
  pixels = matplotlib.image.imread(png)[..., :3]
  return bool((np.abs(pixels - rgb).max(axis=-1) < 2 / 255).any())


def test_a_variant_has_one_colour_for_its_runs_its_kl_lines_and_in_any_grid():
  assert plots.color("erpo_static") == plots.color("erpo_static-s1") == plots.color("erpo_static Query-KL")
  assert plots.color("untrained") == plots.BASE_COLOR
  names = ["grpo", "grpo_star", "query_kl", "erpo_static", "erpo_dynamic", "rloo", "rloo_erpo", "dapo", "dapo_erpo"]
  assert len({plots.color(n) for n in names}) == len(names)
  assert plots.BASE_COLOR not in {plots.color(n) for n in names}


def test_the_temperature_and_kl_plots_draw_a_variant_in_its_colour_even_after_the_untrained_model(tmp_path):
  temps = {"untrained": {"x": [0.5, 1.0], "avg": [0.1, 0.05], "pass": [0.2, 0.1]},
           "erpo_static": {"x": [0.5, 1.0], "avg": [0.3, 0.25], "pass": [0.4, 0.35]}}
  plots.temperature_plot(tmp_path / "t.png", temps, k=4)
  kl = {"erpo_static": ([1, 2, 3], [0.01, 0.02, 0.03])}
  plots.kl_pair_plot(tmp_path / "kl.png", kl, {"erpo_static": ([1, 3], [0.1, 0.2])})
  plots.step_plot(tmp_path / "r.png", {"erpo_static": ([1, 2, 3], [0.1, 0.2, 0.3])}, title="reward", ylabel="r")
  want = plots.color("erpo_static")
  for png in ("t.png", "kl.png", "r.png"):
    assert has_color(tmp_path / png, want), png
    # matplotlib's default cycle would have drawn the first line in its first colour
    assert not has_color(tmp_path / png, "tab:blue"), png
  assert has_color(tmp_path / "t.png", plots.BASE_COLOR)
