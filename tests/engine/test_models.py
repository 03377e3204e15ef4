"""Architecture coverage without downloads: tiny random Llama / Mistral / Qwen2
checkpoints written by transformers itself, served by pdserve and compared with
HF in fp32 (all-position logits through the model, greedy tokens through the
engine); dummy presets; and the errors a bad model path gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kernels.ops import TORCH_OPS
from services.config import EngineConfig
from services.engine.attention_metadata import AttentionMetadata
from services.engine.engine import Engine
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from services.engine.loader import load_model
from services.engine.model_source import resolve_model
from services.engine.model_config import PRESETS
from services.engine.sampling_params import SamplingParams
from services.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError
from tests.engine.checks import assert_no_leaks, generate, run, tokens

VOCAB = 256
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# head_dim 16 at theta 5e5: wavelengths 6.3 (kept), 32.5 (smoothed: between 64/4 and 64/1) and >64 (scaled),
# so all three llama3 bands are used
ARCHS = {
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama-untied": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3-rope": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),  # qkv projections carry a bias
}

pytestmark = pytest.mark.usefixtures("one_thread")


def build_hf(config_class: str, tmp: Path, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(**{**SHAPE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp)  # config.json + model.safetensors; no tokenizer files
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (HF model, checkpoint directory), built once per module."""
    out = {}
    for name, (cls, overrides) in ARCHS.items():
        d = tmp_path_factory.mktemp(name)
        out[name] = (build_hf(cls, d, **overrides), d)
    return out


def pdserve_logits(directory: Path, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits at every prompt position from pdserve's model, one prefill over a paged cache."""
    source = resolve_model(str(directory))
    cfg = source.config
    model = load_model(source, TORCH_OPS, torch.float32, "cpu", max_positions=cfg.max_position_embeddings)
    n = len(ids)
    num_blocks = -(-n // block_size)
    kv = allocate_kv_cache(KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, "float32"),
                           num_blocks + 1)
    # blocks 1..num_blocks in reverse order, so the block table is not the identity
    table = list(range(num_blocks, 0, -1))
    slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
    meta = AttentionMetadata(
        kv_cache=kv, slot_mapping=torch.tensor(slots), num_decode_tokens=0, decode_block_tables=None,
        decode_context_lens=None, prefill_block_tables=torch.tensor([table], dtype=torch.int32),
        prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32),
    )
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta))


