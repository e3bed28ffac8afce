"""Our model against transformers' own code on random checkpoints, and the export round trip."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import VOCAB, hf_checkpoint, torch_logits

from jrlhf.meshes import MeshSpec, make_mesh
from jrlhf.models import ModelDef, hf
from jrlhf.models.safetensors_io import CheckpointError

ONE = MeshSpec.of(fsdp=1, devices=[0])


@pytest.fixture(scope="module")
def one_mesh():
    return make_mesh(ONE)


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "llama_mha", "mistral"])
def test_logits_match_transformers(kind, one_mesh):
    path = hf_checkpoint(kind)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 48))
    ref = torch_logits(path, tokens)
    model, params = hf.load_hf(path, one_mesh, "fsdp_tp")
    out = np.asarray(jax.jit(model.apply)(params, jnp.asarray(tokens)))
    assert np.abs(out - ref).max() < 1e-4
    assert np.abs(ref).max() > 1.0  # a non-trivial comparison


# Qwen3, Gemma 2, Gemma 3 (text), and Gemma 3's text model read out of a multimodal checkpoint.
FAMILIES = ["qwen3", "gemma2", "gemma3", "gemma3_mm"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_new_families_match_transformers_on_one_device_and_a_sharded_mesh(kind, one_mesh):
    """Unrolled on one device (each layer's window and RoPE table chosen by a constant index)
    and scanned on a 2 x 2 mesh (chosen by the traced index)."""
    path = hf_checkpoint(kind)
    tokens = np.random.default_rng(0).integers(4, VOCAB, (2, 48))  # 3: gemma3_mm's image token
    ref = torch_logits(path, tokens)
    assert np.abs(ref).max() > 1.0
    for mesh, loop in ((one_mesh, "unroll"), (make_mesh("fsdp=2,tensor=2"), "scan")):
        model, params = hf.load_hf(path, mesh, "fsdp_tp")
        model = ModelDef(model.config.replace(layer_loop=loop), model.head)
        out = np.asarray(jax.jit(model.apply)(params, jnp.asarray(tokens)))
        assert np.abs(out - ref).max() < 1e-4, (kind, loop)


def test_new_families_configs_and_what_their_fixtures_exercise(one_mesh):
    """The configs read what each family has, and the fixtures are small enough that the
    window, the soft-caps and the local RoPE each change the logits."""
    q3 = hf.read_hf_config(hf_checkpoint("qwen3"))[0]
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 24 and q3.hidden_act == "silu"
    assert not q3.post_norms and q3.layer_windows == (0, 0)
    g2 = hf.read_hf_config(hf_checkpoint("gemma2"))[0]
    assert (g2.layer_windows, g2.attn_logit_softcap, g2.final_logit_softcap) == ((8, 0), 1.5, 4.0)
    assert g2.post_norms and g2.norm_unit_offset and g2.scale_embeddings and g2.tie_word_embeddings
    assert g2.query_pre_attn_scalar == 24 and not g2.qk_norm and g2.hidden_act == "gelu_tanh"
    g3 = hf.read_hf_config(hf_checkpoint("gemma3"))[0]
    assert g3.layer_windows == (8, 0, 8) and g3.qk_norm and g3.rope_local_theta == 10000.0
    assert (g3.rope_theta, g3.rope_scaling.rope_type, g3.rope_scaling.factor) == (1e6, "linear", 8)
    assert (g3.attn_logit_softcap, g3.final_logit_softcap) == (0.0, 0.0)
    assert hf.read_hf_config(hf_checkpoint("gemma3_mm"))[0] == g3

    tokens = jnp.asarray(np.random.default_rng(0).integers(4, VOCAB, (2, 48)))
    for kind, change in (
        ("gemma2", dict(attn_logit_softcap=0.0)),
        ("gemma2", dict(layer_types=())),  # the window on every layer
        ("gemma3", dict(rope_local_theta=0.0)),
    ):
        model, params = hf.load_hf(hf_checkpoint(kind), one_mesh, "fsdp_tp")
        want = jax.jit(model.apply)(params, tokens)
        other = ModelDef(model.config.replace(**change), model.head)
        assert np.abs(np.asarray(jax.jit(other.apply)(params, tokens) - want)).max() > 1e-2


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3"])
def test_new_families_value_heads_export_to_sequence_classifiers(kind, one_mesh, tmp_path):
    """A value-head model of each family exports as transformers' sequence classifier
    (Gemma3TextForSequenceClassification for Gemma 3) with the same last-token score."""
    import torch
    import transformers as tf

    lm, _ = hf.load_hf(hf_checkpoint(kind), one_mesh, "fsdp_tp")
    model = ModelDef(lm.config, "value")
    params = model.init_sharded(one_mesh, "fsdp_tp", seed=1)
    out_dir = hf.save_hf(model, params, tmp_path / "value")
    tokens = np.random.default_rng(6).integers(4, VOCAB, (2, 16))
    ref_model = tf.AutoModelForSequenceClassification.from_pretrained(out_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model.eval()(torch.tensor(tokens)).logits.numpy()[:, 0]
    values = np.asarray(jax.jit(model.apply)(params, jnp.asarray(tokens)))
    assert np.abs(values[:, -1] - ref).max() < 1e-5
    assert hf.load_hf(out_dir, one_mesh, "fsdp_tp")[0] == model


def test_family_fields_refuse_what_they_cannot_be_in_one_line(tmp_path):
    from jrlhf.models.config import ModelConfig, tiny_config
    from jrlhf.models.presets import get_preset

    cases = [
        (dict(layer_types=("full_attention",)), "layer_types has 1 entries for 2 layers"),
        (dict(layer_types=("full_attention", "local")), "layer_types 'local' unknown"),
        (dict(layer_types=("sliding_attention",) * 2), "sliding_window is 0"),
        (dict(hidden_act="relu"), "hidden_act 'relu' unknown"),
        (dict(attn_logit_softcap=-1.0), "attn_logit_softcap must be a finite number >= 0"),
        (dict(query_pre_attn_scalar=1.5), "query_pre_attn_scalar must be an integer >= 0"),
        (dict(attention="cudnn", dtype="bfloat16", attn_logit_softcap=50.0), "cannot soft-cap"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            tiny_config(**change)
        assert "\n" not in str(err.value)
    cfg = get_preset("gemma3_4b")
    assert ModelConfig.from_json(cfg.to_json()) == cfg  # tuples and RopeScaling come back
    # Qwen's sliding window applies from max_window_layers on, as transformers reads it
    qwen = json.loads((hf_checkpoint("qwen3") / "config.json").read_text())
    del qwen["layer_types"]
    qwen.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    cfg = hf.config_from_hf(qwen)[0]
    assert cfg.layer_windows == (0, 8)
    assert hf.config_from_hf(hf.config_to_hf(cfg))[0] == cfg
    # a gemma3 config.json without its text model, a bidirectional Gemma, an exact-GELU one
    text = json.loads((hf_checkpoint("gemma3") / "config.json").read_text())
    for bad, message in (
        ({"model_type": "gemma3"}, "a gemma3 config without a text_config"),
        ({**text, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({**text, "hidden_activation": "gelu"}, "hidden_activation 'gelu' unsupported"),
    ):
        with pytest.raises(CheckpointError, match=message):
            hf.config_from_hf(bad)


def test_left_padded_batch_matches_transformers(one_mesh):
    import torch
    import transformers as tf

    path = hf_checkpoint("llama3")
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, VOCAB, (3, 20))
    pads = [0, 5, 11]
    mask = np.ones_like(tokens)
    positions = np.zeros_like(tokens)
    for row, n in enumerate(pads):
        tokens[row, :n] = 0
        mask[row, :n] = 0
        positions[row, n:] = np.arange(20 - n)
    ref_model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(
            torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        ).logits.numpy()
    model, params = hf.load_hf(path, one_mesh, "fsdp_tp")
    out = np.asarray(
        jax.jit(model.apply)(params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
    )
    valid = mask.astype(bool)
    assert np.abs(out[valid] - ref[valid]).max() < 1e-4


def test_packed_segments_equal_separate_sequences(one_mesh):
    model, params = hf.load_hf(hf_checkpoint("qwen2"), one_mesh, "fsdp_tp")
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, VOCAB, 12), rng.integers(0, VOCAB, 9)
    packed = np.concatenate([a, b])[None]
    positions = np.concatenate([np.arange(12), np.arange(9)])[None]
    segments = np.concatenate([np.full(12, 1), np.full(9, 2)])[None]
    apply = jax.jit(model.apply)
    out = np.asarray(apply(params, packed, positions, segments))[0]
    sep_a = np.asarray(apply(params, a[None]))[0]
    sep_b = np.asarray(apply(params, b[None]))[0]
    assert np.abs(out[:12] - sep_a).max() < 1e-5
    assert np.abs(out[12:] - sep_b).max() < 1e-5


def test_reward_model_matches_sequence_classification(one_mesh):
    import torch
    import transformers as tf

    path = hf_checkpoint("llama3_rm")
    tokens = np.random.default_rng(3).integers(3, VOCAB, (2, 16))
    ref_model = tf.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model.eval()(torch.tensor(tokens)).logits.numpy()[:, 0]
    model, params = hf.load_hf(path, one_mesh, "fsdp_tp")
    assert model.head == "value"
    values = np.asarray(jax.jit(model.apply)(params, jnp.asarray(tokens)))
    assert values.shape == (2, 16)
    assert np.abs(values[:, -1] - ref).max() < 1e-4


@pytest.mark.parametrize("kind", ["llama3", "qwen2", *FAMILIES])
def test_export_reloads_in_transformers(kind, one_mesh, tmp_path):
    """A multimodal Gemma 3 exports its text model (Gemma3ForCausalLM), with the same logits."""
    path = hf_checkpoint(kind)
    model, params = hf.load_hf(path, one_mesh, "fsdp_tp")
    out_dir = hf.save_hf(model, params, tmp_path / "export", max_shard_bytes=60_000)
    assert (out_dir / "model.safetensors.index.json").exists()  # sharded export path exercised
    tokens = np.random.default_rng(4).integers(4, VOCAB, (2, 24))
    exported = torch_logits(out_dir, tokens)
    original = torch_logits(path, tokens)
    assert np.abs(exported - original).max() < 1e-5
    reloaded, params2 = hf.load_hf(out_dir, one_mesh, "fsdp_tp")
    assert reloaded == model
    np.testing.assert_array_equal(
        np.asarray(params2["layers"]["attn"]["q_kernel"]),
        np.asarray(params["layers"]["attn"]["q_kernel"]),
    )


def _copy_checkpoint(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_fail_with_one_line(one_mesh, tmp_path):
    from safetensors.numpy import load_file, save_file

    src = hf_checkpoint("llama_mha")
    # unsupported architecture
    bad = _copy_checkpoint(src, tmp_path / "arch")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: model_type 'gpt2' is not supported"):
        hf.load_hf(bad, one_mesh, "fsdp_tp")
    # a size a model cannot have (a ZeroDivisionError deep in the build before)
    zero = _copy_checkpoint(src, tmp_path / "zero")
    cfg = json.loads((zero / "config.json").read_text())
    cfg["num_attention_heads"] = 0
    (zero / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="num_heads must be an integer >= 1 .got 0."):
        hf.load_hf(zero, one_mesh, "fsdp_tp")
    # missing tensor
    missing = _copy_checkpoint(src, tmp_path / "missing")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        hf.load_hf(missing, one_mesh, "fsdp_tp")
    # misshapen tensor
    shaped = _copy_checkpoint(src, tmp_path / "shape")
    tensors = load_file(shaped / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors[
        "model.layers.0.self_attn.k_proj.weight"
    ][:8]
    save_file(tensors, shaped / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        hf.load_hf(shaped, one_mesh, "fsdp_tp")
    msg = str(err.value)
    assert "model.safetensors" in msg and "k_proj.weight" in msg and "\n" not in msg
    # truncated file
    trunc = _copy_checkpoint(src, tmp_path / "trunc")
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        hf.load_hf(trunc, one_mesh, "fsdp_tp")


def test_export_refuses_to_clobber(one_mesh, tmp_path):
    model, params = hf.load_hf(hf_checkpoint("llama_mha"), one_mesh, "fsdp_tp")
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError):
        hf.save_hf(model, params, target)
    assert (target / "keep.txt").read_text() == "precious"


def test_mistral_sliding_window_is_in_effect(one_mesh):
    model, _ = hf.load_hf(hf_checkpoint("mistral"), one_mesh, "fsdp_tp")
    assert model.config.sliding_window == 16 and model.config.architecture == "mistral"


def test_bfloat16_params_and_compute_track_float32(one_mesh):
    path = hf_checkpoint("llama3")
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, VOCAB, (2, 32)))
    model32, p32 = hf.load_hf(path, one_mesh, "fsdp_tp")
    model16, p16 = hf.load_hf(path, one_mesh, "fsdp_tp", param_dtype="bfloat16", dtype="bfloat16")
    assert p16["layers"]["attn"]["q_kernel"].dtype == jnp.bfloat16
    out32 = np.asarray(jax.jit(model32.apply)(p32, tokens))
    out16 = jax.jit(model16.apply)(p16, tokens)
    assert out16.dtype == jnp.float32  # logits are always float32
    # bf16 has ~3 significant digits: the logits agree to a few percent of their scale.
    assert np.abs(np.asarray(out16) - out32).max() < 0.05 * np.abs(out32).max()
    assert (np.asarray(out16).argmax(-1) == out32.argmax(-1)).mean() > 0.9
