"""Problem sources (JSONL, parquet, builtin:arithmetic), prompt templates and the Grain pipeline."""

from erpo_jax.data.prompts import (
    PAPER_PROMPT_SUFFIX,
    EncodedPrompt,
    encode_prompt,
    messages_of,
    prompt_text,
)
from erpo_jax.data.records import BUILTIN_ARITHMETIC, Record
from erpo_jax.data.files import RecordSource, load_file
from erpo_jax.data.sources import open_source

__all__ = [
    "BUILTIN_ARITHMETIC", "PAPER_PROMPT_SUFFIX", "EncodedPrompt", "Record", "RecordSource", "encode_prompt",
    "load_file", "messages_of", "open_source", "prompt_text",
]
