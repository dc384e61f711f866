"""Prompt text and tokens of a Record: system prompt, question suffix, chat template, length limit."""

from __future__ import annotations

import dataclasses

from erpo_jax.data.records import Record
from erpo_jax.errors import DataError

# The instruction the paper appends to every question (SPEC.md, "Paper setup").
PAPER_PROMPT_SUFFIX = ("You FIRST think about the reasoning process as an internal monologue and then provide the "
                       "final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
                       "answer MUST BE put in \\boxed{}.")


def with_suffix(question: str, suffix: str) -> str:
  """question + suffix, joined by one space unless the suffix starts with whitespace."""
  if not suffix:
    return question
  return question + (suffix if suffix[:1].isspace() else " " + suffix)


def messages_of(record: Record, system_prompt: str = "", suffix: str = "") -> list[dict]:
  """Chat messages: [system_prompt], then the record's question or messages with `suffix` on the last user turn.

  A record that brings its own system message keeps it (system_prompt is not added).
  """
  if isinstance(record.prompt, str):
    turns = [("user", record.prompt)]
  else:
    turns = list(record.prompt)
  last_user = max((k for k, (role, _) in enumerate(turns) if role == "user"), default=len(turns) - 1)
  turns[last_user] = (turns[last_user][0], with_suffix(turns[last_user][1], suffix))
  if system_prompt and not any(role == "system" for role, _ in turns):
    turns.insert(0, ("system", system_prompt))
  return [{"role": role, "content": content} for role, content in turns]


def prompt_text(record: Record, tokenizer, data) -> str:
  """The exact prompt text fed to the model under DataSection `data`.

  chat_template=True: tokenizer.render_chat(messages, add_generation_prompt=True);
  otherwise the message contents joined by blank lines.
  """
  messages = messages_of(record, data.system_prompt, data.prompt_suffix)
  if data.chat_template:
    return tokenizer.render_chat(messages, add_generation_prompt=True)
  return "\n\n".join(m["content"] for m in messages)


def overlong_error(record: Record, n_tokens: int, max_tokens: int) -> DataError:
  return DataError(f"{record.source}: record '{record.id}': prompt has {n_tokens} tokens, more than "
                   f"data.max_prompt_tokens={max_tokens} (raise it, or set data.on_overlong to truncate or skip)")


@dataclasses.dataclass(frozen=True)
class EncodedPrompt:
  text: str  # prompt text as rendered (before any truncation)
  tokens: list[int]  # [P] prompt token ids, at most data.max_prompt_tokens
  overlong: bool  # the rendered prompt had more than data.max_prompt_tokens tokens
  # [P] the tokens of the user's question text, aligned with tokens; None when the chat template
  # rewrote the question so that it cannot be located (erpo.query_span=question then refuses the record)
  question_mask: list[bool] | None


def fit_length(tokens: list, max_tokens: int, bos_id: int | None) -> list:
  """Left truncation to max_tokens: keeps the end (the question's last words, the suffix and the
  assistant header of the chat template) and a leading BOS token."""
  if len(tokens) <= max_tokens:
    return tokens
  if bos_id is not None and tokens and tokens[0] == bos_id:
    return [bos_id] + tokens[len(tokens) - max_tokens + 1:]
  return tokens[len(tokens) - max_tokens:]


def fit_mask(tokens: list[int], mask: list[bool], max_tokens: int, bos_id: int | None) -> list[bool]:
  """The question mask of fit_length(tokens): the same positions kept."""
  kept = fit_length(list(range(len(tokens))), max_tokens, None)
  if len(tokens) > max_tokens and bos_id is not None and tokens and tokens[0] == bos_id:
    kept = [0] + kept[1:]
  return [mask[i] for i in kept]


def question_of(record: Record) -> str:
  """The user's question: the record's text, or the content of its last user turn (before any suffix)."""
  if isinstance(record.prompt, str):
    return record.prompt
  users = [content for role, content in record.prompt if role == "user"]
  return users[-1] if users else record.prompt[-1][1]


def question_span(record: Record, text: str) -> tuple[int, int] | None:
  """[start, end) characters of the question in the rendered prompt `text`: its last occurrence, which
  is the last user turn (a system prompt or an earlier turn may repeat the words); None if absent."""
  question = question_of(record)
  for q in (question, question.strip()):
    start = text.rfind(q) if q else -1
    if start >= 0:
      return start, start + len(q)
  return None


def unlocated_question_error(record: Record) -> DataError:
  return DataError(f"{record.source}: record '{record.id}': the chat template changed the question text, so its "
                   f"tokens cannot be located in the prompt; use erpo.query_span=prompt")


def question_mask(offsets: list[tuple[int, int]], span: tuple[int, int]) -> list[bool]:
  """Per token: does its character span [a, b) overlap the question's [start, end)?"""
  start, end = span
  return [a < end and b > start for a, b in offsets]


def encode_prompt(record: Record, tokenizer, data, *, check: bool = True) -> EncodedPrompt:
  """Rendered and tokenized prompt; overlong prompts follow data.on_overlong.

  truncate: cut from the left (see fit_length); skip: returned whole with overlong=True
  for the caller to drop; error: DataError naming the record (check=False leaves that
  to the caller, e.g. to raise it in the main process rather than in a data worker).
  """
  text = prompt_text(record, tokenizer, data)
  tokens, offsets = tokenizer.encode_with_offsets(text)
  span = question_span(record, text)
  mask = None if span is None else question_mask(offsets, span)
  overlong = len(tokens) > data.max_prompt_tokens
  if overlong and data.on_overlong == "error" and check:
    raise overlong_error(record, len(tokens), data.max_prompt_tokens)
  if overlong and data.on_overlong == "truncate" and mask is not None:
    mask = fit_mask(tokens, mask, data.max_prompt_tokens, tokenizer.bos_id)
  if overlong and data.on_overlong == "truncate":
    tokens = fit_length(tokens, data.max_prompt_tokens, tokenizer.bos_id)
  return EncodedPrompt(text=text, tokens=tokens, overlong=overlong, question_mask=mask)
