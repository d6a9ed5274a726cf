"""Chat templates and ChatModel (the Python API) over the mock engine."""

import json

import pytest

from relf_jax.errors import UserError
from relf_jax.serving.chat import ChatModel
from relf_jax.serving.chat_template import ChatTemplate
from relf_jax.serving.engines import MockEngine


def test_default_template_is_the_corpus_turn_format():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi  there"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": [{"type": "text", "text": "and?"}]}]
    assert ChatTemplate().render(msgs) == "be brief <user> hi there <assistant> hello <user> and? <assistant>"
    assert ChatTemplate().render(msgs[:3]) == "be brief <user> hi there <assistant> hello"  # continue the reply
    for bad in ([], [{"role": "user"}], [{"role": "bot", "content": "x"}], [{"role": "system", "content": "x"}],
                [{"role": "user", "content": 3}]):
        with pytest.raises(UserError):
            ChatTemplate().render(bad)


def test_templates_from_files(tmp_path):
    j = tmp_path / "t.json"
    j.write_text(json.dumps({"user": "Q:", "assistant": "A:"}))
    assert ChatTemplate.from_file(str(j)).render([{"role": "user", "content": "x"}]) == "Q: x A:"
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
                     "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert ChatTemplate.from_file(str(jinja)).render([{"role": "user", "content": "x"}]) == "[user] x [assistant]"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"usr": "Q:"}))
    with pytest.raises(UserError, match="keys"):
        ChatTemplate.from_file(str(bad))
    with pytest.raises(UserError, match="not a file"):
        ChatTemplate.from_file(str(tmp_path / "missing.json"))


def test_chat_model_chats_and_streams():
    with ChatModel(MockEngine(2, step_s=0.001)) as bot:
        msgs = [{"role": "user", "content": "good morning"}]
        assert bot.chat(msgs) == "good morning"
        assert list(bot.chat(msgs, stream=True, max_tokens=4)) == list("good")
        assert bot.chat(msgs, stop=["mor"]) == "good "
        assert bot.last_usage["completion_tokens"] >= 5
        stream = bot.chat([{"role": "user", "content": "x" * 100}], stream=True)
        next(stream)
        stream.close()  # abandoning a stream frees its slot
        assert bot.chat(msgs) == "good morning"


def test_jinja_templates_render_as_transformers_does(tmp_path):
    """Sandboxed, trim_blocks + lstrip_blocks, special tokens and tools in scope, plain-JSON tojson,
    loop controls, strftime_now, raise_exception as a UserError."""
    msgs = [{"role": "developer", "content": "be <brief>"}, {"role": "user", "content": "hi"}]
    t = ChatTemplate(jinja="{{ bos_token }}\n{% for m in messages %}\n  {% if m.role == 'user' %}\n"
                           "{{ m.role }}: {{ m.content | tojson }}\n    {% continue %}\n  {% endif %}\n"
                           "[{{ m.role }}] {{ m.content }}\n{% endfor %}\n{% if tools is none %}no tools{% endif %}"
                           "{% if strftime_now('%Y') | int > 2000 %}.{% endif %}")
    assert t.render(msgs, special_tokens={"bos_token": "<s>"}) == '<s>\n[system] be <brief>\nuser: "hi"\nno tools.'
    dev = ChatTemplate(jinja="{% for m in messages %}{{ m.role }} {% endfor %}{# developer #}")
    assert dev.render(msgs) == "developer user "  # the template knows the role: passed as is
    refuse = ChatTemplate(jinja="{{ raise_exception('only one message, please') }}")
    with pytest.raises(UserError, match="refused the messages: only one message"):
        refuse.render(msgs)
    with pytest.raises(UserError, match="chat template failed"):
        ChatTemplate(jinja="{% set ns = namespace(_x=1) %}").render(msgs)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if %}")
    with pytest.raises(UserError, match="not valid Jinja"):
        ChatTemplate.from_file(str(bad))


def test_chat_model_uses_the_tokenizers_template_and_defaults():
    from relf_jax.serving.chat_template import encode_chat
    from relf_jax.serving.engines import ByteTokenizer

    class ChatBytes(ByteTokenizer):  # a template, special tokens and defaults of its own
        chat_template = "{{ bos_token }}{% for m in messages %}<user>{{ m.content }}{% endfor %}<assistant>"
        special_tokens_map = {"bos_token": "<user>"}  # noqa: RUF012
        generation_defaults = {"temperature": 0.0}  # noqa: RUF012

    engine = MockEngine(2, step_s=0.001)
    engine.tokenizer = ChatBytes()
    msgs = [{"role": "user", "content": "hey"}]
    with ChatModel(engine) as bot:
        assert bot.template.jinja == ChatBytes.chat_template
        ids = bot.prompt_ids(msgs)
        # the template wrote the bos token's text first: no BOS id is added before it
        assert ids == encode_chat(engine.tokenizer, bot.template, msgs) and ids[0] == 4 and 2 not in ids
        assert bot.chat(msgs) == "hey"
