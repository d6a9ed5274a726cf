"""The OpenAI sampling surface through the official `openai` client against a live server over a
tiny HuggingFace Qwen2 folder: log-probabilities equal transformers' (its logits, its logits
processors, OpenAI's penalty formula) within 1e-4; n, seed, stop, stop_token_ids, logit_bias,
top_k / min_p / repetition_penalty, max_tokens omitted; unimplemented fields refused by name."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from tests._serving import live_server
from tests.test_hf_interop import SPECIALS

V = 61


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A random tiny Qwen2 checkpoint with a word-level tokenizer, saved as an HF folder."""
    from tests.test_hf_interop import word_tokenizer

    tokenizer = word_tokenizer(V)
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                   max_position_embeddings=64, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the init's, so the processors' effects show
        model.lm_head.weight.mul_(8.0)
    path = str(tmp_path_factory.mktemp("hf") / "qwen2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


@pytest.fixture(scope="module")
def served(hf_folder):
    from relf_jax.methods import Autoregressive, PromptLookup, Speculative
    from relf_jax.serving.loading import build_models

    path = hf_folder[0]
    models = build_models(path, [Autoregressive(), Speculative(rule="standard", k=2, proposer=PromptLookup())],
                          model_name="qwen", slots=4, warmup=False)
    with live_server(models) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0), models["qwen"]


def _hf_log_probs(model, ids, reply, *, temperature, top_k=None, repetition=None, frequency=0.0, presence=0.0,
                  bias=None):
    """Per reply position: transformers' processed log-probs [V] (its processors, in its order;
    OpenAI's frequency / presence penalties by hand after the repetition penalty)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + reply])).logits[0].float()
    out = []
    for j in range(len(reply)):
        seq = torch.tensor([ids + reply[:j]])
        x = logits[len(ids) - 1 + j][None].clone()
        if bias:
            x = transformers.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(seq, x)
        if repetition is not None:
            x = transformers.RepetitionPenaltyLogitsProcessor(repetition)(seq, x)
        counts = torch.bincount(torch.tensor(reply[:j], dtype=torch.long), minlength=V).float()
        x = x - counts * frequency - (counts > 0).float() * presence
        if temperature > 0:
            x = transformers.TemperatureLogitsWarper(temperature)(seq, x)
        if top_k:
            x = transformers.TopKLogitsWarper(top_k)(seq, x)
        out.append(torch.log_softmax(x.double(), -1)[0].numpy())
    return out


def _ids(tokenizer, names):
    return tokenizer.convert_tokens_to_ids(list(names))


def test_completion_logprobs_equal_transformers_processed_log_softmax(served, hf_folder):
    client, _ = served
    _, model, tokenizer = hf_folder
    kw = {"temperature": 0.8, "top_k": 12, "repetition": 1.3, "frequency": 0.5, "presence": 0.25,
          "bias": {7: 2.0, 8: -1.5}}
    r = client.completions.create(model="qwen", prompt="hello there how are you", max_tokens=6, seed=4, logprobs=5,
                                  temperature=kw["temperature"],
                                  frequency_penalty=kw["frequency"], presence_penalty=kw["presence"],
                                  logit_bias={str(t): b for t, b in kw["bias"].items()},
                                  extra_body={"top_k": kw["top_k"], "repetition_penalty": kw["repetition"]})
    lp = r.choices[0].logprobs
    reply = _ids(tokenizer, lp.tokens)
    assert len(reply) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    prompt = tokenizer("hello there how are you").input_ids
    want = _hf_log_probs(model, prompt, reply, temperature=kw["temperature"], top_k=kw["top_k"],
                         repetition=kw["repetition"], frequency=kw["frequency"], presence=kw["presence"],
                         bias=kw["bias"])
    for j, (tok, w) in enumerate(zip(reply, want)):
        assert lp.token_logprobs[j] == pytest.approx(w[tok], abs=1e-4)
        top = lp.top_logprobs[j]
        best = np.argsort(-w)[:5]
        for t in best:
            assert top[tokenizer.convert_ids_to_tokens(int(t))] == pytest.approx(w[t], abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_streamed_and_whole_and_greedy_speculative_agree(served, hf_folder):
    """Chat logprobs at T = 0 (the softmax whose argmax is taken, after the penalties), in a
    stream and in one reply, from the AR and the speculative engine: the same tokens and the
    same log-probs as transformers'."""
    client, _ = served
    _, model, tokenizer = hf_folder
    msgs = [{"role": "user", "content": "how is the weather today"}]
    extra = {"repetition_penalty": 1.5}
    whole = {}
    for gen in ("ar", "standard"):
        r = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=7, temperature=0, logprobs=True,
                                           top_logprobs=3, presence_penalty=0.5, extra_body={**extra, "generator": gen})
        whole[gen] = r.choices[0]
    a, s = whole["ar"], whole["standard"]
    assert [c.token for c in a.logprobs.content] == [c.token for c in s.logprobs.content]
    np.testing.assert_allclose([c.logprob for c in a.logprobs.content], [c.logprob for c in s.logprobs.content],
                               atol=1e-4)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6
               for c in a.logprobs.content)
    assert all(c.bytes == list(c.token.encode()) for c in a.logprobs.content)
    chunks = list(client.chat.completions.create(model="qwen", messages=msgs, max_tokens=7, temperature=0,
                                                 logprobs=True, top_logprobs=3, presence_penalty=0.5, stream=True,
                                                 extra_body=extra))
    streamed = [c for ch in chunks for c in ((ch.choices[0].logprobs.content or []) if ch.choices[0].logprobs else [])]
    assert [c.token for c in streamed] == [c.token for c in a.logprobs.content]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == a.message.content
    # the prompt ids the server built, from the usage's count and the tokenizer's chat rendering
    prompt_len = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=1).usage.prompt_tokens
    reply = _ids(tokenizer, [c.token for c in a.logprobs.content])
    from relf_jax.serving.chat_template import ChatTemplate, encode_chat

    engine = served[1][0].engine
    prompt = encode_chat(engine.tokenizer, ChatTemplate.for_tokenizer(engine.tokenizer), msgs)
    assert len(prompt) == prompt_len
    want = _hf_log_probs(model, prompt, reply, temperature=0, repetition=1.5, presence=0.5)
    for c, tok, w in zip(a.logprobs.content, reply, want):
        assert tok == int(np.argmax(w)) and c.logprob == pytest.approx(w[tok], abs=1e-4)


