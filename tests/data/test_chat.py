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
MISC = """{%- if tools is not none %}tools: {{ tools | tojson }}{% endif -%}
{%- if documents is not none %}documents{% endif -%}
{%- set ns = namespace(n=0) -%}
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
    assert "tools" not in ours.render_chat(messages)  # tools and documents are None
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


# ------------------------------------------------------------------------------- data files
GSM8K = [
    {
        "messages": [
            {"role": "system", "content": "Think step by step."},
            {"role": "user", "content": "Natalia sold clips to 48 of her friends in April."},
        ],
        "answer": "She sold 48 / 2 = 24 clips in May. #### 72",
        "id": 0,
    },
    {
        "messages": [{"role": "user", "content": "What is 2 + 3?"}],
        "answer": 5,  # a number: its text is tokenized, the meta keeps the number
        "id": 1,
    },
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_conversations_jsonl_and_parquet(tmp_path, checkpoints):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok, hf = data.Tokenizer.from_file(checkpoints["qwen"]), _hf(checkpoints["qwen"])
    jsonl = data.load_prompts(_write_jsonl(tmp_path / "p.jsonl", GSM8K), tok)
    # HF datasets' layout: messages a list of {role, content} structs (answers one type).
    table = pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in GSM8K])
    pq.write_table(table, tmp_path / "p.parquet")
    parquet = data.load_prompts(tmp_path / "p.parquet", tok)
    for ds in (jsonl, parquet):
        for rec, row in zip(ds, GSM8K):
            expected = hf.apply_chat_template(row["messages"], add_generation_prompt=True)
            assert rec.prompt_ids == list(expected["input_ids"])
            assert rec.meta["id"] == row["id"] and "messages" not in rec.meta
            assert str(rec.meta["answer"]) == str(row["answer"])
            assert rec.meta[data.ANSWER_IDS][-1] == tok.eos_id
    assert jsonl[1].meta["answer"] == 5
    # verl's layout: the prompt field itself is the message list.
    verl = [{"prompt": r["messages"], "reward_model": {"ground_truth": "72"}} for r in GSM8K]
    ds = data.load_prompts(_write_jsonl(tmp_path / "verl.jsonl", verl), tok)
    assert [r.prompt_ids for r in ds] == [r.prompt_ids for r in jsonl]
    assert ds[0].meta == {"reward_model": {"ground_truth": "72"}}
    # Truncation keeps the end of a rendered prompt (the generation prompt).
    short = data.load_prompts(tmp_path / "p.jsonl", tok, max_prompt_len=5)
    assert short[0].prompt_ids == jsonl[0].prompt_ids[-5:] and short.num_truncated == 2


BAD_CONVERSATIONS = [
    ({"messages": [{"content": "hi"}]}, r"'messages': messages\[0\] has no 'role'"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\] \(user\) has no 'content'"),
    (
        {"messages": [{"role": "user", "content": ["a", "b"]}]},
        r"messages\[0\] \(user\) content must be a string, got list",
    ),
    ({"messages": [{"role": "robot", "content": "x"}]}, "has role 'robot'"),
    ({"messages": []}, "messages is empty"),
    ({"messages": "hello"}, "must be a list of messages, got str"),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        "ends with an assistant turn",
    ),
]


@pytest.mark.parametrize(("row", "error"), BAD_CONVERSATIONS)
def test_malformed_conversations_name_file_and_line(tmp_path, checkpoints, row, error):
    tok = data.Tokenizer.from_file(checkpoints["qwen"])
    path = _write_jsonl(tmp_path / "bad.jsonl", [GSM8K[0], row])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{error}") as info:
        data.load_prompts(path, tok)
    assert "\n" not in str(info.value)


def test_conversations_need_a_chat_template(tmp_path, checkpoints):
    path = _write_jsonl(tmp_path / "p.jsonl", GSM8K)
    with pytest.raises(ValueError, match=r"p\.jsonl:1: 'messages' is a conversation, which needs"):
        data.load_prompts(path, None, vocab_size=500)
    gemma = data.Tokenizer.from_file(checkpoints["gemma"])
    bad = [{"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "a"}]}]
    with pytest.raises(ValueError, match=r"p\.jsonl:1: 'messages': chat template: .*alternate"):
        data.load_prompts(_write_jsonl(path, bad), gemma)


SFT_CONVERSATION = [
    {"role": "system", "content": "Think step by step."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "And 48 / 2?"},
    {"role": "assistant", "content": "\\boxed{24}"},
]


@pytest.mark.parametrize("style", ["qwen", "llama3", "gemma"])
def test_sft_conversations_train_on_assistant_turns(tmp_path, checkpoints, style):
    tok = data.Tokenizer.from_file(checkpoints[style])
    rows = [
        {"messages": SFT_CONVERSATION},
        {"prompt": SFT_CONVERSATION[:2], "completion": SFT_CONVERSATION[2:3]},  # TRL's form
    ]
    ds = data.load_sft(_write_jsonl(tmp_path / "s.jsonl", rows), tok)
    full = tok.apply_chat_template(SFT_CONVERSATION)
    rec = ds[0]
    assert full[: len(rec.prompt_ids) + len(rec.response_ids)] == rec.prompt_ids + rec.response_ids
    assert rec.prompt_ids == tok.apply_chat_template(SFT_CONVERSATION[:2], True)
    assert len(rec.loss_mask) == len(rec.response_ids)
    trained = [t for t, m in zip(rec.response_ids, rec.loss_mask) if m]
    text = tok.decode(trained, skip_special_tokens=False)
    end = {"qwen": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}[style]
    assert text == f"The answer is 5.{end}\\boxed{{24}}{end}"
    assert 0 in rec.loss_mask  # the user turn between them is not trained on
    assert ds[1].prompt_ids == rec.prompt_ids
    if style == "qwen":  # the same from Parquet (HF datasets' list-of-struct column)
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "s.parquet")
        assert data.load_sft(tmp_path / "s.parquet", tok)[0] == rec
    assert tok.decode(ds[1].response_ids, skip_special_tokens=False) == f"The answer is 5.{end}"
    assert all(ds[1].loss_mask)
    # Malformed: a conversation that does not end with the assistant, or starts with it.
    bad = _write_jsonl(tmp_path / "b.jsonl", [{"messages": SFT_CONVERSATION[:2]}])
    with pytest.raises(ValueError, match=r"b\.jsonl:1: 'messages': .*ends with a user turn"):
        data.load_sft(bad, tok)
    bad = _write_jsonl(tmp_path / "b.jsonl", [rows[0], {"messages": SFT_CONVERSATION[2:3]}])
    with pytest.raises(ValueError, match=r"b\.jsonl:2: 'messages': .*starts with an assistant"):
        data.load_sft(bad, tok)


def test_sft_loss_mask_reaches_the_batch():
    from jrlhf.pipeline.supervised import sft_batch

    rows = [data.SFTRecord([1, 2], [3, 4, 5, 6], [1, 0, 0, 1]), data.SFTRecord([1], [3, 4])]
    batch = sft_batch(rows, 4, 6, 0)
    assert batch["mask"].tolist() == [[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0]]


def test_preference_conversations(tmp_path, checkpoints):
    tok = data.Tokenizer.from_file(checkpoints["qwen"])
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    good, bad = {"role": "assistant", "content": "5"}, {"role": "assistant", "content": "6"}
    rows = [
        {"prompt": prompt, "chosen": [good], "rejected": [bad]},  # shared prompt
        {"chosen": [*prompt, good], "rejected": [*prompt, bad]},  # implicit prompt
    ]
    ds = data.load_preferences(_write_jsonl(tmp_path / "pr.jsonl", rows), tok)
    assert ds[0] == ds[1]
    rec = ds[0]
    assert rec.prompt_ids == tok.apply_chat_template(prompt, True)
    assert tok.decode(rec.chosen_ids, skip_special_tokens=False) == "5<|im_end|>"
    assert tok.decode(rec.rejected_ids, skip_special_tokens=False) == "6<|im_end|>"
    assert rec.prompt_ids + rec.chosen_ids == tok.apply_chat_template([*prompt, good])[:-1]
    other = [{"role": "user", "content": "What is 2 + 4?"}, bad]
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"chosen": [*prompt, good], "rejected": other}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: 'chosen' and 'rejected' must share"):
        data.load_preferences(path, tok)
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"chosen": [*prompt, good], "rejected": "6"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: 'rejected' must be a message list"):
        data.load_preferences(path, tok)


# ------------------------------------------------------------------------------- end ids
def test_end_ids_from_generation_config(tmp_path):
    from jrlhf.models.hf import read_hf_config
    from jrlhf.pipeline.task_data import tokenizer_model_overrides

    path = make_checkpoint(
        tmp_path / "qwen", "qwen", generation={"eos_token_id": [5, 3], "bos_token_id": 3}
    )
    tok = data.Tokenizer.from_file(path)
    im_end, endoftext = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert (im_end, endoftext) == (5, 3)
    assert tok.eos_id == im_end and tok.end_ids == (im_end, endoftext)
    assert tokenizer_model_overrides(tok)["eos_token_id"] == (5, 3)
    # A model directory: generation_config.json's list merged with config.json's id.
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "vocab_size": 500,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "eos_token_id": 7,
            }
        )
    )
    cfg, _ = read_hf_config(path)
    assert cfg.eos_ids == (5, 3, 7)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be"):
        data.Tokenizer.from_file(path)


def test_generation_stops_at_the_second_end_id():
    from jrlhf.config import load_config
    from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams
    from jrlhf.meshes import make_mesh
    from jrlhf.models.config import tiny_config
    from jrlhf.models.model_def import ModelDef
    from jrlhf.ppo.rollout import Rollout

    mesh = make_mesh("data=1")
    model = ModelDef(tiny_config(vocab_size=64), "lm")
    params = model.init_sharded(mesh, "dp_tp", 0)
    engine = DecodeEngine(
        model,
        mesh,
        "dp_tp",
        EngineConfig(num_slots=2, page_size=8, max_prompt_len=4, max_new_tokens=8, chunk_steps=4),
    )
    prompt = [[5, 6, 7]]
    free = engine.generate(
        params, prompt, SamplingParams(greedy=True, stop_ids=(), max_new_tokens=8)
    ).completion_ids[0]
    free = [int(t) for t in free]
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    unused = next(t for t in range(64) if t not in free)
    cfg = load_config([], ["TaskConfig.max_response_len=8"])
    rollout = Rollout(engine, None, cfg, eos_id=(unused, free[k]))  # a checkpoint's two end ids
    sampling = rollout.sampling(0, num_samples=1, greedy=True)
    assert sampling.stop_ids == (unused, free[k])
    _, result = rollout.generate(params, prompt, sampling)
    assert [int(t) for t in result.completion_ids[0]] == free[: k + 1]
