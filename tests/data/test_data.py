"""jrlhf.data: loading and validation, truncation, the resumable loader, the batch layout."""

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jrlhf import data
from jrlhf.data.batch import pack
from jrlhf.tasks import SyntheticTask


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return SyntheticTask(0).save_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return data.Tokenizer.from_file(tok_dir)


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ------------------------------------------------------------------------------- tokenizer
def test_tokenizer_special_ids_and_round_trip(tok, tok_dir):
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 32
    ids = tok.encode("a0 b1 =", add_special_tokens=True)
    assert ids[0] == tok.bos_id and len(ids) == 4
    assert tok.decode(ids) == "a0 b1 ="
    assert data.Tokenizer.from_file(tok_dir / "tokenizer.json").eos_id == 2
    # tokenizer_config.json entries win over spellings, also in their {"content": ...} form.
    custom = data.Tokenizer(tok._tok, {"eos_token": {"content": "="}, "pad_token": "<eos>"})
    assert (custom.eos_id, custom.pad_id, custom.bos_id) == (4, 2, 1)


# ------------------------------------------------------------------------------- loading
def test_loads_ids_and_text(tmp_path, tok):
    p = _write(
        tmp_path / "p.jsonl",
        [json.dumps({"prompt_ids": [1, 6, 4], "id": 7}), json.dumps({"prompt": "a0 a1 ="})],
    )
    ds = data.load_prompts(p, tok)
    assert ds[0] == data.PromptRecord([1, 6, 4], {"id": 7})
    assert ds[1].prompt_ids == [1, 6, 7, 4]  # <bos> added by the tokenizer's post-processor
    s = _write(
        tmp_path / "s.jsonl",
        [
            json.dumps({"prompt": "a0 =", "completion": "b0 b1"}),
            json.dumps({"prompt_ids": [1, 6, 4], "response_ids": [12, 2]}),
        ],
    )
    sft = data.load_sft(s, tok)
    assert sft[0] == data.SFTRecord([1, 6, 4], [12, 13, 2])  # <eos> appended to text responses
    assert sft[1].response_ids == [12, 2]
    pr = _write(
        tmp_path / "pr.jsonl", [json.dumps({"prompt": "a0 =", "chosen": "a1", "rejected": "b1"})]
    )
    assert data.load_preferences(pr, tok)[0] == data.PreferenceRecord([1, 6, 4], [7, 2], [13, 2])


def test_parquet(tmp_path, tok):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt_ids": [[1, 6, 4], [1, 7, 4]]}), path)
    assert [r.prompt_ids for r in data.load_prompts(path, vocab_size=32)] == [[1, 6, 4], [1, 7, 4]]
    pq.write_table(pa.table({"prompt_ids": [[1, 6, 4], [1, 99, 4]]}), path)
    with pytest.raises(ValueError, match=r"p\.parquet: row 1: .*99 is outside the vocabulary"):
        data.load_prompts(path, vocab_size=32)


GOOD = json.dumps({"prompt_ids": [1, 6, 4]})


