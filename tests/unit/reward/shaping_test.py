"""DAPO's overlong penalty (erpo_jax.reward.shaping) at the lengths of the worked example in docs/SPEC.md."""

import numpy as np
import pytest

from erpo_jax.reward.shaping import overlong_penalty


def test_overlong_penalty_at_the_boundary_lengths_of_the_spec_example():
  # L_max = 32, L_cache = 8: free up to 24 tokens, then (24 - |y|) / 8 down to -1 at 32 (a truncated response).
  got = overlong_penalty(np.array([1, 24, 25, 28, 31, 32]), 32, 8, 1.0)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.125, -0.5, -0.875, -1.0], rtol=0, atol=1e-7)


def test_the_factor_scales_the_penalty_and_a_zero_buffer_turns_it_off():
  np.testing.assert_allclose(overlong_penalty(np.array([24, 25, 32]), 32, 8, 0.5), [0.0, -0.0625, -0.5])
  np.testing.assert_array_equal(overlong_penalty(np.array([1, 32]), 32, 0, 1.0), [0.0, 0.0])
  assert overlong_penalty(np.array([32]), 32, 8).dtype == np.float32


def test_a_buffer_as_long_as_the_limit_is_refused():
  with pytest.raises(ValueError, match="below max_new_tokens"):
    overlong_penalty(np.array([4]), 8, 8)
