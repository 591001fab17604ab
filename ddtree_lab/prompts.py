"""Prompts: raw text, chat messages (through the checkpoint's chat template) or token ids."""
from __future__ import annotations

import functools


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


def is_chat(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def encode_prompt(pair, prompt) -> list[int]:
    """-> token ids. Text is encoded as is; a list of {'role', 'content'} dicts goes through the chat template."""
    if isinstance(prompt, str):
        return pair.encode(prompt)
    if is_chat(prompt):
        for i, m in enumerate(prompt):
            if "role" not in m or "content" not in m:
                raise ValueError(f"chat prompt message {i} needs 'role' and 'content' fields")
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
