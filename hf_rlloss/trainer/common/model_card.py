"""A Hub-ready output folder: TRL's model card completed with what it leaves out.

TRL's card (`GRPOTrainer.create_model_card`) has the tags, the dataset and the library, but its base model is `None`
whenever the policy was loaded from a local folder (as the recipes do for built-in models), its quick start names a
`None` repository before a push and asks TRL's generic question, its front matter carries `licence: license` (a
misspelled key with a placeholder value), it links built-in datasets to Hub pages that do not exist, and the loss
configuration is only in the pickled `training_args.bin`.
`complete_model_card` fixes these on the parsed card (`huggingface_hub.ModelCard`), so the result still parses.
"""

from __future__ import annotations

import json
import os
import re

import yaml
from huggingface_hub import ModelCard, try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

LOSS_SECTION_TITLE = "## Loss configuration (hf_rlloss)"


def is_hub_repo_id(name: str | None) -> bool:
    """Whether `name` can be a Hub repository id (`name` or `owner/name`): not a local folder, not a `builtin:` name.

    Only such a model name goes into the card's `base_model` metadata (the Hub rejects other values there), and only
    such names are linked to the Hub in the card's text.
    """
    if not name or os.path.isdir(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def loss_config_section(rl_loss: dict) -> str:
    """The card section recording the `rl_loss` mapping as YAML (it rebuilds the config: `GRPOLossConfig(**...)`)."""
    body = yaml.safe_dump(rl_loss, sort_keys=False, default_flow_style=False).rstrip()
    return (
        f"{LOSS_SECTION_TITLE}\n\n"
        "The model was trained with `hf_rlloss.RLLossGRPOTrainer`; its loss was configured by this `rl_loss` "
        "mapping (`GRPOLossConfig(**yaml.safe_load(...))` rebuilds it):\n\n"
        f"```yaml\n{body}\n```\n"
    )


def quick_start_folder(output_dir: str) -> str:
    """The output folder as the quick start names it before any push: relative to the working directory, with a
    leading ``./`` so that `pipeline` reads it as a folder, not as a Hub id (``out/demo`` would be one)."""
    relative = os.path.relpath(output_dir)
    return relative if relative.startswith(".") else f"./{relative}"


def base_model_license(name_or_path: str | None) -> str | None:
    """The `license` in the card of the model trained from, when it can be read offline: the `README.md` of its
    local folder, or of the Hub's locally cached copy (never downloaded). `None` when unknown."""
    if not name_or_path:
        return None
    path = os.path.join(name_or_path, "README.md") if os.path.isdir(name_or_path) else None
    if path is None and is_hub_repo_id(name_or_path):
        cached = try_to_load_from_cache(name_or_path, "README.md")
        path = cached if isinstance(cached, str) else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        license = ModelCard.load(path).data.license
    except (ValueError, yaml.YAMLError):  # a malformed card upstream: the license is unknown, not a failed run
        return None
    return license if isinstance(license, str) and license else None


def dataset_example_prompt(dataset) -> str | None:
    """The first training prompt as a question for the quick start: a plain prompt, or the last user message of a
    conversational one. `None` when the dataset has no usable `prompt` (or is a dict of datasets)."""
    if dataset is None or not hasattr(dataset, "column_names") or "prompt" not in (dataset.column_names or []):
        return None
    row = dataset[0] if hasattr(dataset, "__getitem__") else next(iter(dataset))
    prompt = row["prompt"]
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[-1].get("content") if users else None
        if isinstance(prompt, list):  # content parts: their text
            prompt = " ".join(part.get("text", "") for part in prompt if isinstance(part, dict)).strip()
    return prompt if isinstance(prompt, str) and prompt else None


def complete_model_card(
    card: ModelCard,
    rl_loss: dict,
    base_model: str | None = None,
    local_path: str | None = None,
    example_prompt: str | None = None,
    license: str | None = None,
) -> ModelCard:
    """TRL's model card with the base model, a loadable quick start, valid front matter and the loss configuration.

    Args:
        card (`huggingface_hub.ModelCard`):
            The card TRL wrote (`ModelCard.load(output_dir / "README.md")`); modified in place and returned.
        rl_loss (`dict`):
            The loss configuration, `RLLossGRPOConfig.rl_loss_config.to_dict()`.
        base_model (`str`, *optional*):
            The model trained from. A Hub id becomes the `base_model` metadata (the Hub links the card to it); any
            other name (a `builtin:` model, a local folder) is only named in the text. Without it, TRL's choice stays.
        local_path (`str`, *optional*):
            The output folder, named in the quick start when the card has no Hub repository yet (see
            `quick_start_folder`).
        example_prompt (`str`, *optional*):
            The quick start's question, one of the training task's (see `dataset_example_prompt`); TRL's generic one
            otherwise.
        license (`str`, *optional*):
            The base model's license (see `base_model_license`): the card's `license`. Omitted when unknown.
    """
    card.data.__dict__.pop("licence", None)  # TRL's `licence="license"`: not a Hub field, and not a license
    if license:
        card.data.license = license
    if is_hub_repo_id(base_model):
        card.data.base_model = base_model
    origin = card.data.base_model or base_model
    # TRL's template renders a missing base model / repository as the string "None".
    none_link = "[None](https://huggingface.co/None)"
    if origin and not is_hub_repo_id(origin):
        card.text = card.text.replace(none_link, f"`{origin}`")
    elif origin:
        card.text = card.text.replace(none_link, f"[{origin}](https://huggingface.co/{origin})")
    else:
        card.text = card.text.replace(f"a fine-tuned version of {none_link}", "a fine-tuned model")
    datasets = card.data.datasets or []
    for name in [datasets] if isinstance(datasets, str) else datasets:
        if not is_hub_repo_id(name):  # e.g. builtin:arithmetic, generated offline: named, not linked
            card.text = card.text.replace(f"[{name}](https://huggingface.co/datasets/{name})", f"`{name}`")
    if local_path is not None:
        card.text = card.text.replace('model="None"', f'model="{local_path}"')
    if example_prompt:
        literal = json.dumps(example_prompt, ensure_ascii=False)  # a valid Python string literal
        card.text = re.sub(r'^question = ".*"$', lambda _: f"question = {literal}", card.text, count=1, flags=re.M)
    if LOSS_SECTION_TITLE not in card.text:
        section = loss_config_section(rl_loss)
        anchor = "### Framework versions"
        if anchor in card.text:
            card.text = card.text.replace(anchor, f"{section}\n{anchor}", 1)
        else:
            card.text = card.text.rstrip() + "\n\n" + section
    return card


def loss_config_from_card(card: ModelCard) -> dict:
    """The `rl_loss` mapping recorded by `complete_model_card` (the YAML block of its section)."""
    _, found, rest = card.text.partition(LOSS_SECTION_TITLE)
    if not found:
        raise ValueError(f"the model card has no {LOSS_SECTION_TITLE!r} section")
    block = rest.split("```yaml\n", 1)[1].split("\n```", 1)[0]
    return yaml.safe_load(block)
