"""Tool calling in the rollout process: TRL's `tools` and `environment_factory` in multi-turn rollouts.

- `rollouts`: the conversations (`AgentSpec`, `MultiTurnRollouts`): TRL's tool-calling loop around the worker's
  sampler, the rollout errors named and counted, each turn asking for the budget that remains;
- `trl_loop`: `ToolLoopHost`, the object TRL's `GRPOTrainer._tool_call_loop` runs on outside a trainer;
- `runner`: where a turn's tool calls run, side by side (`ToolRunner`): tools in small processes killed when they
  hang, environments' methods in threads (`HungToolCallsError` past `max_hung_tool_threads`);
- `episodes`: what the loop produces, one sampled conversation (`Episode`), the named rollout errors it can meet
  (`RolloutError` and its kinds) and the policy that decides about a group that met one (`RolloutErrorPolicy`), which
  the group scoring (`rollout/scoring.py`) applies. Nothing here imports the rest of `rollout/`.
"""

from .rollouts import AgentSpec, MultiTurnRollouts, prepare_tokenizer
from .runner import HungToolCallsError, ToolRunner
from .trl_loop import ModelContext, ToolLoopHost, ToolLoopResult

__all__ = [
    "AgentSpec",
    "HungToolCallsError",
    "ModelContext",
    "MultiTurnRollouts",
    "ToolLoopHost",
    "ToolLoopResult",
    "ToolRunner",
    "prepare_tokenizer",
]
