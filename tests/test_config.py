"""M3Config reads the release's nested/original spelling and transformers' flat one, and rejects bad values."""

from __future__ import annotations

import json

import pytest

from m3export.config import ConfigError, M3Config, VisionConfig, preset

RELEASE_TEXT = {
    "model_type": "minimax_m3", "hidden_size": 6144, "num_hidden_layers": 60, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 200064, "intermediate_size": 3072,
    "shared_intermediate_size": 3072, "dense_intermediate_size": 12288, "num_local_experts": 128,
    "num_experts_per_tok": 4, "n_shared_experts": 1, "moe_layer_freq": [0, 0, 0] + [1] * 57,
    "routed_scaling_factor": 2.0, "scoring_func": "sigmoid", "use_routing_bias": True, "hidden_act": "swigluoai",
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rms_norm_eps": 1e-6, "use_gemma_norm": True, "use_qk_norm": True,
    "qk_norm_type": "per_head", "attention_output_gate": False, "rope_theta": 5000000, "rotary_dim": 64,
    "partial_rotary_factor": 0.5, "max_position_embeddings": 1048576, "num_mtp_modules": 7,
    "num_nextn_predict_layers": 1,
    "sparse_attention_config": {
        "use_sparse_attention": True, "sparse_attention_freq": [0, 0, 0] + [1] * 57, "sparse_num_index_heads": 4,
        "sparse_index_dim": 128, "sparse_topk_blocks": 16, "sparse_block_size": 128, "sparse_init_block": 0,
        "sparse_local_block": 1, "sparse_score_type": "max", "sparse_disable_index_value": [0, 0, 0] + [1] * 57,
    },
}
RELEASE = {
    "model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
    "tie_word_embeddings": False, "text_config": RELEASE_TEXT, "vision_config": {"hidden_size": 1280},
    "quantization_config": {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
                            "ignored_layers": ["lm_head", "model.embed_tokens", "vision_tower"]},
}


def test_release_config_equals_full_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASE))
    cfg = M3Config.from_pretrained(tmp_path)
    full = preset("full")
    assert cfg.quantization is not None and cfg.quantization.weight_block_size == (1, 32)
    assert cfg.replace(quantization=None, vision=None) == full  # the presets are text-only
    assert cfg.vision == VisionConfig()  # the release's vision_config (hidden 1280) and the wrapper's defaults
    assert cfg.layer_types[:4] == ["full_attention"] * 3 + ["minimax_m3_sparse"]
    assert cfg.num_mtp_modules == 7 and cfg.swiglu_beta == 1.0


def test_flat_transformers_names_round_trip():
    cfg = preset("tiny")
    again = M3Config.from_dict(cfg.to_hf_dict())
    assert again == cfg.replace(num_mtp_modules=0)
    assert M3Config.from_dict(cfg.to_original_dict()) == cfg


@pytest.mark.parametrize("change, message", [
    ({"sparse_num_index_heads": 2}, "must equal num_key_value_heads"),
    ({"sparse_score_type": "mean"}, "sparse_score_type / index_score_type 'mean'"),
    ({"sparse_local_block": 20}, "forced blocks would not fit"),
])
def test_sparse_config_errors(change, message):
    text = dict(RELEASE_TEXT, sparse_attention_config={**RELEASE_TEXT["sparse_attention_config"], **change})
    with pytest.raises(ConfigError, match=message):
        M3Config.from_dict({"text_config": text})


@pytest.mark.parametrize("change, message", [
    ({"rotary_dim": 256, "partial_rotary_factor": 2.0}, "rotary_dim .256. must not exceed head_dim"),
    ({"rotary_dim": 32}, "disagrees with partial_rotary_factor"),
    ({"moe_layer_freq": [1] * 59}, "mlp_layer_types has 59 entries but num_hidden_layers is 60"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"num_attention_heads": 66}, "must be a multiple of num_key_value_heads"),
    ({"hidden_size": "6144"}, "hidden_size must be an integer"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"use_gemma_norm": False}, "use_gemma_norm"),
])
def test_text_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        M3Config.from_dict({"text_config": {**RELEASE_TEXT, **change}})


def test_layer_type_values_are_checked():
    cfg = preset("tiny")
    d = cfg.to_hf_dict()
    d["layer_types"] = ["full_attention", "sliding", "minimax_m3_sparse", "minimax_m3_sparse"]
    with pytest.raises(ConfigError, match=r"layer_types\[1\] = 'sliding'"):
        M3Config.from_dict(d)


def test_quantization_config_checked():
    with pytest.raises(ConfigError, match="weight_block_size"):
        M3Config.from_dict({**RELEASE, "quantization_config": {"quant_method": "mxfp8", "weight_block_size": [128, 128]}})
    with pytest.raises(ConfigError, match="only 'mxfp8'"):
        M3Config.from_dict({**RELEASE, "quantization_config": {"quant_method": "fp8"}})


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        M3Config.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        M3Config.from_pretrained(tmp_path)


