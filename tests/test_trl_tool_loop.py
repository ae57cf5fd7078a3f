"""The host TRL's tool-calling loop runs on in the rollout workers (`rollout/tool_calling/trl_loop.py`).

The workers run TRL's private `GRPOTrainer._tool_call_loop` and `_get_tool_suffix_ids` on a `ToolLoopHost`. What they
read from `self` is read here from TRL's own source: every `self.<name>` must be an attribute of the host, so that a
TRL release that reads a new one fails here, naming it, rather than inside a spawned worker after the model loaded.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap

import pytest
from trl import GRPOTrainer

from hf_rlloss.trainer.async_.rollout.tool_calling import ModelContext, ToolLoopHost, ToolLoopResult

TRL_METHODS = ("_tool_call_loop", "_get_tool_suffix_ids")


def self_attributes(function) -> set[str]:
    """The names `function` reads or writes as `self.<name>`, from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    }


def missing_attributes(host) -> list[str]:
    """The attributes TRL's tool-loop methods use that `host` lacks, sorted."""
    used = set().union(*(self_attributes(getattr(GRPOTrainer, name)) for name in TRL_METHODS))
    return sorted(name for name in used if not hasattr(host, name))


def make_host() -> ToolLoopHost:
    return ToolLoopHost(
        processing_class=object(),
        chat_template=None,
        chat_template_kwargs={},
        max_completion_length=16,
        max_tool_calling_iterations=math.inf,
        model=ModelContext(max_position_embeddings=64),
        tools=[],
        environment_factories=None,
        _env_tools={},
    )


def test_the_source_reader_finds_what_trl_reads():
    used = self_attributes(GRPOTrainer._tool_call_loop)
    # a few TRL 1.16 reads, so that an empty reading cannot pass the test below
    assert {"max_tool_calling_iterations", "_generate_single_turn", "_get_tool_suffix_ids", "model"} <= used
    assert {"chat_template", "processing_class"} <= self_attributes(GRPOTrainer._get_tool_suffix_ids)


def test_the_host_has_every_attribute_trls_tool_loop_uses():
    missing = missing_attributes(make_host())
    assert not missing, f"ToolLoopHost lacks what TRL's tool loop uses: {missing}"


class _Without:
    """A host with one attribute hidden (as if the host did not declare it)."""

    def __init__(self, host, hidden: str):
        self.host, self.hidden = host, hidden

    def __getattr__(self, name):
        if name == self.hidden:
            raise AttributeError(name)
        return getattr(self.host, name)


@pytest.mark.parametrize("hidden", ["vllm_mode", "_env_tools", "_tokenizer", "_get_tool_suffix_ids"])
def test_a_host_lacking_an_attribute_is_named(hidden):
    assert missing_attributes(_Without(make_host(), hidden)) == [hidden]


def test_the_model_context_reads_as_a_config():
    assert make_host().model.config.max_position_embeddings == 64


def test_the_loop_result_is_read_by_name_in_trls_order():
    """TRL's `return` statement names the seven values in `ToolLoopResult`'s order."""
    function = ast.parse(textwrap.dedent(inspect.getsource(GRPOTrainer._tool_call_loop))).body[0]
    returned = function.body[-1]
    assert isinstance(returned, ast.Return) and isinstance(returned.value, ast.Tuple)
    assert [ast.unparse(element) for element in returned.value.elts] == list(ToolLoopResult._fields)
