"""jrlhf.data: loading and validation, truncation, the resumable loader, padding layouts."""

import json
import logging

import numpy as np
import pytest

from jrlhf import data
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
    import pyarrow as pa
    import pyarrow.parquet as pq

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
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"text": "a0"}), "missing field 'prompt' or 'prompt_ids'"),
        (json.dumps({"prompt_ids": "1 2"}), "'prompt_ids' must be a list of ints"),
        (json.dumps({"prompt_ids": [1, 2.5]}), r"'prompt_ids'\[1\] must be an int"),
        (json.dumps({"prompt_ids": [1, True]}), r"'prompt_ids'\[1\] must be an int"),
        (json.dumps({"prompt": 3}), "'prompt' must be a string"),
        (json.dumps({"prompt_ids": []}), "'prompt_ids' is empty"),
        (json.dumps({"prompt": "  "}), "'prompt' is empty"),
        (json.dumps({"prompt_ids": [1, 32]}), r"\[1\] = 32 is outside the vocabulary \[0, 32\)"),
        (json.dumps({"prompt_ids": [-1]}), "-1 is outside the vocabulary"),
    ],
)
def test_prompt_validation_names_file_and_line(tmp_path, tok, bad, message):
    path = _write(tmp_path / "prompts.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(ValueError, match=rf"prompts\.jsonl:3: .*{message}") as e:
        data.load_prompts(path, tok)
    assert "\n" not in str(e.value)


def test_text_without_tokenizer_and_missing_response(tmp_path):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "a0"})])
    with pytest.raises(ValueError, match=r"p\.jsonl:1: field 'prompt' is text but no tokenizer"):
        data.load_prompts(path)
    path = _write(tmp_path / "s.jsonl", [json.dumps({"prompt_ids": [1], "response": None})])
    with pytest.raises(ValueError, match=r"s\.jsonl:1: missing field 'response' or 'completion'"):
        data.load_sft(path)
    full = json.dumps({"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]})
    path = _write(tmp_path / "pr.jsonl", [full, json.dumps({"prompt_ids": [1], "chosen_ids": [2]})])
    with pytest.raises(ValueError, match=r"pr\.jsonl:2: missing field 'rejected'"):
        data.load_preferences(path)
    path = _write(tmp_path / "s2.jsonl", [json.dumps({"prompt_ids": [1], "response_ids": [40]})])
    with pytest.raises(ValueError, match=r"s2\.jsonl:1: field 'response_ids'\[0\] = 40"):
        data.load_sft(path, vocab_size=32)


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
    assert len(warnings) == 1 and "truncated 3 of 4" in warnings[0].getMessage()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jrlhf.data"):
        ds = data.load_sft(path)
    assert ds.num_truncated == 0 and not caplog.records


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


# ------------------------------------------------------------------------------- padding
def test_left_pad_prompts():
    b = data.left_pad_prompts([[5, 6], [7, 8, 9]], length=4, pad_id=0)
    np.testing.assert_array_equal(b.tokens_bt, [[0, 0, 5, 6], [0, 7, 8, 9]])
    np.testing.assert_array_equal(b.positions_bt, [[0, 0, 0, 1], [0, 0, 1, 2]])
    np.testing.assert_array_equal(b.segment_ids_bt, [[0, 0, 1, 1], [0, 1, 1, 1]])
    np.testing.assert_array_equal(b.lengths_b, [2, 3])
    assert b.tokens_bt.dtype == np.int32
    with pytest.raises(ValueError, match="more than the length 2"):
        data.left_pad_prompts([[5, 6, 7]], length=2)


def _reference_row(p, r, prompt_len, response_len, pad, layout):
    """Token by token, the documented layout of one row."""
    left = prompt_len - len(p) if layout == "aligned" else 0
    right = prompt_len + response_len - left - len(p) - len(r)
    tokens = [pad] * left + list(p) + list(r) + [pad] * right
    kind = ["pad"] * left + ["prompt"] * len(p) + ["response"] * len(r) + ["pad"] * right
    positions, n = [], 0
    for k in kind:
        positions.append(0 if k == "pad" else n)
        n += k != "pad"
    segments = [int(k != "pad") for k in kind]
    targets = [*tokens[1:], pad]
    loss = [*(int(k == "response") for k in kind[1:]), 0]
    last = max(i for i, k in enumerate(kind) if k != "pad")
    return tokens, positions, segments, targets, loss, [int(k == "response") for k in kind], last


@pytest.mark.parametrize("layout", ["aligned", "right"])
def test_sequence_batch_matches_reference(layout):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 30, size=n).tolist() for n in (1, 4, 6, 3, 6)]
    responses = [rng.integers(3, 30, size=n).tolist() for n in (5, 0, 2, 7, 1)]
    b = data.make_sequence_batch(prompts, responses, 7, 8, pad_id=0, layout=layout)
    assert b.tokens_bt.shape == (5, 15)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        tok, pos, seg, tgt, loss, resp, last = _reference_row(p, r, 7, 8, 0, layout)
        assert b.tokens_bt[i].tolist() == tok
        assert b.positions_bt[i].tolist() == pos
        assert b.segment_ids_bt[i].tolist() == seg
        assert b.targets_bt[i].tolist() == tgt
        assert b.loss_mask_bt[i].tolist() == loss
        assert b.response_mask_bt[i].tolist() == resp
        assert b.last_index_b[i] == last
    if layout == "aligned":
        # Every response starts at column prompt_len.
        assert (b.response_mask_bt[:, :7] == 0).all()
    # The loss covers exactly the response tokens.
    assert b.loss_mask_bt.sum() == sum(map(len, responses))
    with pytest.raises(ValueError, match="more than response_len 1"):
        data.make_sequence_batch(prompts, responses, 7, 1)


def test_sft_and_preference_batches():
    recs = [data.SFTRecord([1, 6, 4], [7, 7, 2]), data.SFTRecord([1, 4], [8, 2])]
    b = data.make_sft_batch(recs)
    np.testing.assert_array_equal(b.tokens_bt, [[1, 6, 4, 7, 7, 2], [1, 4, 8, 2, 0, 0]])
    np.testing.assert_array_equal(b.loss_mask_bt, [[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(b.targets_bt[b.loss_mask_bt == 1], [7, 7, 2, 8, 2])
    pairs = [
        data.PreferenceRecord([1, 6, 4], [7, 2], [8, 9, 10, 2]),
        data.PreferenceRecord([1, 4], [7, 7, 7, 7, 7, 2], [2]),
    ]
    chosen, rejected = data.make_preference_batch(pairs)
    assert chosen.tokens_bt.shape == rejected.tokens_bt.shape == (2, 9)
    np.testing.assert_array_equal(chosen.tokens_bt[:, :2], rejected.tokens_bt[:, :2])
    np.testing.assert_array_equal(chosen.last_index_b, [4, 7])
    np.testing.assert_array_equal(rejected.last_index_b, [6, 2])
