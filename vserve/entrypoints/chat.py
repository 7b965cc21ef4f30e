"""Chat templates: render a conversation with the tokenizer's (or a given) Jinja template."""

from __future__ import annotations

from pathlib import Path


def load_chat_template(value: str | None) -> str | None:
    """A template given as a file path or as the template text itself."""
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and path.is_file():
        return path.read_text()
    return value


def render_chat(
    tokenizer,
    conversation: list[dict],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of the rendered conversation; `tools` (OpenAI function definitions) go to
    the template's `tools` variable."""
    if not conversation:
        raise ValueError("messages must not be empty")
    for message in conversation:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError("each message needs a 'role' and a 'content'")
    template = load_chat_template(chat_template)
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; pass chat_template")
    if continue_final_message:
        add_generation_prompt = False
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **{**(template_kwargs or {}), **({"tools": tools} if tools else {})},
        )
    except Exception as e:  # jinja errors, raise_exception() in templates
        raise ValueError(f"cannot apply the chat template: {e}") from e
    # the template writes the BOS token itself
    return tokenizer.encode(text, add_special_tokens=False)