@torch.inference_mode()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_generate(hf, ids: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # like ignore_eos
    hf.generation_config.pad_token_id = 0
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- parity with HF -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf(checkpoints, arch):
    hf, directory = checkpoints[arch]
    ids = prompt(70)  # several blocks, positions past llama3's original context
    ours = pdserve_logits(directory, ids)
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_config_reads_the_architecture(checkpoints):
    cfgs = {arch: resolve_model(str(d)).config for arch, (_, d) in checkpoints.items()}
    assert cfgs["qwen2"].qkv_bias and cfgs["qwen2"].model_type == "qwen2"
    assert not cfgs["llama-tied"].qkv_bias and not cfgs["mistral"].qkv_bias
    assert cfgs["llama-tied"].tie_word_embeddings and not cfgs["llama-untied"].tie_word_embeddings
    assert cfgs["llama3-rope"].rope_scaling["rope_type"] == "llama3"
    assert cfgs["llama3-rope"].rope_theta == 500000.0
    assert cfgs["llama-tied"].rope_scaling is None
    assert all((c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 16) for c in cfgs.values())


def test_rope_scaling_changes_the_logits(checkpoints, tmp_path):
    # guards the llama3 case above: without its scaling the same weights give other logits
    hf, directory = checkpoints["llama3-rope"]
    cfg = json.loads((directory / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    shutil.copy(directory / "model.safetensors", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = prompt(70)
    assert not torch.allclose(pdserve_logits(tmp_path, ids), hf_logits(hf, ids), atol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_matches_hf_generate(checkpoints, arch):
    hf, directory = checkpoints[arch]
    engine = Engine(EngineConfig(model=str(directory), dtype="fp32", kv_cache_bytes=4 << 20,
                                 long_prefill_chunk=16))
    prompts = {"long": prompt(45, seed=1), "short": prompt(6, seed=2)}  # chunked prefill beside decodes
    outs = generate(engine, prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for rid, ids in prompts.items():
        assert tokens(outs[rid]) == hf_generate(hf, ids, 12), rid
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch", ["llama-tied", "qwen2"])
def test_directory_without_tokenizer_serves_token_ids(checkpoints, arch):
    _, directory = checkpoints[arch]
    engine = Engine(EngineConfig(model=str(directory), dtype="fp32", kv_cache_bytes=1 << 20))
    assert engine.tokenizer is None
    # the EOS comes from config.json (llama: 2; this qwen2 config names none), never from a stand-in tokenizer
    assert engine.eos_token_ids == tuple(engine.model_config.eos_token_ids)
    outs = generate(engine, {"r": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(tokens(outs["r"])) == 3 and outs["r"][-1].new_text == ""
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.add_request("s", [5, 6, 7], SamplingParams(stop=["x"]))
    assert_no_leaks(engine)


def test_sliding_window_model_is_exact_or_refuses(tmp_path):
    window = 8
    hf = build_hf("MistralConfig", tmp_path, sliding_window=window)
    ids = prompt(3 * window)
    engine = Engine(EngineConfig(model=str(tmp_path), dtype="fp32", kv_cache_bytes=1 << 20))
    try:
        engine.add_request("r", ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    except InvalidRequestError as exc:  # refusing what it cannot compute exactly is fine
        assert "context" in exc.message
    else:  # serving it is fine only if the tokens are HF's
        outs = run(engine)
        assert tokens(outs["r"]) == hf_generate(hf, ids, 6)
    assert_no_leaks(engine)


# ---- dummy presets ----------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_dummy_presets_resolve_without_files(preset):
    source = resolve_model(f"dummy:{preset}")
    assert source.weights_dir is None and source.tokenizer_dir is None
    for key, value in PRESETS[preset].items():
        assert getattr(source.config, key) == value


def test_dummy_tiny_serves(tiny_engine):
    engine = tiny_engine()
    assert engine.model_name == "dummy:tiny" and engine.tokenizer is None
    outs = generate(engine, {"r": [5, 6, 7]}, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(tokens(outs["r"])) == 4
    assert_no_leaks(engine)


def test_dummy_weights_follow_the_seed(tiny_engine):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = [tokens(generate(tiny_engine(seed=s), {"r": list(range(10, 30))}, params)["r"]) for s in (0, 0, 1)]
    assert runs[0] == runs[1] != runs[2]


# ---- bad models -------------------------------------------------------------------------------


def test_unknown_preset():
    with pytest.raises(ModelNotFoundError, match="unknown dummy preset 'nope'; known: .*tiny"):
        Engine(EngineConfig(model="dummy:nope"))


def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match=f"model '{missing}' not found"):
        Engine(EngineConfig(model=str(missing)))


def test_corrupt_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file" * 100)
    with pytest.raises(ModelLoadError, match=f"cannot read GGUF file {bad}"):
        Engine(EngineConfig(model=str(bad)))
    assert not list((tmp_path / "cache").glob("models/*"))  # nothing half-converted left in the cache


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        Engine(EngineConfig(model=str(f)))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        Engine(EngineConfig(model=str(tmp_path)))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10, "hidden_size": 8,
                                                      "intermediate_size": 8, "num_hidden_layers": 1,
                                                      "num_attention_heads": 1}))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt2'"):
        resolve_model(str(tmp_path))


def test_truncated_safetensors(checkpoints, tmp_path):
    _, directory = checkpoints["llama-tied"]
    shutil.copy(directory / "config.json", tmp_path)
    data = (directory / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(resolve_model(str(tmp_path)), TORCH_OPS, torch.float32, "cpu", max_positions=64)


def test_directory_without_weights(checkpoints, tmp_path):
    _, directory = checkpoints["llama-tied"]
    shutil.copy(directory / "config.json", tmp_path)
    with pytest.raises(ModelLoadError, match=r"has no \*.safetensors weights"):
        load_model(resolve_model(str(tmp_path)), TORCH_OPS, torch.float32, "cpu", max_positions=64)


def test_weights_that_do_not_fit_the_config(checkpoints, tmp_path):
    _, directory = checkpoints["llama-tied"]
    cfg = json.loads((directory / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(directory / "model.safetensors", tmp_path)
    with pytest.raises(ModelLoadError, match="do not fit the config: shape mismatch"):
        load_model(resolve_model(str(tmp_path)), TORCH_OPS, torch.float32, "cpu", max_positions=64)
