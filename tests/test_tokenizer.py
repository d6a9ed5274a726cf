import pickle

import numpy as np
import pytest
import sentencepiece as spm

from relf_jax.data.tokenizer import Tokenizer, train_tokenizer

WORDS = "hello there how are you today i am fine thanks the weather is nice , . ? !".split()


def _corpus(n=300, seed=0):
    rng = np.random.default_rng(seed)
    texts = []
    for i in range(n):
        user = " ".join(rng.choice(WORDS, size=rng.integers(2, 9)))
        bot = " ".join(rng.choice(WORDS, size=rng.integers(2, 12)))
        texts.append(f"<user> {user} <assistant> {bot} {i}")
    return texts


@pytest.fixture(scope="module")
def corpus():
    return _corpus()


@pytest.fixture(scope="module")
def tok(corpus):
    return train_tokenizer(corpus, 120)


def test_special_ids(tok):
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size <= 120


def test_round_trip_on_corpus_and_new_sentences(tok, corpus):
    for text in corpus[:100]:
        assert tok.decode(tok.encode(text)) == text
    new = "<user> how is the weather today ? <assistant> it is nice , thanks ! 42"
    assert tok.decode(tok.encode(new)) == new
    assert tok.unk_id not in tok.encode(new)


def test_chat_markers_are_single_tokens(tok):
    for marker in ("<user>", "<assistant>"):
        marker_id = tok.piece_to_id(marker)
        assert marker_id != tok.unk_id and tok.id_to_piece(marker_id) == marker
        # Only a bare word-boundary piece may accompany the marker, never a split of it.
        ids = [i for i in tok.encode(marker) if tok.id_to_piece(i) != "\u2581"]
        assert ids == [marker_id]
    ids = tok.encode("<user> hello <assistant> fine")
    assert ids.count(tok.piece_to_id("<user>")) == 1
    assert ids.count(tok.piece_to_id("<assistant>")) == 1


def test_decode_stops_at_eos_and_drops_pad_bos(tok):
    text = "<user> hello there <assistant> i am fine"
    ids = tok.encode(text)
    seq = [tok.bos_id, *ids, tok.eos_id, *tok.encode("the weather"), tok.pad_id]
    assert tok.decode(seq) == text
    assert tok.decode(np.asarray([tok.pad_id, tok.bos_id, *ids, tok.pad_id], np.int32)) == text
    assert tok.encode_batch([text, "hello"]) == [ids, tok.encode("hello")]


def test_pickle_round_trip(tok, corpus):
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.vocab_size == tok.vocab_size
    assert clone.encode(corpus[0]) == tok.encode(corpus[0])
    assert clone.to_bytes() == tok.to_bytes()


def test_save_load(tok, corpus, tmp_path):
    path = tmp_path / "tok.model"
    tok.save(path)
    loaded = Tokenizer.load(path)
    assert loaded.encode(corpus[1]) == tok.encode(corpus[1])
    # The file is a plain SentencePiece model.
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert sp.encode(corpus[1]) == tok.encode(corpus[1])


def test_small_corpus_gets_smaller_vocab_not_a_crash():
    tok = train_tokenizer(["hello world", "hello there world"], 500)
    assert tok.vocab_size < 500
    assert tok.decode(tok.encode("hello there world")) == "hello there world"


def test_unigram_model_type(corpus):
    tok = train_tokenizer(corpus, 100, model_type="unigram")
    assert tok.decode(tok.encode(corpus[5])) == corpus[5]


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="no non-empty text"):
        train_tokenizer(["", "   "], 100)
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(["abcdefghijklmnopqrstuvwxyz 0123456789"], 16)


def test_decode_keeps_chat_markers_as_words():
    from relf_jax.data.tokenizer import train_tokenizer

    tok = train_tokenizer(["<user> hi there <assistant> hello you"] * 20, 64)
    ids = [tok.piece_to_id("<assistant>")] * 2 + tok.encode("hi") + [tok.piece_to_id("<user>")]
    assert tok.decode(ids).split() == ["<assistant>", "<assistant>", "hi", "<user>"]


def test_turn_stop_ids_with_and_without_pad():
    from relf_jax.data.tokenizer import turn_stop_ids
    from relf_jax.serving.engines import ByteTokenizer

    tok = ByteTokenizer()  # pad 0, eos 1, <user> 4
    assert turn_stop_ids(tok) == (1, 4)
    assert turn_stop_ids(tok, pad=True) == (1, 4, 0)  # block diffusion: pad ends the reply too


def test_lone_surrogates_are_user_errors(tok):
    from relf_jax.errors import UserError

    with pytest.raises(UserError, match=r"lone surrogate \\udc00 at character 2"):
        tok.encode("ab\udc00")
    with pytest.raises(UserError, match="surrogate"):
        tok.encode_batch(["fine", "a\ud800b"])
    assert tok.encode("a\U0001f642b")  # a proper pair (one astral character) is fine


def test_hf_tokenizer_stops_at_every_eos_and_hides_special_tokens():
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from relf_jax.data.tokenizer import HFTokenizer, encode_prompt, turn_stop_ids

    vocab = {w: i for i, w in enumerate(["<unk>", "hello", "there", "you"])}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<|end|>", "<|eot|>", "<|start|>"])
    end, eot, start = (backend.token_to_id(t) for t in ("<|end|>", "<|eot|>", "<|start|>"))
    tok = HFTokenizer(backend.to_str(), bos_id=end, eos_id=eot, eos_ids=(eot, end), pad_id=end, add_bos=False)
    assert tok.eos_ids == (eot, end) and set(turn_stop_ids(tok)) == {eot, end}
    assert tok.encode("hello <|start|> you") == [1, start, 3]  # special tokens in text: their single ids
    assert tok.decode([1, start, 2, end, 3]) == "hello there"
    assert encode_prompt(tok, "hello") == [1] and encode_prompt(tok, "") == [end]
    with pytest.raises(Exception, match="surrogate"):
        tok.encode("a\ud800b")
