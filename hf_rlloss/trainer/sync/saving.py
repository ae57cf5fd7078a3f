"""What a finished synchronous run writes: a consolidated model under FSDP, and TRL's model card completed for the Hub.

`ModelSaving` is mixed into `RLLossGRPOTrainer`; both methods are `Trainer`/`GRPOTrainer` overrides. The card's
contents (base model, the `rl_loss` configuration as YAML, a runnable quick start) are `common/model_card.py`'s.
"""

from __future__ import annotations

import os

from huggingface_hub import ModelCard
from torch.distributed.fsdp import StateDictType

from ..common.model_card import base_model_license, complete_model_card, dataset_example_prompt, quick_start_folder
from ..common.overrides import overridden

__all__ = ["ModelSaving"]


class ModelSaving:
    """`save_model` and `create_model_card` of `RLLossGRPOTrainer` (a `GRPOTrainer` mixin)."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`, writing a consolidated model under FSDP whatever `fsdp_state_dict_type` is.

        Trainer override: under FSDP with `SHARDED_STATE_DICT` (`accelerate_configs/fsdp2.yaml`), transformers'
        `save_model` writes no weights (the sharded model goes next to the optimizer state, for resuming), so a final
        `save_model()` or `push_to_hub()` would leave a folder `from_pretrained` cannot load. Here every rank joins
        one gather of the full state dict and the main process writes a normal HF folder.
        """
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if not self.is_fsdp_enabled or plugin is None:
            return super().save_model(output_dir, _internal_call)
        with overridden(plugin, state_dict_type=StateDictType.FULL_STATE_DICT):
            return super().save_model(output_dir, _internal_call)

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        base_model: str | None = None,
        example_prompt: str | None = None,
    ) -> None:
        """TRL override: TRL's model card, completed for the Hub by `common.model_card.complete_model_card`.

        Its quick start loads the Hub repository when there is one (`hub_model_id`, `push_to_hub`), else the output
        folder relative to the working directory, and asks one of the training prompts; its front matter has the base
        model's license when its card can be read offline.

        Args:
            model_name (`str`, *optional*, defaults to the name of `output_dir`):
                The card's title.
            dataset_name (`str`, *optional*):
                The training dataset (the card's `datasets` metadata).
            tags (`str` or `list[str]`, *optional*):
                Tags added to `trl`, `grpo` and `hf-rlloss`.
            base_model (`str`, *optional*):
                The model trained from: its `base_model` metadata when it is a Hub id, else named in the text.
                Defaults to TRL's choice (the policy's `config._name_or_path` unless it is a local folder).
            example_prompt (`str`, *optional*, defaults to the first training prompt):
                The quick start's question.
        """
        if not self.is_world_process_zero():
            return
        model_name = model_name or os.path.basename(os.path.normpath(self.args.output_dir))
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        path = os.path.join(self.args.output_dir, "README.md")
        local_path = None if self.hub_model_id else quick_start_folder(self.args.output_dir)
        source = getattr(self.model.config, "_name_or_path", None)
        card = complete_model_card(
            ModelCard.load(path),
            self.rl_loss_config.to_dict(),
            base_model,
            local_path,
            example_prompt or dataset_example_prompt(self.train_dataset),
            base_model_license(source) or base_model_license(base_model),
        )
        card.save(path)
