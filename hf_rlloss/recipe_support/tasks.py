"""Datasets for the recipes: procedurally generated arithmetic (offline, seeded, verifiable), or a hub dataset with
`question`/`answer` columns such as GSM8K, mapped to chat prompts with a numeric `answer` column."""

from __future__ import annotations

import random
import re

from datasets import Dataset, DatasetDict

ARITHMETIC = "builtin:arithmetic"
PROMPT = "What is {question}? Reply with only the number."


def _problem(a: int, b: int, op: str) -> dict:
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"prompt": [{"role": "user", "content": PROMPT.format(question=f"{a} {op} {b}")}], "answer": answer}


def operand_pair(a: int, b: int) -> tuple[int, int]:
    """The unordered operand pair of ``a op b`` (``3 + 5`` and ``5 + 3`` are one pair)."""
    return min(a, b), max(a, b)


def arithmetic_dataset(
    size: int = 512,
    seed: int = 0,
    max_operand: int = 20,
    operations: str = "+",
    exclude: frozenset[tuple[int, int]] = frozenset(),
    min_operand: int = 0,
) -> Dataset:
    """`size` problems ``a op b`` with operands in `[min_operand, max_operand]`: a chat `prompt` and the numeric
    `answer`.

    Args:
        exclude (`frozenset[tuple[int, int]]`, *optional*): unordered operand pairs (`operand_pair`) never drawn,
            in either order (the held-out pairs of `arithmetic_splits`); the draws are otherwise those without it.
    """
    rng = random.Random(seed)
    rows = []
    while len(rows) < size:
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        op = rng.choice(operations)
        if operand_pair(a, b) not in exclude:
            rows.append(_problem(a, b, op))
    return Dataset.from_list(rows)


def arithmetic_splits(
    size: int = 512,
    heldout_size: int = 64,
    seed: int = 0,
    max_operand: int = 20,
    operations: str = "+",
    min_operand: int = 0,
) -> DatasetDict:
    """A `train` split of `size` problems and a `test` split of `heldout_size` problems whose operand pairs (in
    either order) never occur in `train`: one problem per held-out pair, so held-out accuracy measures what the
    policy learned about addition rather than problems it saw.

    Args:
        size (`int`, *optional*, defaults to `512`): training problems (drawn with repeats, as `arithmetic_dataset`).
        heldout_size (`int`, *optional*, defaults to `64`): held-out problems, each a distinct operand pair; at most
            half the `(n + 1) n / 2` unordered pairs of the `n = max_operand - min_operand + 1` operands, so that
            training keeps most of them.
        seed (`int`), max_operand (`int`), operations (`str`), min_operand (`int`): as `arithmetic_dataset`.
    """
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"min_operand={min_operand}, max_operand={max_operand}: need 0 <= min_operand <= max_operand")
    pairs = [(a, b) for a in range(min_operand, max_operand + 1) for b in range(a, max_operand + 1)]
    if not 0 <= heldout_size <= len(pairs) // 2:
        raise ValueError(
            f"heldout_size={heldout_size} must be in [0, {len(pairs) // 2}]: half of the {len(pairs)} operand pairs "
            f"with operands in [{min_operand}, {max_operand}]"
        )
    rng = random.Random(seed + 1)  # the held-out draw does not shift the training draws of `seed`
    heldout = rng.sample(pairs, heldout_size)
    rows = [_problem(*(pair if rng.random() < 0.5 else pair[::-1]), rng.choice(operations)) for pair in heldout]
    train = arithmetic_dataset(size, seed, max_operand, operations, frozenset(heldout), min_operand)
    test = Dataset.from_list(rows, features=train.features) if rows else train.select([])
    return DatasetDict({"train": train, "test": test})


def _gsm8k_answer(text: str) -> float:
    return float(text.split("####")[-1].strip().replace(",", ""))


def to_prompt_answer(dataset: Dataset, question_column: str = "question", answer_column: str = "answer") -> Dataset:
    """Map a question/answer dataset (GSM8K's "... #### 42" answers included) to chat prompts and numeric answers."""
    missing = [c for c in (question_column, answer_column) if c not in dataset.column_names]
    if missing:
        raise ValueError(f"dataset has no column(s) {missing}; its columns: {dataset.column_names}")

    def convert(row):
        answer = row[answer_column]
        if isinstance(answer, str):
            answer = _gsm8k_answer(answer) if "####" in answer else float(re.sub(r"[,\s]", "", answer))
        content = f"{row[question_column]}\nGive the final answer as a number on the last line."
        return {"prompt": [{"role": "user", "content": content}], "answer": answer}

    return dataset.map(convert, remove_columns=dataset.column_names)
