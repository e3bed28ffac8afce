"""Chat templates: conversations rendered with a checkpoint's own ``chat_template``.

A HF checkpoint carries its template as ``chat_template.jinja`` beside ``tokenizer_config.json``
(newer checkpoints; it wins) or as the config's ``chat_template`` entry (a string, or a list of
named templates of which ``default`` is used). :class:`ChatTemplate` renders it with jinja2 the
way transformers' ``apply_chat_template`` does: a sandboxed environment with ``trim_blocks`` and
``lstrip_blocks``, the loop-controls extension, ``raise_exception``, ``strftime_now``, a ``tojson``
that does not escape HTML, the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...)
as variables, and ``add_generation_prompt``. The rendered text is tokenized without the
tokenizer's post-processor (HF's ``add_special_tokens=False``): a template that writes
``{{ bos_token }}`` gets exactly one ``<bos>``.

Loss masks for conversations (only the assistant's tokens are trained on) come from the
template's ``{% generation %}`` markers where it has them; otherwise from rendering prefixes: the
assistant turn ``i`` spans the text between the conversation up to ``i`` rendered with the
generation prompt and the conversation through ``i`` rendered without it. That needs every prefix
to render as a prefix of the whole; a template that rewrites earlier turns (e.g. one that drops
past reasoning) is refused in one line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The named special tokens transformers hands every template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# The roles chat templates know (Llama 3.1 calls tool results "ipython", OpenAI's newer
# system role is "developer"); anything else is most likely a typo, refused at load.
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")


class ChatTemplateError(ValueError):
    """A template that fails to render, or a conversation it cannot render as asked."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: records the character span of what it wraps
    (the assistant's tokens) while a render is tracked."""

    tags = frozenset({"generation"})

    def __init__(self, environment):
        super().__init__(environment)
        self._spans: ContextVar[list | None] = ContextVar("generation_spans", default=None)
        environment.extend(track_generation=self.track)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_mark", [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        text = caller()
        spans = self._spans.get()
        if spans is not None:
            # Rendering is streamed into ``blocks``; the span starts where the text so far ends.
            blocks, out = spans
            start = sum(len(b) for b in blocks)
            out.append((start, start + len(text)))
        return text

    @contextmanager
    def track(self, blocks: list[str], out: list[tuple[int, int]]):
        token = self._spans.set((blocks, out))
        try:
            yield
        finally:
            self._spans.reset(token)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; HF's does not.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace without underscore attributes (as HF's sandbox has it)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


def check_messages(messages: Any, *, final: str | None = None) -> list[dict[str, Any]]:
    """``messages`` validated as a conversation: a non-empty list of objects with a string
    ``role`` and string ``content``. Keys whose value is None are dropped (as HF does).
    ``final="prompt"``: the last message must not be the assistant's (a prompt asks for one);
    ``final="assistant"``: it must be. Errors are one-line ``ValueError`` s without a location
    (callers add the file and line)."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        role = m.get("role")
        if not isinstance(role, str) or not role:
            has = ", ".join(repr(k) for k in m) or "no fields"
            raise ValueError(f"messages[{i}] has no 'role' (it has {has})")
        if role not in ROLES:
            raise ValueError(f"messages[{i}] has role {role!r} (use one of {', '.join(ROLES)})")
        if "content" not in m:
            raise ValueError(f"messages[{i}] ({role}) has no 'content'")
        if not isinstance(m["content"], str):
            raise ValueError(
                f"messages[{i}] ({role}) content must be a string, got "
                f"{type(m['content']).__name__}"
            )
        out.append(m)
    last = out[-1]["role"]
    if final == "prompt" and last == "assistant":
        raise ValueError(
            "the conversation ends with an assistant turn; a prompt must end with the turn the "
            "model answers (drop the final assistant message, or load it as SFT data)"
        )
    if final == "assistant" and last != "assistant":
        raise ValueError(f"the conversation ends with a {last} turn, not the assistant's")
    return out


class ChatTemplate:
    """A compiled chat template plus the variables the tokenizer hands it."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"chat template does not compile (line {e.lineno}: {e.message})"
            ) from None
        self.has_generation_markers = "generation" in source and any(
            tok in source for tok in ("{% generation", "{%- generation", "{%generation")
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        spans: list[tuple[int, int]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation as text; ``spans`` (if given) receives the character spans of the
        template's ``{% generation %}`` blocks."""
        # HF passes tools and documents as None when not given: templates test "is not none".
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        messages = [_alias_reasoning(dict(m)) for m in messages]
        try:
            if spans is None:
                return self._template.render(
                    messages=messages, add_generation_prompt=add_generation_prompt, **variables
                )
            blocks: list[str] = []
            with self._template.environment.track_generation(blocks, spans):
                for block in self._template.generate(
                    messages=messages, add_generation_prompt=add_generation_prompt, **variables
                ):
                    blocks.append(block)
            return "".join(blocks)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None

    def assistant_spans(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list]:
        """(text, spans): the whole conversation rendered and the character span of each
        assistant turn (what SFT trains on), from the template's generation markers or, without
        them, from rendering prefixes (see the module docstring)."""
        if messages and messages[0]["role"] == "assistant":
            raise ChatTemplateError("the conversation starts with an assistant turn")
        if self.has_generation_markers:
            spans: list[tuple[int, int]] = []
            text = self.render(messages, spans=spans)
            return text, [s for s in spans if s[1] > s[0]]
        text = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not through.startswith(before) or not text.startswith(through):
                raise ChatTemplateError(
                    f"the chat template does not render message {i}'s prefix of the "
                    "conversation as a prefix of the whole (it rewrites earlier turns), so the "
                    "assistant's tokens cannot be told apart: give the template "
                    "{% generation %} markers, or use prompt/response records"
                )
            # What follows the turn's end token (a newline) is not something the model writes.
            end = len(before) + len(through[len(before) :].rstrip())
            if end > len(before):
                spans.append((len(before), end))
        return text, spans


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """Reasoning under any of its names is also under the others (as HF does for templates
    that read ``reasoning_content`` or ``thinking``)."""
    for key in ("reasoning_content", "thinking", "reasoning"):
        if message.get(key) is not None:
            return {"thinking": message[key], **message, "reasoning_content": message[key]}
    return message


def template_source(config: Mapping[str, Any], jinja_file_text: str | None) -> str | None:
    """The default chat template of a checkpoint: ``chat_template.jinja`` wins over the
    tokenizer config's ``chat_template`` (a string or a list of ``{"name", "template"}``)."""
    if jinja_file_text is not None:
        return jinja_file_text
    entry = config.get("chat_template")
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
    return None
