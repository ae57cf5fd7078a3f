"""The parts of the asynchronous trainer (`RLLossAsyncGRPOTrainer`, `async_grpo_trainer.py`).

Two sides, one per process:

- the trainer's, mixed into the trainer: `staleness` (which samples are trained, when training stops, every lag rule),
  `packed_rows` (the prefix-trie rows the loss reads), `attention` (their attention), `resume` (the rollout state of
  a checkpoint) and `routing_replay` (MoE routes on those rows);
- the rollout process': `rollout/` (the worker, its loop and process, the samples' channel, the episodes and their
  scoring, tool calling, the HF `generate` and vLLM backends), which imports the lag rules from `staleness`.

The trainer's side never imports `rollout/` (`tests/test_layout.py` checks it). The modules' paths before `rollout/`
keep working for one release (`deprecated_paths`).
"""

from .deprecated_paths import install as _install_deprecated_paths

_install_deprecated_paths()
