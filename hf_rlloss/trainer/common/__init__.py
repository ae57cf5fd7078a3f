"""What both trainers share: the forwards through the backbone and the chunked LM head, the reference model, the
engines' differences, packed layouts, SP batches, rollout log-prob recording and TRL's multimodal fields.

Nothing here imports `hf_rlloss.trainer.sync` or `hf_rlloss.trainer.async_` (`tests/test_layout.py` checks it).
"""
