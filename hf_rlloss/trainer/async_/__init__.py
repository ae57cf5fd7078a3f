"""The parts of the asynchronous trainer (`RLLossAsyncGRPOTrainer`, `async_grpo_trainer.py`): a rollout worker that
generates with HF `generate` in its own process and a weight transfer through shared memory, for machines without
vLLM or NCCL (`cpu_rollout`).
"""
