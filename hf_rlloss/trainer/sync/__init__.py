"""The parts of the synchronous trainer (`RLLossGRPOTrainer`, `grpo_trainer.py`), one concern per module, each a
`GRPOTrainer` mixin or the functions behind one: complete checkpoints, the non-finite step guard, dynamic sampling,
π_old and the recorded rollout log-probs, sequence parallelism's data path, and saving (model and model card).
"""
