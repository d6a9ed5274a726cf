"""HuggingFace chat checkpoints: import keeps the folder's chat template, special tokens, EOS ids
and generation defaults; prompts equal transformers' ``apply_chat_template`` ids; decode skips
special tokens; the tokenizer survives the checkpoint round trip (and old bytes still load).

The tokenizers and templates are built here, in the styles real checkpoints use: a byte-level
BPE with added special tokens, saved with transformers' ``save_pretrained``; a ChatML template
with a default system message and a tools block (Qwen2.5 style), Llama-3 headers with
``{{ bos_token }}`` first, block tags on their own lines with loop controls.
"""

import json
import os
import shutil

import pytest

transformers = pytest.importorskip("transformers")

from relf_jax.data.tokenizer import (
    HFTokenizer,
    encode_prompt,
    same_tokenization,
    tokenizer_from_bytes,
    turn_stop_ids,
)
from relf_jax.errors import UserError
from relf_jax.export import hf
from relf_jax.serving.chat_template import ChatTemplate, check_messages, encode_chat

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"]

# ChatML with a default system message and a tools block, whitespace control on every tag.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama-3 headers: the template writes the BOS; a system message must come first.
LLAMA_TEMPLATE = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}
{% set system = messages[0]['content'] %}
{% set rest = messages[1:] %}
{% else %}
{% set system = 'Cutting Knowledge Date: December 2023' %}
{% set rest = messages %}
{% endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nToday Year: ' + strftime_now('%Y') + '\\n' + system | trim + '<|eot_id|>' -}}
{% for message in rest %}
    {% if message['role'] == 'system' %}
        {{- raise_exception('System messages must come first.') -}}
    {% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' -}}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{% endif %}
"""

# Block tags on their own lines (trim_blocks + lstrip_blocks matter), loop controls, a
# {% generation %} block, an eos_token after each assistant turn.
BLOCKS_TEMPLATE = """{% for message in messages %}
    {% if message.role == 'system' %}
<|im_start|>system
{{ message.content }}<|im_end|>
        {% continue %}
    {% endif %}
    {% if message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message.content }}{% endgeneration %}{{ eos_token }}
    {% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
    {% endif %}
    {% if loop.index > 20 %}
        {% break %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

TOOL_TEMPLATE = QWEN_TEMPLATE.replace("You are a helpful assistant.", "You may call tools.")

SINGLE = [{"role": "user", "content": "Hello there, how are you?"}]
SYSTEM = [{"role": "system", "content": "You are terse."}, *SINGLE]
MULTI = [*SINGLE, {"role": "assistant", "content": "Fine, thanks. And you?"},
         {"role": "user", "content": "Hello again: é ü 日本 🙂"}]
MULTI_SYSTEM = [SYSTEM[0], *MULTI]
CONVERSATIONS = {"single": SINGLE, "system": SYSTEM, "multi": MULTI, "multi_system": MULTI_SYSTEM}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def _backend(specials, post_bos=None):
    """A byte-level BPE (every byte a token, a few merges) with added special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    merges = [("H", "e"), ("l", "l"), ("He", "ll"), ("Hell", "o"), ("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    if post_bos:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{post_bos} $A", pair=f"{post_bos} $A {post_bos} $B",
            special_tokens=[(post_bos, tk.token_to_id(post_bos))])
    return tk


def _save_tokenizer(path, kind, template_form="jinja", generation=None):
    """A Qwen2-like (no BOS, eos <|im_end|>, generation eos [<|im_end|>, <|endoftext|>]) or
    Llama-3-like (BOS added by the post-processor, eos <|eot_id|>) tokenizer folder.
    template_form: "jinja" (chat_template.jinja), "key" (tokenizer_config.json), "list"
    (tokenizer_config.json's named-templates list, with a tool_use template)."""
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    if kind == "qwen":
        tk = _backend(QWEN_SPECIALS)
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                      chat_template=QWEN_TEMPLATE if kind == "qwen" else LLAMA_TEMPLATE)
        ids = {n: tk.token_to_id(n) for n in QWEN_SPECIALS}
        gen = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
               "pad_token_id": ids["<|endoftext|>"], "do_sample": True, "temperature": 0.7, "top_p": 0.8,
               "top_k": 20, "repetition_penalty": 1.05}
        cfg = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}
    elif kind == "blocks":
        tk = _backend(QWEN_SPECIALS)
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                      chat_template=BLOCKS_TEMPLATE)
        ids = {n: tk.token_to_id(n) for n in QWEN_SPECIALS}
        gen, cfg = {"eos_token_id": ids["<|im_end|>"]}, {"eos_token_id": ids["<|endoftext|>"]}
    else:
        tk = _backend(LLAMA_SPECIALS, post_bos="<|begin_of_text|>")
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                      chat_template=LLAMA_TEMPLATE)
        ids = {n: tk.token_to_id(n) for n in LLAMA_SPECIALS}
        gen = {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]],
               "temperature": 0.6, "top_p": 0.9}  # no do_sample: transformers decodes greedily
        cfg = {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]}
    tok.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation or gen, f)
    if template_form != "jinja":
        os.remove(os.path.join(path, "chat_template.jinja"))
        tcfg_path = os.path.join(path, "tokenizer_config.json")
        tcfg = _read_json(tcfg_path)
        source = tok.chat_template
        tcfg["chat_template"] = source if template_form == "key" else [
            {"name": "default", "template": source}, {"name": "tool_use", "template": TOOL_TEMPLATE}]
        with open(tcfg_path, "w") as f:
            json.dump(tcfg, f)
    return path, cfg


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tok")
    return {kind: _save_tokenizer(str(root / kind), kind) for kind in ("qwen", "llama", "blocks")}