def test_presets():
    tiny, mini, full = preset("tiny"), preset("mini"), preset("full")
    assert tiny.index_block_size * tiny.index_topk_blocks < 40  # selection matters at a few dozen tokens
    assert (mini.hidden_size, mini.num_attention_heads, mini.head_dim) == (full.hidden_size, 64, 128)
    assert mini.num_hidden_layers < full.num_hidden_layers and mini.num_local_experts < full.num_local_experts
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("huge")


# Issue 10 item 9: every field is type-checked (lists and optional ints included) and every value range the model
# relies on is enforced, each as a ConfigError that names the field.
@pytest.mark.parametrize("change, message", [
    ({"eos_token_id": [{}]}, r"eos_token_id must be a list of integers, got \[\{\}\]"),
    ({"eos_token_id": "eos"}, "eos_token_id must be a list of integers, got 'eos'"),
    ({"eos_token_id": 200064}, r"eos_token_id \(200064\) must be a token id in \[0, vocab_size=200064\)"),
    ({"bos_token_id": "x"}, "bos_token_id must be an integer or null, got 'x'"),
    ({"pad_token_id": -1}, r"pad_token_id \(-1\) must be a token id"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be finite"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be positive"),
    ({"rope_theta": 0}, "rope_theta must be positive"),
    ({"rope_theta": -5.0}, "rope_theta must be positive"),
    ({"rope_theta": float("inf")}, "rope_theta must be finite"),
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor must be finite"),
    ({"swiglu_limit": -1.0}, "swiglu_limit must be >= 0"),
    ({"swiglu_alpha": True}, "swiglu_alpha must be a number, got True"),
    ({"max_position_embeddings": 1}, "max_position_embeddings must be >= 2"),
    ({"use_routing_bias": "no"}, "use_routing_bias must be true or false, got 'no'"),
    ({"scoring_func": 1}, "scoring_func must be a string"),
    ({"num_local_experts": 128.0}, "num_local_experts must be an integer"),
])
def test_every_field_is_type_and_range_checked(change, message):
    with pytest.raises(ConfigError, match=message):
        M3Config.from_dict({"text_config": {**RELEASE_TEXT, **change}})


def test_replace_checks_types_too():
    with pytest.raises(ConfigError, match="eos_token_id must be a list of integers"):
        preset("tiny").replace(eos_token_id=["257"])
    assert preset("tiny").replace(use_routing_bias=False).use_routing_bias is False


@pytest.mark.parametrize("raw", [{}, {"text_config": {}}, {k: v for k, v in RELEASE_TEXT.items() if k != "hidden_size"}])
def test_missing_size_is_an_error_not_the_full_model(raw):
    with pytest.raises(ConfigError, match="missing .*hidden_size|missing hidden_size"):
        M3Config.from_dict(raw)


def _nested(path: str, value):
    text = json.loads(json.dumps(RELEASE_TEXT))
    top = {**json.loads(json.dumps(RELEASE)), "text_config": text}
    where = text if not path.startswith("/") else top
    *parents, leaf = path.strip("/").split(".")
    for p in parents:
        where = where[p]
    where[leaf] = value
    return top


# The 11 config.json shapes that printed tracebacks (reliability review U6), plus tie_word_embeddings as a string.
@pytest.mark.parametrize("path, value, message", [
    ("partial_rotary_factor", "half", "partial_rotary_factor must be a number, got 'half'"),
    ("head_dim", "32", "head_dim must be an integer, got '32'"),
    ("sparse_attention_config", [1], "sparse_attention_config must be an object"),
    ("rope_scaling", "yarn", "rope_scaling must be an object"),
    ("/quantization_config", [1, 32], "quantization_config must be an object"),
    ("layer_types", 3, "layer_types must be a list"),
    ("moe_layer_freq", 1, "moe_layer_freq must be a list"),
    ("sparse_attention_config.sparse_attention_freq", 1, "sparse_attention_freq must be a list"),
    ("sparse_attention_config.sparse_disable_index_value", 1, "sparse_disable_index_value must be a list"),
    ("/quantization_config.weight_block_size", 32, "weight_block_size must be a list"),
    ("/tie_word_embeddings", "false", "tie_word_embeddings must be true or false, got 'false'"),
])
def test_malformed_config_json_is_one_clear_error(tmp_path, path, value, message):
    (tmp_path / "config.json").write_text(json.dumps(_nested(path, value)))
    with pytest.raises(ConfigError, match=message):
        M3Config.from_pretrained(tmp_path)


def test_unreadable_config_json_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"hidden_size": "\xff\xfe"}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        M3Config.from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="cannot read"):
        M3Config.from_pretrained(tmp_path)
