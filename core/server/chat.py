"""ChatTemplate: chat messages -> prompt token ids, through the tokenizer's template or --chat-template.

A Hugging Face tokenizer renders with its own `apply_chat_template` (its template, or the one
given). The byte tokenizer of the dummy presets has none: with --chat-template the template is
rendered in a sandboxed Jinja environment and the text byte-encoded (after the bos id);
without, chat requests get a 400 that says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backplane.server.errors import bad_request


class ChatTemplate:
    def __init__(self, tokenizer: Any, model_name: str, template: str | None = None):
        """template: a file path or the Jinja source itself (None: the tokenizer's own)."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.source = _read_template(template)
        self._jinja = None
        if self.source is not None and not hasattr(tokenizer, "apply_chat_template"):
            self._jinja = _compile(self.source)

    @property
    def available(self) -> bool:
        return self.source is not None or bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or not self.available:
            raise bad_request(f"model {self.model_name!r} has no chat template (its tokenizer defines none); "
                              "start the server with --chat-template FILE, or use /v1/completions", "messages")
        if self._jinja is not None:
            text = self._jinja.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
            return list(self.tokenizer.encode(text))
        text = self.tokenizer.apply_chat_template(messages, chat_template=self.source, tokenize=False,
                                                  add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))  # the template has the bos


def _read_template(template: str | None) -> str | None:
    if template is None:
        return None
    path = Path(template)
    if "{" not in template and not path.is_file():
        raise ValueError(f"--chat-template {template!r}: expected a Jinja template file or inline template; "
                         "no such file")
    return path.read_text() if "{" not in template else template


def _compile(source: str) -> Any:
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    except TemplateSyntaxError as err:
        raise ValueError(f"--chat-template: not a valid Jinja template: {err}") from None