def _both(path, cfg):
    return hf.tokenizer_from_hf(path, cfg), transformers.AutoTokenizer.from_pretrained(path)


def _hf_ids(hf_tok, messages, **kw):
    out = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("kind", ["qwen", "llama", "blocks"])
def test_prompt_ids_equal_apply_chat_template(folders, kind, conv):
    tok, ref = _both(*folders[kind])
    messages = CONVERSATIONS[conv]
    ours = encode_chat(tok, ChatTemplate.for_tokenizer(tok), messages)
    assert ours == _hf_ids(ref, messages)
    if kind == "llama":  # the template writes the BOS: once, as its single id
        assert ours[0] == tok.bos_id and ours.count(tok.bos_id) == 1
    if kind == "qwen":  # no BOS; special tokens in the rendered text are their single ids
        assert ours[0] == tok.piece_to_id("<|im_start|>") and tok.piece_to_id("<|endoftext|>") not in ours


def test_tools_and_tool_messages_render_as_transformers(folders):
    tok, ref = _both(*folders["qwen"])
    template = ChatTemplate.for_tokenizer(tok)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    chat = [*SINGLE, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert encode_chat(tok, template, SYSTEM, tools=TOOLS) == _hf_ids(ref, SYSTEM, tools=TOOLS)
    assert encode_chat(tok, template, chat, tools=TOOLS) == _hf_ids(ref, chat, tools=TOOLS)
    # OpenAI sends the arguments as a JSON string: parsed into the object the template writes
    openai_call = {**call, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert encode_chat(tok, template, [*chat[:1], {**chat[1], "tool_calls": [openai_call]}, chat[2]],
                       tools=TOOLS) == _hf_ids(ref, chat, tools=TOOLS)


def test_template_errors_are_user_errors(folders):
    tok, _ = _both(*folders["llama"])
    template = ChatTemplate.for_tokenizer(tok)
    with pytest.raises(UserError, match="System messages must come first"):
        encode_chat(tok, template, [*SINGLE, {"role": "system", "content": "late"}])
    with pytest.raises(UserError, match="not valid Jinja"):
        ChatTemplate(jinja="{% for m in messages %}").render(SINGLE)
    with pytest.raises(UserError, match="chat template failed"):  # unsafe attribute access: sandboxed
        ChatTemplate(jinja="{{ messages.__class__.__mro__ }}").render(SINGLE)
    with pytest.raises(UserError, match="surrogate"):
        encode_chat(tok, template, [{"role": "user", "content": "a\ud800b"}])
    with pytest.raises(UserError, match=r"surrogate \\ud800 at character 1"):
        tok.encode("a\ud800b")


def test_roles_and_content_forms(folders):
    tok, ref = _both(*folders["qwen"])
    template = ChatTemplate.for_tokenizer(tok)
    # developer is rendered as system by a template that does not know the role
    dev = [{"role": "developer", "content": "You are terse."}, *SINGLE]
    assert encode_chat(tok, template, dev) == _hf_ids(ref, SYSTEM)
    # content as text parts; an assistant's content may be null
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello there,"},
                                          {"type": "text", "text": "how are you?"}]}]
    assert encode_chat(tok, template, parts) == _hf_ids(ref, [{"role": "user",
                                                              "content": "Hello there,\nhow are you?"}])
    null = [*SINGLE, {"role": "assistant", "content": None}, {"role": "user", "content": "ok"}]
    assert encode_chat(tok, template, null) == _hf_ids(ref, [*SINGLE, {"role": "assistant", "content": ""},
                                                             {"role": "user", "content": "ok"}])
    for bad in ([{"role": "user", "content": None}], [{"role": "user", "content": [{"type": "image_url"}]}],
                [{"role": "robot", "content": "x"}]):
        with pytest.raises(UserError):
            check_messages(bad)
    with pytest.raises(UserError, match="no tool role"):  # the marker template
        ChatTemplate().render([*SINGLE, {"role": "tool", "content": "x"}])
    assert ChatTemplate().render([{"role": "developer", "content": "be brief"}, *SINGLE]).startswith("be brief <user>")