def test_n_seed_stop_stop_token_ids_bias_and_extra_knobs(served, hf_folder):
    client, _ = served
    tokenizer = hf_folder[2]
    msgs = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, n=3, seed=11)
    again = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, n=3, seed=11)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # independent choices
    single = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, seed=11)
    assert single.choices[0].message.content == texts[0]
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    assert r.usage.completion_tokens == 24 if all(c.finish_reason == "length" for c in r.choices) else \
        3 <= r.usage.completion_tokens < 24
    # streamed choices carry their index
    chunks = list(client.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, n=3, seed=11,
                                                 stream=True))
    for i in range(3):
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i) \
            == texts[i]

    words_only = {str(i): -100 for i in range(len(SPECIALS))}  # no EOS, pad, BOS or unk: every token a word
    greedy = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, temperature=0,
                                            logit_bias=words_only)
    words = greedy.choices[0].message.content.split()
    assert len(words) >= 4
    cut = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, temperature=0, stop=[words[2]],
                                         logit_bias=words_only)
    assert cut.choices[0].finish_reason == "stop" and words[2] not in cut.choices[0].message.content.split()
    by_id = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, temperature=0,
                                           logit_bias=words_only,
                                           extra_body={"stop_token_ids": _ids(tokenizer, [words[2]])})
    assert by_id.choices[0].finish_reason == "stop" and by_id.choices[0].message.content.split() == \
        words[:words.index(words[2])]

    forced = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=5, seed=1,
                                            logit_bias={str(_ids(tokenizer, ["nice"])[0]): 100})
    assert forced.choices[0].message.content.split() == ["nice"] * 5
    banned = _ids(tokenizer, [words[0]])[0]
    avoid = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=8, temperature=0,
                                           logit_bias={**words_only, str(banned): -100})
    assert words[0] not in avoid.choices[0].message.content.split()

    r1 = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=6, seed=5, logprobs=True,
                                        top_logprobs=5, extra_body={"top_k": 2, "min_p": 0.2})
    for c in r1.choices[0].logprobs.content:  # top-k 2: at most two tokens keep probability
        assert sum(t.logprob > -9999 for t in c.top_logprobs) <= 2
    rep = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=12, temperature=0,
                                         logit_bias=words_only, extra_body={"repetition_penalty": 5.0})
    plain = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=12, temperature=0,
                                           logit_bias=words_only)
    rep_words = rep.choices[0].message.content.split()
    assert len(set(rep_words)) >= len(set(plain.choices[0].message.content.split()))
    assert rep_words != plain.choices[0].message.content.split()


def test_max_tokens_omitted_runs_to_the_context_and_unimplemented_fields_are_refused(served):
    client, models = served
    engine = models[0].engine
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="qwen", messages=msgs, temperature=0, logit_bias={"1": -100})
    assert r.choices[0].finish_reason == "length"  # EOS banned: the reply fills the context
    assert r.usage.prompt_tokens + r.usage.completion_tokens == engine.max_context - engine.reserve()
    for field, value in (("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
                         ("response_format", {"type": "json_object"})):
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(model="qwen", messages=msgs, max_tokens=2, **{field: value})
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="qwen", prompt="hello", max_tokens=2, echo=True)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="qwen", prompt="hello", max_tokens=2, best_of=3)
    after = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=2)  # the server keeps serving
    assert after.choices[0].finish_reason in ("stop", "length") and after.usage.completion_tokens >= 1


def test_developer_and_tool_roles_and_content_parts_reach_the_template(served):
    client, _ = served
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    r = client.chat.completions.create(model="qwen", messages=msgs, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens > 2
    with pytest.raises(openai.BadRequestError):  # the marker template has no tool role: refused, not dropped
        client.chat.completions.create(model="qwen", max_tokens=2, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
            {"role": "tool", "content": "42", "tool_call_id": "x"}])
