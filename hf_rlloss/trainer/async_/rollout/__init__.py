"""The rollout process of the asynchronous trainer: everything that runs in the spawned worker process, and the
trainer's handle on it.

- `worker`: the trainer's side (`RolloutWorker`): the options, the process handle and its health, the resume
  position, the weights sent (`QueueWeightTransfer`);
- `loop`: the process' loop (`WorkerSettings`, `WorkerLoop`): which weights sample the next batch, its seed, the
  samples put on the queue, the heartbeat;
- `process`: the spawned process, dying with the trainer's (`ProcessDyingWithParent`, `exit_with_parent`);
- `channel`: the samples' channel read with a deadline (`SampleChannel`) and the newest weights only (`LatestWeights`);
- `scoring`: each prompt's group scored (`GroupScoring`): rewards, TRL's group advantages, TRL `RolloutSample`s;
- `tool_calling/`: tools and environments in multi-turn rollouts, and their `episodes`: one sampled conversation
  (`Episode`), the named rollout errors and the policy that decides about them (`RolloutErrorPolicy`);
- the backends, each a `RolloutWorker` and its loop: `hf_generate` (`HFGenerateRolloutWorker`, HF `generate`, for
  machines without vLLM or NCCL) and `vllm` (`VLLMRolloutWorker`, an in-process vLLM engine).

The names a user of the asynchronous trainer imports are importable from here:

```python
>>> from hf_rlloss.trainer.async_.rollout import HFGenerateRolloutWorker, QueueWeightTransfer
```

The lag rules the worker obeys (`weight_lag`, `fixed_lag`) are the trainer's, in `async_/staleness.py`.
"""

from .hf_generate import HFGenerateLoop, HFGenerateRolloutWorker
from .loop import WorkerLoop, WorkerSettings, batch_seed
from .scoring import NoRolloutSamplesError
from .tool_calling import AgentSpec, HungToolCallsError
from .tool_calling.episodes import (
    ERROR_KINDS,
    ON_BUDGET_CUT,
    ON_ROLLOUT_ERROR,
    BudgetCutError,
    ContextOverflowError,
    Episode,
    MalformedToolCallError,
    NonFiniteRewardError,
    RolloutError,
    RolloutErrorPolicy,
    ToolRaisedError,
    ToolTimeoutError,
)
from .vllm import VLLMRolloutWorker, VLLMWorkerLoop
from .worker import VLLM_ONLY_OPTIONS, QueueWeightTransfer, RolloutWorker, RolloutWorkerDiedError

__all__ = [
    "ERROR_KINDS",
    "ON_BUDGET_CUT",
    "ON_ROLLOUT_ERROR",
    "VLLM_ONLY_OPTIONS",
    "AgentSpec",
    "BudgetCutError",
    "ContextOverflowError",
    "Episode",
    "HFGenerateLoop",
    "HFGenerateRolloutWorker",
    "HungToolCallsError",
    "MalformedToolCallError",
    "NoRolloutSamplesError",
    "NonFiniteRewardError",
    "QueueWeightTransfer",
    "RolloutError",
    "RolloutErrorPolicy",
    "RolloutWorker",
    "RolloutWorkerDiedError",
    "ToolRaisedError",
    "ToolTimeoutError",
    "VLLMRolloutWorker",
    "VLLMWorkerLoop",
    "WorkerLoop",
    "WorkerSettings",
    "batch_seed",
]