@pytest.mark.parametrize("form", ["jinja", "key", "list"])
def test_import_reads_template_eos_ids_and_defaults(tmp_path, form):
    path, cfg = _save_tokenizer(str(tmp_path / form), "qwen", template_form=form)
    tok, ref = _both(path, cfg)
    assert tok.chat_template == QWEN_TEMPLATE
    im_end, eot = tok.piece_to_id("<|im_end|>"), tok.piece_to_id("<|endoftext|>")
    assert tok.eos_ids == (im_end, eot) and tok.eos_id == im_end
    assert set(turn_stop_ids(tok)) == {im_end, eot}
    assert tok.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert not tok.add_bos and "bos_token" not in tok.special_tokens_map
    assert tok.special_tokens_map["eos_token"] == "<|im_end|>"
    if form == "list":  # the named tool_use template renders when tools are given, as in transformers
        assert tok.chat_templates["tool_use"] == TOOL_TEMPLATE
        assert encode_chat(tok, ChatTemplate.for_tokenizer(tok), SINGLE, tools=TOOLS) == _hf_ids(ref, SINGLE,
                                                                                                  tools=TOOLS)
        assert "You may call tools." in tok.decode(
            encode_chat(tok, ChatTemplate.for_tokenizer(tok), SINGLE, tools=TOOLS))
    assert encode_chat(tok, ChatTemplate.for_tokenizer(tok), MULTI) == _hf_ids(ref, MULTI)


