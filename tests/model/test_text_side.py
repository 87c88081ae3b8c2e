"""Tokenizer loading and vocabulary checks; the chat template's rendering and its sandbox."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from mtpserve.chat_template import ChatTemplate, ChatTemplateError
from mtpserve.tokenizer import Tokenizer, TokenizerMismatchError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def model_dir(tmp_path):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML}))
    return tmp_path


def test_tokenizer_round_trips_text_and_finds_eos(model_dir):
    tok = Tokenizer.from_model_dir(model_dir)
    text = "def g(y):\n    return y * 2\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id == 0


def test_tokenizer_larger_than_model_vocab_is_refused(model_dir):
    tok = Tokenizer.from_model_dir(model_dir)
    tok.check_vocab(tok.vocab_size)
    tok.check_vocab(tok.vocab_size + 64)  # padded embedding tables are fine
    with pytest.raises(TokenizerMismatchError, match=str(tok.vocab_size)):
        tok.check_vocab(tok.vocab_size - 1)


def test_chat_template_renders_from_tokenizer_config(model_dir):
    template = ChatTemplate.from_model_dir(model_dir)
    assert template is not None
    text = template.render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_sandbox_blocks_internals():
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_mutating_the_messages():
    template = ChatTemplate("{{ messages.append({'role': 'system'}) }}")
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError):
        template.render(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_raise_exception_becomes_a_client_error():
    template = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('bad role') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="bad role"):
        template.render([{"role": "system", "content": "x"}])


def test_malformed_template_is_reported():
    with pytest.raises(ChatTemplateError, match="parse"):
        ChatTemplate("{% for m in messages %}")
