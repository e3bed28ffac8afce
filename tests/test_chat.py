"""Chat templates (jrlhf.data.chat) against transformers' apply_chat_template, and conversation
data: prompts, SFT with assistant-only loss, preference pairs, end ids."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jrlhf import data
from jrlhf.data.chat import ChatTemplateError

SPECIALS = [
    "<pad>",
    "<bos>",
    "<eos>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
]
CORPUS = [
    "You are a helpful assistant. What is 2 + 3? The answer is 5.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "system user assistant model Cutting Knowledge Date: December 2023 Today Date:",
    "Let me think step by step. \\boxed{72} #### 72 <think> </think>",
]

# ChatML in the style of Qwen2.5's template (default system prompt, no tools).
QWEN = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3.1's shape: bos, a system header with dates, <|eot_id|> ends turns, contents trimmed.
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
        + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Gemma's shape: bos, the system prompt folded into the first user turn, "model" for the
# assistant, alternation enforced with raise_exception.
GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# What the HF environment adds beyond plain jinja2: tojson without HTML escaping, namespace,
# loop controls.
MISC = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
{%- if m.role == 'system' %}{% continue %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
[{{ ns.n }}] {{ m | tojson }}
{% endfor -%}
{{ eos_token }}"""

# Qwen3's habit: earlier assistant turns lose their reasoning, so a prefix does not render as a
# prefix of the whole conversation.
DROPS_REASONING = """{%- for message in messages %}
{%- set content = message.content %}
{%- if message.role == 'assistant' and not loop.last and '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

STYLES = {
    # name: (template, tokenizer config, bos added by the post-processor)
    "qwen": (QWEN, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, None),
    "llama3": (
        LLAMA3,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "<|begin_of_text|>",
    ),
    "gemma": (GEMMA, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}, "<bos>"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 3?"},
    ],
    [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "Natalia sold clips to 48 of her friends in April."},
        {"role": "assistant", "content": "  The answer is \\boxed{72}.  "},
        {"role": "user", "content": "And in May? <b>&</b>"},
    ],
]


def _tokenizer_json(path, bos: str | None):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    if bos is not None:  # the tokenizer adds <bos> itself too (double-BOS trap)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    tok.save(str(path / "tokenizer.json"))


def make_checkpoint(path, style: str, *, jinja_file=False, template=None, generation=None):
    """A tokenizer directory of ``style`` (tokenizer.json, tokenizer_config.json, optionally
    chat_template.jinja and generation_config.json)."""
    path.mkdir(parents=True, exist_ok=True)
    tmpl, config, bos = STYLES[style]
    tmpl = template if template is not None else tmpl
    _tokenizer_json(path, bos)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    if jinja_file:
        (path / "chat_template.jinja").write_text(tmpl)
        config["chat_template"] = "{{ 'the jinja file wins' }}"
    else:
        config["chat_template"] = tmpl
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def _hf(path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {
        "qwen": make_checkpoint(root / "qwen", "qwen"),
        "llama3": make_checkpoint(root / "llama3", "llama3", jinja_file=True),
        "gemma": make_checkpoint(root / "gemma", "gemma"),
    }


# ------------------------------------------------------------------------------- rendering
@pytest.mark.parametrize("style", ["qwen", "llama3", "gemma"])
def test_rendering_equals_transformers(checkpoints, style):
    ours, hf = data.Tokenizer.from_file(checkpoints[style]), _hf(checkpoints[style])
    for messages in CONVERSATIONS:
        for gen in (True, False):
            text = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            ids = hf.apply_chat_template(messages, add_generation_prompt=gen)["input_ids"]
            assert ours.render_chat(messages, gen) == text
            assert ours.apply_chat_template(messages, gen) == list(ids)
    ids = ours.apply_chat_template(CONVERSATIONS[0], True)
    bos = STYLES[style][2]
    if bos is not None:
        # The template writes <bos> and the tokenizer would add one too: exactly one, as in HF.
        assert ids[0] == ours.token_to_id(bos) and ids.count(ours.token_to_id(bos)) == 1
        assert ours.encode("hi", add_special_tokens=True)[0] == ours.token_to_id(bos)
    if style == "gemma":  # the system prompt folded into the first user turn
        assert ours.render_chat(CONVERSATIONS[1], True) == (
            "<bos><start_of_turn>user\nYou are a helpful assistant.\n\nWhat is 2 + 3?"
            "<end_of_turn>\n<start_of_turn>model\n"
        )


def test_template_environment_matches_transformers(tmp_path):
    path = make_checkpoint(tmp_path / "misc", "qwen", template=MISC)
    ours, hf = data.Tokenizer.from_file(path), _hf(path)
    messages = [*CONVERSATIONS[2], {"role": "user", "content": 'é "quoted" ü'}]
    assert ours.render_chat(messages) == hf.apply_chat_template(messages, tokenize=False)
    assert 'May? <b>&</b>"' in ours.render_chat(messages)  # tojson does not escape HTML


def test_raise_exception_in_template(checkpoints):
    ours = data.Tokenizer.from_file(checkpoints["gemma"])
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ours.render_chat(bad)
    with pytest.raises(Exception, match="roles must alternate"):
        _hf(checkpoints["gemma"]).apply_chat_template(bad, tokenize=False)


def test_template_sources(tmp_path, checkpoints):
    # chat_template.jinja wins over the config's entry (the llama3 fixture has both).
    assert "start_header_id" in data.Tokenizer.from_file(checkpoints["llama3"]).chat_template.source
    # A list of named templates: "default" is used.
    path = make_checkpoint(tmp_path / "named", "qwen")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": QWEN},
    ]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    msgs = CONVERSATIONS[0]
    assert data.Tokenizer.from_file(path).render_chat(msgs) == _hf(path).apply_chat_template(
        msgs, tokenize=False
    )
    # No template: one line saying so, when messages are rendered.
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has no chat template"):
        data.Tokenizer.from_file(path).render_chat(msgs)
    # A template that does not compile fails when the tokenizer loads.
    config["chat_template"] = "{% for m in messages %}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="chat template does not compile"):
        data.Tokenizer.from_file(path)


# ------------------------------------------------------------------------------- assistant masks
def _with_generation_markers(template: str) -> str:
    return template.replace(
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
        "{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.role == 'assistant' %}"
        "{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}"
        "{%- else %}{{- message.content + '<|im_end|>' }}{%- endif %}{{- '\\n' }}",
    )


def test_assistant_mask_from_prefixes_equals_generation_markers(tmp_path):
    marked = _with_generation_markers(QWEN)
    assert "{% generation %}" in marked
    plain = data.Tokenizer.from_file(make_checkpoint(tmp_path / "plain", "qwen"))
    path = make_checkpoint(tmp_path / "marked", "qwen", template=marked)
    ours, hf = data.Tokenizer.from_file(path), _hf(path)
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "The answer is 5."},
        {"role": "user", "content": "And 48 / 2?"},
        {"role": "assistant", "content": "Let me think step by step. \\boxed{24}"},
    ]
    out = hf.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = ours.encode_chat_with_mask(messages)  # from the markers
    assert ids == list(out["input_ids"]) and mask == list(out["assistant_masks"])
    assert plain.encode_chat_with_mask(messages) == (ids, mask)  # from rendering prefixes
    trained = plain.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == "The answer is 5.<|im_end|>Let me think step by step. \\boxed{24}<|im_end|>"


def test_template_that_rewrites_history_is_refused(tmp_path):
    tok = data.Tokenizer.from_file(
        make_checkpoint(tmp_path / "q3", "qwen", template=DROPS_REASONING)
    )
    messages = [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "<think>2 + 3 = 5</think>\n5"},
        {"role": "user", "content": "4 + 4?"},
        {"role": "assistant", "content": "<think>8</think>\n8"},
    ]
    with pytest.raises(ChatTemplateError, match="does not render message 1's prefix"):
        tok.encode_chat_with_mask(messages)
    tok.encode_chat_with_mask(messages[:2])  # one assistant turn, last: fine
