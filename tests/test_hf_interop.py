"""HuggingFace Llama / Qwen2 import and export: logit parity with transformers, greedy parity,
round trips, and one clear error per kind of bad input."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from relf_jax.errors import UserError  # noqa: E402
from relf_jax.export import hf  # noqa: E402
from relf_jax.sampling import autoregressive as ar  # noqa: E402

WORDS = "hello there how are you today i am fine thanks the weather is nice , . ? !".split()
SPECIALS = ["<pad>", "</s>", "<s>", "<unk>"]


def word_tokenizer(vocab_size):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   unk_token="<unk>")


def save_hf_folder(tmp_path, name, model_cls, config, shard=False):
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # random norms and biases, so a missed weight shows in the logits
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    path = str(tmp_path / name)
    model.save_pretrained(path, max_shard_size="30KB" if shard else "1GB")
    word_tokenizer(config.vocab_size).save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   rms_norm_eps=1e-5, rope_theta=5000.0, max_position_embeddings=64,
                                   bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return save_hf_folder(tmp_path_factory.mktemp("hf"), "llama", transformers.LlamaForCausalLM, cfg, shard=True)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    cfg = transformers.Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                   max_position_embeddings=64, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return save_hf_folder(tmp_path_factory.mktemp("hf"), "qwen2", transformers.Qwen2ForCausalLM, cfg)


PROMPTS = np.array([[2, 5, 9, 13, 17, 21, 8, 30], [2, 40, 41, 12, 6, 6, 7, 50], [2, 33, 4, 19, 27, 11, 60, 9]])


def ours_logits(lm, tokens):
    from flax import nnx

    # jitted: one program instead of one per operation
    return np.asarray(jax.jit(lambda p, t: nnx.merge(lm.graphdef, p)(t)[0])(lm.params, jnp.asarray(tokens)))


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def greedy_ours(lm, tokens, n):
    prompts, lens = ar.pad_prompts([list(r) for r in tokens], pad_id=lm.tokenizer.pad_id)
    state = ar.generate(lm.graphdef, lm.params, prompts, lens, jax.random.key(0), ar.TracedSampling.make(0.0),
                        ar.DecodeSettings(max_new_tokens=n, eos_id=-1, pad_id=lm.tokenizer.pad_id))
    toks = np.asarray(state.tokens)
    return toks[:, tokens.shape[1]:tokens.shape[1] + n]


def greedy_hf(model, tokens, n):
    with torch.no_grad():
        out = model.generate(torch.tensor(tokens), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    return out[:, tokens.shape[1]:].numpy()


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_import_logits_and_greedy_match_transformers(which, llama_dir, qwen_dir):
    path, model = llama_dir if which == "llama" else qwen_dir
    lm = hf.from_hf(path)
    assert lm.model_cfg.qkv_bias == (which == "qwen2")
    assert lm.model_cfg.tie_embeddings == (which == "qwen2")
    np.testing.assert_allclose(ours_logits(lm, PROMPTS), hf_logits(model, PROMPTS), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(greedy_ours(lm, PROMPTS, 12), greedy_hf(model, PROMPTS, 12))
    assert lm.tokenizer.encode("hello there , how are you") == [4, 5, 18, 6, 7, 8]
    assert (lm.tokenizer.bos_id, lm.tokenizer.eos_id, lm.tokenizer.pad_id) == (2, 1, 0)


def test_export_hf_round_trip_of_a_relf_jax_model(tmp_path, tiny_model, tiny_model_cfg):
    """A relf_jax-native model (scaled, tied embeddings; SentencePiece tokenizer) exported to HF:
    transformers' logits equal relf_jax's, and the exported tokenizer gives relf_jax's ids."""
    import dataclasses

    from relf_jax.checkpoint import LoadedModel
    from relf_jax.config import Config
    from relf_jax.data.tokenizer import train_tokenizer

    texts = [f"<user> {' '.join(WORDS[i % 7:i % 7 + 5])} <assistant> {' '.join(WORDS[i % 5:])} {i}"
             for i in range(200)]
    tok = train_tokenizer(texts, 80)
    mcfg = dataclasses.replace(tiny_model_cfg, vocab_size=tok.vocab_size)
    from flax import nnx

    from relf_jax.models import build_model

    graphdef, params = nnx.split(build_model(mcfg, nnx.Rngs(3)))
    lm = LoadedModel(cfg=Config(), model_cfg=mcfg, graphdef=graphdef, params=params, tokenizer=tok, step=0)
    out = hf.export_hf(lm, str(tmp_path / "exported"), check_texts=texts[:50])
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = np.array([[tok.bos_id] + tok.encode(t)[:10] for t in texts[:3]])
    np.testing.assert_allclose(hf_logits(model, tokens), ours_logits(lm, tokens), atol=1e-4, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    for t in texts[:20] + ["<user> how is the weather ? <assistant> fine"]:
        assert hf_tok(t, add_special_tokens=False).input_ids == tok.encode(t)
    assert hf_tok.decode(tok.encode(texts[0])) == texts[0]
    from relf_jax.data.tokenizer import encode_prompt

    assert hf_tok(texts[2]).input_ids == encode_prompt(tok, texts[2])  # the BOS relf_jax's prompts start with
    # and back in: HF -> relf_jax gives the same logits
    back = hf.from_hf(out)
    np.testing.assert_allclose(ours_logits(back, tokens), ours_logits(lm, tokens), atol=1e-4, rtol=0)
    assert back.tokenizer.add_bos and back.tokenizer.eos_ids == (tok.eos_id,)
    assert back.tokenizer.encode(texts[3]) == tok.encode(texts[3])
    # a directory with only a SentencePiece tokenizer.model (as many Llama checkpoints ship)
    import shutil

    spm_dir = tmp_path / "spm_only"
    shutil.copytree(out, spm_dir)
    os.remove(spm_dir / "tokenizer.json")
    cfg = json.load(open(spm_dir / "tokenizer_config.json"))
    (spm_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "LlamaTokenizer"}))
    spm_lm = hf.from_hf(str(spm_dir))
    ref = transformers.AutoTokenizer.from_pretrained(str(spm_dir))
    assert spm_lm.tokenizer.encode(texts[1]) == ref(texts[1], add_special_tokens=False).input_ids
    assert (spm_lm.tokenizer.bos_id, spm_lm.tokenizer.eos_id) == (tok.bos_id, tok.eos_id)


