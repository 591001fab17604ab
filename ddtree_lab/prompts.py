"""Prompts: raw text, chat messages (through the checkpoint's chat template) or token ids."""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

from .pairs import prompt_set_path


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], special_tokens: dict, add_generation_prompt=True) -> str:
    """Render chat messages with a checkpoint's Jinja chat template (compiled once per template)."""
    return _compiled_template(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                               **special_tokens)


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_chat(messages: list[dict]) -> None:
    """ValueError naming the first message without 'role'/'content' or with an unknown role."""
    for i, m in enumerate(messages):
        if "role" not in m or "content" not in m:
            raise ValueError(f"chat prompt message {i} needs 'role' and 'content' fields")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"chat prompt message {i}: role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}")


def is_chat(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def encode_prompt(pair, prompt) -> list[int]:
    """-> token ids. Text is encoded as is; a list of {'role', 'content'} dicts goes through the chat template."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # undecodable bytes from a file or argv (surrogate escapes)
            raise ValueError(f"prompt text is not valid UTF-8 (at character {e.start})") from None
        return pair.encode(prompt)
    if is_chat(prompt):
        check_chat(prompt)
        if not pair.chat_template:
            raise ValueError(f"pair {pair.name!r} has no chat template (tokenizer_config.json 'chat_template'): "
                             "give the prompt as text")
        return pair.encode(render_chat(pair.chat_template, prompt, pair.special_tokens))
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = pair.target.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary of {vocab}")
        return list(prompt)
    raise ValueError("prompt must be text, a list of chat messages or a list of token ids")


# ----------------------------------------------------------------------------- prompt sets

SHIPPED_SET = re.compile(r"^([A-Za-z0-9_-]+):([A-Za-z0-9_.\-]+)$")  # <pair>:<set>, e.g. lab:code, lab-moe:code


def resolve_prompt_set(spec: str, base: Path | None = None) -> Path | None:
    """`lab:code` -> the lab pair's shipped code.jsonl (likewise `<pair>:<set>` for every pair in
    ddtree_lab/pairs); anything else is a .jsonl path, relative to `base` (a study file's folder) or the cwd."""
    m = SHIPPED_SET.match(spec)
    if m:
        return prompt_set_path(m.group(1), m.group(2))
    path = Path(os.path.expanduser(spec))
    if not path.is_absolute() and base is not None and (base / path).exists():
        path = base / path
    return path.resolve() if path.is_file() else None


def read_prompt_set(spec: str, n_prompts: int | None = None, base: Path | None = None) -> list[dict]:
    """A prompt set -> [{"id", "prompt"}]. Each line holds "prompt" (text) or "messages" (chat messages,
    rendered with the checkpoint's chat template); ids default to the line's index and must be unique
    (runs are compared prompt by prompt)."""
    path = resolve_prompt_set(spec, base)
    if path is None:
        raise FileNotFoundError(f"prompt set not found: {spec}")
    rows, seen = [], {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i + 1}: not JSON ({e.msg}, column {e.colno})") from None
        row = row if isinstance(row, dict) else {}
        prompt = row.get("prompt", row.get("messages"))
        chat = is_chat(prompt) and all("content" in m for m in prompt)
        if not (chat or (isinstance(prompt, str) and "prompt" in row)):
            raise ValueError(f"{path}:{i + 1}: each line must be an object with a string 'prompt' "
                             "or a list of chat 'messages'")
        if chat:
            try:
                check_chat(prompt)
            except ValueError as e:
                raise ValueError(f"{path}:{i + 1}: {e}") from None
        elif not prompt:
            raise ValueError(f"{path}:{i + 1}: the prompt is empty")
        pid = str(row.get("id", len(rows)))
        if pid in seen:
            raise ValueError(f"{path}:{i + 1}: prompt id {pid!r} repeats line {seen[pid]} (ids must be unique)")
        seen[pid] = i + 1
        rows.append({"id": pid, "prompt": prompt})
    return rows[:n_prompts] if n_prompts else rows


def prompt_text(prompt) -> str:
    """Display text of a prompt: the text, or the last chat message's content."""
    return prompt if isinstance(prompt, str) else str(prompt[-1].get("content", "")) if prompt else ""
