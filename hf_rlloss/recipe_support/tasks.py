"""Datasets for the recipes: procedurally generated arithmetic (offline, seeded, verifiable), or a hub dataset with
`question`/`answer` columns such as GSM8K, mapped to chat prompts with a numeric `answer` column."""

from __future__ import annotations

import random
import re

from datasets import Dataset

ARITHMETIC = "builtin:arithmetic"
PROMPT = "What is {question}? Reply with only the number."


def arithmetic_dataset(size: int = 512, seed: int = 0, max_operand: int = 20, operations: str = "+") -> Dataset:
    """`size` problems ``a op b`` with operands in `[0, max_operand]`: a chat `prompt` and the numeric `answer`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(operations)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"{a} {op} {b}"
        rows.append({"prompt": [{"role": "user", "content": PROMPT.format(question=question)}], "answer": answer})
    return Dataset.from_list(rows)


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