@pytest.mark.parametrize(
    "bad, message",
    [
        ("", "empty line"),
        ("   ", "empty line"),
        ("{not json", "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"text": "a0"}), "expected an object with 'prompt' or 'prompt_ids'"),
        (json.dumps({"prompt_ids": "1 2"}), "'prompt_ids' must be a list of ints"),
        (json.dumps({"prompt_ids": [1, 2.5]}), r"'prompt_ids'\[1\] must be an int"),
        (json.dumps({"prompt_ids": [1, True]}), r"'prompt_ids'\[1\] must be an int"),
        (json.dumps({"prompt": 3}), "'prompt' must be a string"),
        (json.dumps({"prompt_ids": []}), "'prompt_ids' must be a non-empty list"),
        (json.dumps({"prompt": "  "}), "'prompt' must be non-empty text"),
        (json.dumps({"prompt_ids": [1, 32]}), r"\[1\] = 32 is outside the vocabulary \[0, 32\)"),
        (json.dumps({"prompt_ids": [-1]}), "-1 is outside the vocabulary"),
        (json.dumps({**json.loads(GOOD), "answer_ids": [1, 40]}), r"'answer_ids'\[1\] = 40"),
        (json.dumps({**json.loads(GOOD), "answer": ""}), "'answer' must be non-empty text"),
    ],
)
def test_prompt_validation_names_file_and_line(tmp_path, tok, bad, message):
    path = _write(tmp_path / "prompts.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(ValueError, match=rf"prompts\.jsonl:3: .*{message}") as e:
        data.load_prompts(path, tok)
    assert "\n" not in str(e.value)


def test_text_without_tokenizer_and_missing_response(tmp_path):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "a0"})])
    with pytest.raises(ValueError, match=r"p\.jsonl:1: text prompt but no tokenizer"):
        data.load_prompts(path)
    path = _write(tmp_path / "s.jsonl", [json.dumps({"prompt_ids": [1], "response": None})])
    with pytest.raises(
        ValueError, match=r"s\.jsonl:1: expected an object with 'response' or 'completion'"
    ):
        data.load_sft(path)
    full = json.dumps({"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]})
    path = _write(tmp_path / "pr.jsonl", [full, json.dumps({"prompt_ids": [1], "chosen_ids": [2]})])
    with pytest.raises(ValueError, match=r"pr\.jsonl:2: expected an object with 'rejected'"):
        data.load_preferences(path)
    path = _write(tmp_path / "s2.jsonl", [json.dumps({"prompt_ids": [1], "response_ids": [40]})])
    with pytest.raises(ValueError, match=r"s2\.jsonl:1: 'response_ids'\[0\] = 40"):
        data.load_sft(path, vocab_size=32)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl: prompts file not found"):
        data.load_prompts(tmp_path / "nope.jsonl")


def test_truncation_is_counted_and_warned_once(tmp_path, caplog):
    rows = [
        {"prompt_ids": [1, 2, 3, 4, 5], "response_ids": [6, 7, 8, 9]},  # both truncated
        {"prompt_ids": [1, 2], "response_ids": [6, 7, 8, 9]},  # response truncated
        {"prompt_ids": [1, 2, 3, 4], "response_ids": [6]},  # prompt truncated
        {"prompt_ids": [1, 2, 3], "response_ids": [6, 7]},  # fits exactly
    ]
    path = data.write_jsonl(tmp_path / "sft.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="jrlhf.data"):
        ds = data.load_sft(path, max_prompt_len=3, max_response_len=2)
    assert ds[0] == data.SFTRecord([3, 4, 5], [6, 7])  # prompt keeps its end, response its start
    assert ds[2].prompt_ids == [2, 3, 4]
    assert (ds.num_truncated, ds.num_truncated_prompts, ds.num_truncated_responses) == (3, 2, 2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].getMessage().endswith(
        "truncated 3 of 4 records (2 prompts longer than 3, 2 responses longer than 2)"
    )

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jrlhf.data"):
        ds = data.load_sft(path)
    assert ds.num_truncated == 0 and not caplog.records


def test_truncation_warning_names_only_what_was_cut(tmp_path, caplog):
    """A prompt file has no responses and no response limit: its warning says nothing about
    them (it said "0 responses longer than None")."""
    rows = [{"prompt_ids": [1, 2, 3, 4, 5]}, {"prompt_ids": [1, 2]}]
    path = data.write_jsonl(tmp_path / "prompts.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="jrlhf.data"):
        data.load_prompts(path, max_prompt_len=3)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == f"{path}: truncated 1 of 2 records (1 prompts longer than 3)"
    caplog.clear()
    rows = [{"prompt_ids": [1], "response_ids": [6, 7, 8]}]
    path = data.write_jsonl(tmp_path / "sft.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="jrlhf.data"):
        data.load_sft(path, max_prompt_len=3, max_response_len=2)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == f"{path}: truncated 1 of 1 records (1 responses longer than 2)"


@pytest.mark.parametrize("ending", ["\n", "\r\n", ""])
def test_malformed_json_names_the_column_of_the_line_as_written(tmp_path, ending):
    """The column is the line's own, in characters, whatever its line ending; an error where
    the line ends says so (JSON took the line ending for whitespace, put the error on the line
    after it and reported column 1)."""
    path = tmp_path / "p.jsonl"
    inner = '{"prompt": "\u00e9t\u00e9" "x"}'  # two 2-byte characters before the error
    path.write_text(GOOD + "\n" + inner + ending, encoding="utf-8")
    with pytest.raises(ValueError) as e:
        data.load_prompts(path)
    column = inner.index('"x"') + 1
    assert str(e.value) == f"{path}:2: malformed JSON (Expecting ',' delimiter at column {column})"
    path.write_text(GOOD + "\n" + '{"prompt_ids": [3,' + ending)  # the line ends too soon
    with pytest.raises(ValueError) as e:
        data.load_prompts(path)
    assert str(e.value) == f"{path}:2: malformed JSON (Expecting value at the end of the line)"


def test_prompt_meta_and_reference_answers(tmp_path, tok):
    rows = [
        {"prompt": "a0 a1 =", "answer": "b0 b1", "id": "q1"},  # text: tokenized like a response
        {"prompt_ids": [1, 6, 4], "answer_ids": [12, 13], "source": {"k": [1]}},  # ids as given
        {"prompt_ids": [1, 6, 4]},  # no answer
    ]
    ds = data.load_prompts(data.write_jsonl(tmp_path / "p.jsonl", rows), tok, max_prompt_len=2)
    assert ds[0].meta == {"answer": "b0 b1", "id": "q1", data.ANSWER_IDS: [12, 13, 2]}
    assert ds[1].meta == {"answer_ids": [12, 13], "source": {"k": [1]}}
    assert ds[2].meta == {}
    assert ds[0].prompt_ids == [7, 4]  # prompts are truncated, answers never
    no_eos = data.load_prompts(tmp_path / "p.jsonl", tok, append_eos=False)
    assert no_eos[0].meta[data.ANSWER_IDS] == [12, 13]


def test_blank_lines_skipped_only_when_asked(tmp_path):
    path = _write(tmp_path / "p.jsonl", [GOOD, "", json.dumps({"prompt_ids": [5]})])
    with pytest.raises(ValueError, match=r"p\.jsonl:2: empty line"):
        data.load_prompts(path)
    ds = data.load_prompts(path, skip_blank_lines=True)
    assert [r.prompt_ids for r in ds] == [[1, 6, 4], [5]]
    bad = _write(tmp_path / "b.jsonl", [GOOD, "", "{oops"])
    with pytest.raises(ValueError, match=r"b\.jsonl:3: malformed JSON"):  # line numbers kept
        data.load_prompts(bad, skip_blank_lines=True)


# ------------------------------------------------------------------------------- loader
def _drain(loader, n):
    return [loader.next_indices().tolist() for _ in range(n)]


def test_loader_deterministic_epochs_and_no_straddle():
    items = list(range(10))
    a = _drain(data.PromptLoader(items, 3, seed=5), 9)
    b = _drain(data.PromptLoader(items, 3, seed=5), 9)
    assert a == b
    assert _drain(data.PromptLoader(items, 3, seed=6), 9) != a
    # 3 batches per epoch (drop_last), each epoch a permutation subset with no repeats.
    for e in range(3):
        epoch = [i for batch in a[3 * e : 3 * e + 3] for i in batch]
        assert len(set(epoch)) == 9 and set(epoch) <= set(items)
    assert a[0:3] != a[3:6]  # a new order every epoch
    unshuffled = data.PromptLoader(items, 4, shuffle=False, drop_last=False)
    assert _drain(unshuffled, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]


def test_loader_exact_resume_from_state():
    items = [[i] for i in range(23)]
    ref = data.PromptLoader(items, 4, seed=11)
    expected = [ref.next_batch() for _ in range(20)]
    for cut in (0, 3, 5, 6, 13):
        run = data.PromptLoader(items, 4, seed=11)
        got = [run.next_batch() for _ in range(cut)]
        state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint would store it
        assert set(state) == {"epoch", "index", "seed"}
        resumed = data.PromptLoader(items, 4, seed=999)  # the state's seed wins
        resumed.load_state_dict(state)
        got += [resumed.next_batch() for _ in range(20 - cut)]
        assert got == expected, cut
    with pytest.raises(ValueError, match="lacks"):
        ref.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="fewer than one batch"):
        data.PromptLoader(items[:3], 4)


def test_loader_batches_carry_prompt_meta():
    records = [data.PromptRecord([i + 1], {"answer_ids": [i]}) for i in range(6)]
    loader = data.PromptLoader(records, 3, seed=2)
    ids = data.PromptLoader(list(range(6)), 3, seed=2)
    for _ in range(4):  # the order depends on the number of items only
        batch, idx = loader.next_batch(), ids.next_batch()
        assert [r.meta["answer_ids"] for r in batch] == [[i] for i in idx]
        assert [r.prompt_ids for r in batch] == [[i + 1] for i in idx]


# ------------------------------------------------------------------------------- batch layout
def _reference_row(p, r, prompt_len, response_len, pad):
    """Token by token, the documented layout of one row: the prompt ends at column
    prompt_len - 1 and the response starts at column prompt_len."""
    left = prompt_len - len(p)
    right = response_len - len(r)
    tokens = [pad] * left + list(p) + list(r) + [pad] * right
    kind = ["pad"] * left + ["prompt"] * len(p) + ["response"] * len(r) + ["pad"] * right
    positions, n = [], 0
    for k in kind:
        positions.append(0 if k == "pad" else n)
        n += k != "pad"
    segments = [int(k != "pad") for k in kind]
    last = max(i for i, k in enumerate(kind) if k != "pad")
    return tokens, positions, segments, [float(k == "response") for k in kind[prompt_len:]], last


def test_pack_matches_reference():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 30, size=n).tolist() for n in (1, 4, 7, 3, 6)]
    responses = [rng.integers(3, 30, size=n).tolist() for n in (5, 0, 2, 8, 1)]
    b = pack(prompts, responses, 7, 8, pad_id=0)
    assert b["tokens"].shape == (5, 15) and b["mask"].shape == b["response_tokens"].shape == (5, 8)
    assert b["tokens"].dtype == b["positions"].dtype == b["last_index"].dtype == np.int32
    assert b["mask"].dtype == np.float32
    for i, (p, r) in enumerate(zip(prompts, responses)):
        tok, pos, seg, resp, last = _reference_row(p, r, 7, 8, 0)
        assert b["tokens"][i].tolist() == tok
        assert b["positions"][i].tolist() == pos
        assert b["segment_ids"][i].tolist() == seg
        assert b["mask"][i].tolist() == resp
        assert b["last_index"][i] == last
    # Every response starts at column P: the response tokens are the columns from P on, and
    # the hidden state at column P-1+j predicts response token j (next-token targets).
    np.testing.assert_array_equal(b["response_tokens"], b["tokens"][:, 7:])
    targets = b["response_tokens"][b["mask"] == 1]
    assert targets.tolist() == [t for r in responses for t in r]
    assert b["mask"].sum() == sum(map(len, responses))
    with pytest.raises(ValueError, match="response 3 has 8 tokens, more than max_response_len 7"):
        pack(prompts, responses, 7, 7)
    with pytest.raises(ValueError, match="prompt 2 has 7 tokens, more than max_prompt_len 6"):
        pack(prompts, responses, 6, 8)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        pack([[1], []], [[2], [3]], 4, 4)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        pack([[1], [2]], [[3]], 4, 4)


def test_pack_left_pads_prompts():
    """Without responses the prompt columns are the left-padded prompts generation starts from."""
    b = pack([[5, 6], [7, 8, 9]], [[], []], 4, 0, pad_id=0)
    np.testing.assert_array_equal(b["tokens"], [[0, 0, 5, 6], [0, 7, 8, 9]])
    np.testing.assert_array_equal(b["positions"], [[0, 0, 0, 1], [0, 0, 1, 2]])
    np.testing.assert_array_equal(b["segment_ids"], [[0, 0, 1, 1], [0, 1, 1, 1]])
    np.testing.assert_array_equal(b["last_index"], [3, 3])
    assert b["mask"].shape == (2, 0)
    b = pack([[5, 6]], [[4]], 3, 2, pad_id=9)
    assert b["tokens"].tolist() == [[9, 5, 6, 4, 9]]
    with pytest.raises(ValueError, match="more than max_prompt_len 2"):
        pack([[5, 6, 7]], [[]], 2, 0)


def test_sft_and_preference_rows():
    """SFT rows and reward-model pairs (chosen rows, then rejected rows) in the one layout."""
    recs = [data.SFTRecord([1, 6, 4], [7, 7, 2]), data.SFTRecord([1, 4], [8, 2])]
    b = pack([r.prompt_ids for r in recs], [r.response_ids for r in recs], 3, 3)
    np.testing.assert_array_equal(b["tokens"], [[1, 6, 4, 7, 7, 2], [0, 1, 4, 8, 2, 0]])
    np.testing.assert_array_equal(b["mask"], [[1, 1, 1], [1, 1, 0]])
    np.testing.assert_array_equal(b["response_tokens"][b["mask"] == 1], [7, 7, 2, 8, 2])
    pairs = [
        data.PreferenceRecord([1, 6, 4], [7, 2], [8, 9, 10, 2]),
        data.PreferenceRecord([1, 4], [7, 7, 7, 7, 7, 2], [2]),
    ]
    b = pack(
        [p.prompt_ids for p in pairs] * 2,
        [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs],
        3,
        6,
    )
    chosen, rejected = b["tokens"][:2], b["tokens"][2:]
    assert chosen.shape == rejected.shape == (2, 9)
    np.testing.assert_array_equal(chosen[:, :3], rejected[:, :3])  # same prompt columns
    np.testing.assert_array_equal(b["last_index"], [4, 8, 6, 3])