def test_bad_inputs_give_one_clear_error(tmp_path, llama_dir):
    with pytest.raises(UserError, match="not a local directory"):
        hf.from_hf(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        hf.from_hf(str(tmp_path / "empty"))
    path, _ = llama_dir
    cfg = json.load(open(os.path.join(path, "config.json")))
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UserError, match="unsupported architecture"):
        hf.from_hf(str(bad))
    # same weights, a config that promises a wider MLP: a shape error naming the tensor
    import shutil

    wrong = tmp_path / "wrong"
    shutil.copytree(path, wrong)
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(UserError, match=r"mlp\.w_(gate|up|down) has shape"):
        hf.from_hf(str(wrong))


SHARDED_SCRIPT = r"""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
sys.path.insert(0, sys.argv[1])
from relf_jax.export.hf import from_hf
from relf_jax.runtime.sharding import make_mesh
tokens = jnp.asarray(json.loads(sys.argv[3]))
out = {}
for name, mesh in (("one", None), ("eight", make_mesh(2, 2, 2))):
    lm = from_hf(sys.argv[2], mesh=mesh)
    with jax.set_mesh(mesh or make_mesh(1, 1, 1, devices=jax.devices()[:1])):
        logits = nnx.merge(lm.graphdef, lm.params)(tokens)[0]
    out[name] = {"logits": np.asarray(logits).tolist(),
                 "specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(lm.params)}),
                 "devices": sorted({len(x.sharding.device_set) for x in jax.tree.leaves(lm.params)})}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.multidevice
def test_from_hf_shards_on_a_mesh(llama_dir):
    """With a mesh, imported parameters are placed by their logical axes; logits unchanged."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT, root, llama_dir[0], json.dumps(PROMPTS.tolist())],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["eight"]["devices"] == [8]
    assert any("fsdp" in s or "tensor" in s for s in out["eight"]["specs"]), out["eight"]["specs"]
    np.testing.assert_allclose(out["eight"]["logits"], out["one"]["logits"], atol=1e-5, rtol=0)