def test_eos_ids_from_every_file(folders):
    llama, _ = _both(*folders["llama"])  # tokenizer <|eot_id|>; both configs list [<|end_of_text|>, <|eot_id|>]
    assert llama.eos_ids == tuple(llama.piece_to_id(t) for t in ("<|eot_id|>", "<|end_of_text|>"))
    blocks, _ = _both(*folders["blocks"])  # generation_config.json an int, config.json another int
    assert blocks.eos_ids == tuple(blocks.piece_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert llama.generation_defaults == {}  # temperature / top_p without do_sample: transformers ignores them


def test_bos_only_where_the_tokenizer_adds_one(folders):
    for kind in ("qwen", "llama"):
        tok, ref = _both(*folders[kind])
        for text in ("Hello", "Hello the world"):
            assert encode_prompt(tok, text) == ref(text).input_ids, kind
    qwen, _ = _both(*folders["qwen"])
    llama, _ = _both(*folders["llama"])
    assert not qwen.add_bos and len(encode_prompt(qwen, "Hello")) == 1  # one merged token, no <|endoftext|>
    assert llama.add_bos and llama.bos_id == llama.piece_to_id("<|begin_of_text|>")
    assert encode_prompt(qwen, "") == [qwen.bos_id]  # an empty prompt still has one token
    # add_bos_token in tokenizer_config.json is respected
    path, cfg = folders["llama"]
    tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    other = path + "_nobos"
    shutil.copytree(path, other)
    with open(os.path.join(other, "tokenizer_config.json"), "w") as f:
        json.dump({**tcfg, "add_bos_token": False}, f)
    assert not hf.tokenizer_from_hf(other, cfg).add_bos


def test_generation_defaults_follow_do_sample():
    assert hf.generation_defaults_from_hf({"temperature": 0.6, "top_p": 0.9}) == {}
    assert hf.generation_defaults_from_hf({"temperature": 0.6, "repetition_penalty": 1.1}) == {
        "repetition_penalty": 1.1}
    assert hf.generation_defaults_from_hf({"do_sample": True, "temperature": 0.6, "top_k": 0, "min_p": 0.05}) == {
        "temperature": 0.6, "min_p": 0.05}
    for bad in ({"do_sample": True, "temperature": "hot"}, {"do_sample": True, "top_p": 0.0},
                {"repetition_penalty": -1}):
        with pytest.raises(UserError, match="generation_config.json"):
            hf.generation_defaults_from_hf(bad)


def test_decode_skips_special_tokens_and_stops_at_every_eos(folders):
    tok, ref = _both(*folders["qwen"])
    bye, after = tok.encode("Bye"), tok.encode(" AFTER")
    start, end, eot = (tok.piece_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert tok.decode(bye + [eot] + after) == "Bye"  # the second EOS id of generation_config.json
    assert tok.decode(bye + [start] + after) == "Bye AFTER"  # a special token is never shown
    assert tok.decode([start] + tok.encode("é 日本 🙂") + [end] + after) == "é 日本 🙂"
    assert tok.special_ids >= {start, end, eot}
    assert tok.decode(bye + after) == ref.decode(bye + after, skip_special_tokens=True)


def test_tokenizer_round_trips_through_bytes_and_old_bytes_load(folders):
    tok, _ = _both(*folders["qwen"])
    back = tokenizer_from_bytes(tok.to_bytes())
    for attr in ("bos_id", "eos_id", "pad_id", "unk_id", "eos_ids", "add_bos", "special_tokens_map",
                 "chat_template", "chat_templates", "generation_defaults", "special_ids"):
        assert getattr(back, attr) == getattr(tok, attr), attr
    assert back.encode("Hello <|im_start|>") == tok.encode("Hello <|im_start|>")
    # bytes of the first format (before templates were kept): special ids only, eos used as bos
    v1 = json.dumps({"relf_hf_tokenizer": 1, "bos_id": tok.eos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id,
                     "unk_id": -1, "tokenizer_json": tok.backend.to_str()}).encode()
    old = tokenizer_from_bytes(v1)
    assert isinstance(old, HFTokenizer) and not old.add_bos and old.eos_ids == (tok.eos_id,)
    assert old.chat_template is None and old.generation_defaults == {}
    assert old.special_tokens_map["eos_token"] == "<|im_end|>" and "bos_token" not in old.special_tokens_map
    assert old.encode("Hello") == tok.encode("Hello")
    llama, _ = _both(*folders["llama"])
    v1 = json.dumps({"relf_hf_tokenizer": 1, "bos_id": llama.bos_id, "eos_id": llama.eos_id,
                     "pad_id": llama.eos_id, "tokenizer_json": llama.backend.to_str()}).encode()
    assert tokenizer_from_bytes(v1).add_bos
    with pytest.raises(UserError, match="newer relf_jax"):
        tokenizer_from_bytes(json.dumps({"relf_hf_tokenizer": 99, "bos_id": 0, "eos_id": 0, "pad_id": 0,
                                         "tokenizer_json": ""}).encode())


# ----------------------------------------------------------------------------- a whole checkpoint

@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    """A tiny Qwen2 model folder with the ChatML tokenizer, template and generation config."""
    import torch

    path, cfg = _save_tokenizer(str(tmp_path_factory.mktemp("qwen_chat") / "model"), "qwen")
    gen = _read_json(os.path.join(path, "generation_config.json"))
    gen.pop("repetition_penalty")  # T = 0 replies below compare with plain greedy decoding
    vocab = transformers.AutoTokenizer.from_pretrained(path).backend_tokenizer.get_vocab_size(with_added_tokens=True)
    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                      max_position_embeddings=256, **cfg)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # weights far from init, so greedy replies vary and some end at an EOS id
        for name, p in model.named_parameters():
            p.add_(0.5 * torch.randn_like(p)) if "norm" in name else p.mul_(8.0)
    model.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:  # save_pretrained wrote its own
        json.dump(gen, f)
    return path, model


def test_import_hf_checkpoint_keeps_the_chat_tokenizer(tmp_path, qwen_model):
    from relf_jax.loading import load_model

    path, _ = qwen_model
    direct = hf.from_hf(path).tokenizer
    hf.import_hf(path, str(tmp_path / "run"))
    loaded = load_model(str(tmp_path / "run"), "ar").tokenizer
    assert loaded.to_bytes() == direct.to_bytes()
    assert loaded.chat_template == QWEN_TEMPLATE and len(loaded.eos_ids) == 2 and not loaded.add_bos
    assert loaded.generation_defaults["temperature"] == 0.7
    # an HF folder is also a workdir: load_model reads it in place
    assert load_model(path, "ar").tokenizer.to_bytes() == direct.to_bytes()
    with pytest.raises(UserError, match="HuggingFace folder"):
        load_model(path, "bd")


@pytest.mark.entry
def test_cli_serve_model_takes_an_hf_folder(monkeypatch, qwen_model):
    """`relf-jax serve --model <hf folder>`: the folder's template, BOS/EOS and tokens are used; a
    T = 0 reply equals transformers' greedy output from the same prompt ids."""
    import openai
    import torch

    from experiments.launch import main
    from relf_jax.serving import http, loading
    from tests._serving import live_server

    path, model = qwen_model
    built, real_build = {}, loading.build_models
    # the engine compiles on first use instead of for every span up front (the CLI's warm-up)
    monkeypatch.setattr(loading, "build_models", lambda *a, **kw: real_build(*a, **{**kw, "warmup": False}))
    monkeypatch.setattr(http, "serve", lambda models, **kw: built.update(models))
    assert main(["serve", "--model", path, "--slots", "2"]) == 0
    assert list(built) == ["model"]
    ref = transformers.AutoTokenizer.from_pretrained(path)
    eos = [ref.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    with live_server(built) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        replies = []
        for messages in (SINGLE, MULTI_SYSTEM):  # 74 and 128 prompt tokens
            r = client.chat.completions.create(model="model", messages=messages, temperature=0, max_tokens=12)
            ids = _hf_ids(ref, messages)
            assert r.usage.prompt_tokens == len(ids)
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, eos_token_id=eos,
                                     pad_token_id=eos[1])[0, len(ids):].tolist()
            assert r.choices[0].message.content == ref.decode(out, skip_special_tokens=True)
            assert "<|" not in r.choices[0].message.content
            assert r.choices[0].finish_reason == ("stop" if out[-1] in eos else "length")
            assert r.usage.completion_tokens == len(out)
            replies.append((out, r.choices[0].message.content))
        # a reply that reaches the second EOS id (generation_config.json's <|endoftext|>) stops there;
        # special tokens are never shown
        start = ref.convert_tokens_to_ids("<|im_start|>")
        r = client.chat.completions.create(model="model", messages=SINGLE, temperature=0, max_tokens=5,
                                           logit_bias={str(eos[1]): 100})
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("", "stop")
        r = client.chat.completions.create(model="model", messages=SINGLE, temperature=0, max_tokens=5,
                                           logit_bias={str(start): 100})
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("", "length")
        assert r.usage.completion_tokens == 5
    assert any(out[-1] not in eos for out, _ in replies)  # replies that ran to max_tokens, not just EOS
    assert main(["serve", "--model", path, "--workdir", "/elsewhere"]) == 2  # "give the model once"


@pytest.mark.entry
def test_cli_sample_clamps_max_new_tokens_to_the_context(capsys, qwen_model):
    from experiments.launch import main

    path, _ = qwen_model  # a 256-token context; --workdir takes the HF folder too
    rc = main(["sample", "--workdir", path, "--prompt", "Hello the world " * 10, "sample.max_new_tokens=900",
               "sample.num_samples=1", "sample.batch_size=1"])
    err = capsys.readouterr().err
    assert rc == 0, err
    notes = [line for line in err.splitlines() if line.startswith("relf-jax: note:")]
    assert len(notes) == 1 and "max_new_tokens 900 -> " in notes[0] and "256-token context" in notes[0]
    n_prompt = len(encode_prompt(hf.from_hf(path).tokenizer, "Hello the world " * 10))
    assert f"-> {256 - n_prompt}:" in notes[0]


def test_export_hf_writes_the_chat_tokenizer_back(tmp_path, qwen_model):
    """HF -> relf_jax -> HF: the template, EOS ids, BOS rule and defaults come back out."""
    path, _ = qwen_model
    lm = hf.from_hf(path)
    out = hf.export_hf(lm, str(tmp_path / "out"))
    ref = transformers.AutoTokenizer.from_pretrained(out)
    assert _hf_ids(ref, MULTI_SYSTEM) == encode_chat(lm.tokenizer, ChatTemplate.for_tokenizer(lm.tokenizer),
                                                     MULTI_SYSTEM)
    assert ref("Hello").input_ids == encode_prompt(lm.tokenizer, "Hello")
    gen = _read_json(os.path.join(out, "generation_config.json"))
    assert gen["eos_token_id"] == list(lm.tokenizer.eos_ids) and gen["do_sample"] is True
    back, tok = hf.from_hf(out).tokenizer, lm.tokenizer
    assert same_tokenization(back, tok)
    for attr in ("bos_id", "eos_ids", "pad_id", "add_bos", "special_tokens_map", "chat_templates",
                 "generation_defaults", "special_ids"):
        assert getattr(back, attr) == getattr(tok, attr), attr


def test_fit_new_tokens():
    from relf_jax.sampling.recipes import fit_new_tokens

    assert fit_new_tokens(8, 100, 128) == (100, "")
    n, note = fit_new_tokens(8, 128, 128)
    assert n == 120 and note == "max_new_tokens 128 -> 120: the prompt takes 8 of the model's 128-token context"
    assert fit_new_tokens(8, 128, 128, extra=5)[0] == 115  # a speculative round's overshoot
    with pytest.raises(UserError, match="exceeds the model context"):
        fit_new_tokens(128, 10, 128)
