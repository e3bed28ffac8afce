"""Command-line conversion HF -> Orbax -> HF, restoring onto a different mesh on the way."""

import numpy as np
from hf_fixtures import VOCAB, hf_checkpoint, torch_logits

from jrlhf import checkpoint
from jrlhf.cli import convert
from jrlhf.meshes import make_mesh


def test_convert_round_trip(tmp_path):
    src = hf_checkpoint("qwen2")
    ckpt = tmp_path / "ckpt"
    assert convert.main(["--from-hf", str(src), "--to", str(ckpt), "--mesh", "fsdp=4"]) == 0
    model, params = checkpoint.load_model(ckpt, make_mesh("data=2,tensor=2@4:8"), "dp_tp")
    q = params["layers"]["attn"]["q_kernel"]
    assert {d.id for d in q.sharding.device_set} == {4, 5, 6, 7}
    out = tmp_path / "hf"
    assert convert.main(["--from", str(ckpt), "--to-hf", str(out)]) == 0
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 20))
    np.testing.assert_allclose(torch_logits(out, tokens), torch_logits(src, tokens), atol=1e-5)
    # A second conversion into the same directory is refused and keeps the first.
    assert convert.main(["--from-hf", str(src), "--to", str(ckpt)]) == 1
    assert checkpoint.read_model_json(ckpt) == model


def test_convert_reports_bad_input(tmp_path, capsys):
    assert convert.main(["--from-hf", str(tmp_path / "nope"), "--to", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "config.json" in err and "\n" not in err
