"""The model card works on the Hub (issue 25): valid front matter (the base model's license, no `licence: license`),
a quick start that names the Hub repository when pushed and the output folder relative to the working directory
otherwise, asks one of the training task's prompts, and runs against the saved folder."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch
from _trainer_utils import BASE_ARGS, make_model, make_tokenizer, reward_length
from datasets import Dataset
from huggingface_hub import ModelCard, ModelCardData

from hf_rlloss.recipe_support.tasks import arithmetic_dataset
from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer
from hf_rlloss.trainer.common.model_card import base_model_license, dataset_example_prompt, quick_start_folder

BASE_CARD = "---\nlicense: mit\nlanguage: en\n---\n\n# A base model\n"


@pytest.fixture
def base_folder(tmp_path):
    """A tiny model saved with a card whose license is MIT (as a model downloaded from the Hub would be)."""
    folder = tmp_path / "base"
    tok = make_tokenizer()
    make_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "README.md").write_text(BASE_CARD)
    return folder


def _trainer(folder, output_dir, **args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)  # config._name_or_path: the base folder
    options = {**BASE_ARGS, "max_completion_length": 16, **args}
    return RLLossGRPOTrainer(
        model,
        reward_length,
        args=RLLossGRPOConfig(output_dir=str(output_dir), **options),
        train_dataset=arithmetic_dataset(8, seed=3),
        processing_class=AutoTokenizer.from_pretrained(folder),
    )


def _front_matter_is_valid(card: ModelCard) -> dict:
    """Parses strictly, and every key is a field the Hub's `ModelCardData` knows (no `licence`)."""
    card = ModelCard(str(card), ignore_metadata_errors=False)
    metadata = card.data.to_dict()
    known = set(vars(ModelCardData()))  # the fields of the Hub's model card metadata
    assert set(metadata) <= known, set(metadata) - known
    return metadata


def _quick_start(card: ModelCard) -> str:
    return card.text.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_card_of_a_local_run(base_folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = _trainer(base_folder, tmp_path / "runs" / "demo")
    trainer.save_model()
    trainer.create_model_card(dataset_name="builtin:arithmetic")
    card = ModelCard.load(tmp_path / "runs" / "demo" / "README.md")
    metadata = _front_matter_is_valid(card)
    assert metadata["license"] == "mit" and "licence" not in metadata  # the base model's, read from its card
    assert card.data.datasets == "builtin:arithmetic"
    snippet = _quick_start(card)
    assert 'model="./runs/demo"' in snippet  # relative to the working directory, readable as a folder
    question = re.search(r"^question = (.*)$", snippet, re.M).group(1)
    assert eval(question) == trainer.train_dataset[0]["prompt"][-1]["content"]  # the task's, not TRL's
    assert "time machine" not in card.text
    # the snippet runs as written against the saved folder (a shorter generation keeps it quick)
    torch.manual_seed(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(snippet.replace("max_new_tokens=128", "max_new_tokens=8"), {})
    assert out.getvalue().endswith("\n")  # it printed the generated text


def test_card_after_push_names_the_repository(base_folder, tmp_path, monkeypatch):
    import huggingface_hub.hf_api
    import transformers.trainer
    from test_hub_and_trackers import OfflineHubApi

    api = OfflineHubApi()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: api)
    monkeypatch.setattr(huggingface_hub.hf_api, "is_xet_available", lambda: False)
    trainer = _trainer(base_folder, tmp_path / "out", hub_model_id="someone/arith-grpo")
    trainer.push_to_hub(dataset_name="builtin:arithmetic")
    card = api.card  # the card as uploaded (validated with the Hub's YAML check, here: parsed strictly)
    metadata = _front_matter_is_valid(card)
    assert metadata["license"] == "mit" and "licence" not in metadata
    snippet = _quick_start(card)
    assert 'model="someone/arith-grpo"' in snippet and "What is" in snippet


def test_license_is_omitted_when_unknown(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tok = make_tokenizer()
    args = RLLossGRPOConfig(output_dir=str(tmp_path / "out"), **BASE_ARGS)
    trainer = RLLossGRPOTrainer(
        make_model(tok), reward_length, args=args, train_dataset=Dataset.from_dict({"prompt": ["2 + 2 ="] * 4}),
        processing_class=tok,
    )  # fmt: skip
    trainer.save_model()
    trainer.create_model_card()
    card = ModelCard.load(tmp_path / "out" / "README.md")
    metadata = _front_matter_is_valid(card)
    assert "license" not in metadata and "licence" not in metadata
    assert 'question = "2 + 2 ="' in card.text and 'model="./out"' in card.text


def test_helpers(tmp_path):
    assert base_model_license(None) is None and base_model_license(str(tmp_path)) is None
    (tmp_path / "README.md").write_text(BASE_CARD)
    assert base_model_license(str(tmp_path)) == "mit"
    assert base_model_license("nobody/not-in-the-cache") is None  # never downloads
    assert quick_start_folder(str(tmp_path)).startswith(".")
    chat = Dataset.from_dict(
        {"prompt": [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]]}
    )
    assert dataset_example_prompt(chat) == "Hi?"
    assert dataset_example_prompt(Dataset.from_dict({"text": ["x"]})) is None and dataset_example_prompt(None) is None
