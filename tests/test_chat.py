"""Chat templates and ChatModel (the Python API) over the mock engine."""

import json

import pytest

from relf_jax.errors import UserError
from relf_jax.serving.chat import ChatModel, ChatTemplate
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
