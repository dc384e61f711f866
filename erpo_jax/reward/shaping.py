"""Reward shaping applied after the verifier: DAPO's soft overlong punishment (SPEC section 3).

Dimension letters: N rows (responses).
"""

from __future__ import annotations

import numpy as np


def overlong_penalty(response_len_N: np.ndarray, max_new_tokens: int, buffer: int,
                     factor: float = 1.0) -> np.ndarray:
  """R_len(y) of each response: 0 or negative, added to the verifier's reward.

  With L_max = max_new_tokens, L_cache = buffer and |y| the response length
  (tokens incl. EOS; a truncated response has |y| = L_max):

    R_len = 0                                          if |y| <= L_max - L_cache
    R_len = ((L_max - L_cache) - |y|) / L_cache * factor   if L_max - L_cache < |y| <= L_max

  so it falls linearly from 0 to -factor over the last L_cache tokens.
  buffer = 0 turns it off (all 0). float32 [N].
  """
  len_N = np.asarray(response_len_N, np.float64)
  if buffer <= 0:
    return np.zeros(len_N.shape, np.float32)
  if buffer >= max_new_tokens:
    raise ValueError(f"overlong buffer {buffer} must be below max_new_tokens {max_new_tokens}")
  start = max_new_tokens - buffer
  return np.where(len_N > start, (start - len_N) / buffer * factor, 0.0).astype(np.float32)
