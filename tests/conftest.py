"""Fixtures shared by the async trainer's test modules (a module that defines its own `tok` or `policy` keeps it)."""

import pytest
from _async import save_tiny_policy
from _tools import tool_model, tool_tokenizer
from _trainer_utils import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    """The tiny tokenizer of `_trainer_utils`, built once per test module."""
    return make_tokenizer()


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny random policy saved to disk (the async workers load it by path), once per test module."""
    return save_tiny_policy(tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="module")
def tool_tok():
    """The tool-calling tokenizer of `_tools` (ChatML with a tool template), once per test module."""
    return tool_tokenizer()


@pytest.fixture(scope="module")
def tool_policy(tmp_path_factory, tool_tok):
    """A tiny tool-calling policy saved to disk with its tokenizer, once per test module."""
    path = tmp_path_factory.mktemp("tool_policy")
    tool_model(tool_tok).save_pretrained(path)
    tool_tok.save_pretrained(path)
    return str(path)
