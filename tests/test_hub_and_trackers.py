"""What a user meets after a run: tracker logs (tensorboard, trackio), a Hub-ready output folder (model card,
`from_pretrained` → `generate`, the files a push would upload), the end-of-run summary, no deprecation warnings.

One smoke-recipe run (`recipes/grpo.py`, single process, `report_to: [tensorboard, trackio]`, `-W default`) is shared
by the tests of this module.
"""

import contextlib
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from _full_matrix import slow_launch
from _trainer_utils import BASE_ARGS, make_dataset, make_model, make_tokenizer, reward_length
from huggingface_hub import HfApi, ModelCard

from hf_rlloss import GRPOLossConfig, RLLossGRPOConfig, RLLossGRPOTrainer
from hf_rlloss.recipe_support.assets import SMOLLM2, TINY, hub_origin
from hf_rlloss.recipe_support.callbacks import RunSummaryCallback
from hf_rlloss.trainer.common.model_card import complete_model_card, is_hub_repo_id, loss_config_from_card
from hf_rlloss.trainer.common.transformers_compat import RENAMED_CHECKPOINTING

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "recipes/tiny/arithmetic/config_smoke.yaml"
STEPS = 2  # max_steps of the smoke recipe
# The metric groups of the loss layer; the trackers prefix every training log with "train/" (transformers' rewrite).
GROUPS = ("train_policy/", "loss/", "mismatch/", "rollout_is/")
PROJECT = "hf-rlloss-smoke"

# Runs the recipe with every connection to a non-loopback address refused and recorded (trackers must stay local).
OFFLINE_RUNNER = """
import runpy, socket, sys

LOG, LOOPBACK = sys.argv[1], ("127.0.0.1", "::1", "localhost", "")
def _refuse(host):
    if str(host) not in LOOPBACK:
        with open(LOG, "a") as log:
            log.write(f"{host}\\n")
        raise OSError(f"network access to {host} refused by the test")

_connect, _getaddrinfo = socket.socket.connect, socket.getaddrinfo
def connect(self, address):
    if isinstance(address, tuple):
        _refuse(address[0])
    return _connect(self, address)
def getaddrinfo(host, *args, **kwargs):
    _refuse(host)
    return _getaddrinfo(host, *args, **kwargs)
socket.socket.connect, socket.getaddrinfo = connect, getaddrinfo
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smoke")
    config = yaml.safe_load(SMOKE.read_text())
    config.update(report_to=["tensorboard", "trackio"], project=PROJECT, run_name="smoke", output_dir=str(tmp / "out"))
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    env = {
        **os.environ,
        "HF_RLLOSS_CACHE": str(tmp / "cache"),
        "TRACKIO_DIR": str(tmp / "trackio"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    (tmp / "offline_runner.py").write_text(OFFLINE_RUNNER)
    network_log = tmp / "network_attempts.txt"
    recipe = [str(ROOT / "recipes/grpo.py"), "--config", str(tmp / "config.yaml")]
    cmd = [sys.executable, "-W", "default", str(tmp / "offline_runner.py"), str(network_log), *recipe]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp)
    assert result.returncode == 0, result.stderr[-4000:]
    assert not network_log.exists(), f"the run tried the network: {network_log.read_text()}"
    return {
        "out": tmp / "out",
        "trackio": tmp / "trackio",
        "env": env,
        "stdout": result.stdout,
        "stderr": result.stderr,
    }


def _assert_every_group_at_every_step(series: dict[str, list[int]]) -> None:
    """`series`: metric name (without the tracker's "train/" prefix) -> the steps it was logged at."""
    for group in GROUPS:
        keys = [key for key in series if key.startswith(group)]
        assert keys, f"no {group}* scalar; logged: {sorted(series)[:20]}..."
        for key in keys:
            assert sorted(series[key]) == list(range(1, STEPS + 1)), (key, series[key])
    for key in ("train_policy/ref_kl", "train_policy/clip_frac_high", "loss/total", "mismatch/mismatch_k3_kl"):
        assert key in series, key
    assert "rollout_is/mean" in series and "rollout_is/eff_sample_size" in series


@slow_launch
@pytest.mark.slow
def test_tensorboard_event_files_hold_every_group_at_every_step(smoke_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = glob.glob(str(smoke_run["out"] / "runs" / "*"))
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    series = {
        tag.removeprefix("train/"): [event.step for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    _assert_every_group_at_every_step(series)


@slow_launch
@pytest.mark.slow
def test_trackio_local_store_holds_every_group_at_every_step(smoke_run):
    # Read back with trackio's own reader, in a process that sees TRACKIO_DIR (trackio reads it at import).
    read = (
        "import json; from trackio.sqlite_storage import SQLiteStorage as S; "
        f"print(json.dumps({{r: S.get_logs({PROJECT!r}, r) for r in S.get_runs({PROJECT!r})}}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", read], env=smoke_run["env"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    runs = json.loads(result.stdout.strip().splitlines()[-1])
    assert list(runs) == ["smoke"]
    series: dict[str, list[int]] = {}
    for record in runs["smoke"]:
        step = record.get("train/global_step")
        for key in record:
            if key.startswith("train/") and key != "train/global_step" and step is not None:
                series.setdefault(key.removeprefix("train/"), []).append(step)
    _assert_every_group_at_every_step(series)


@slow_launch
@pytest.mark.slow
def test_model_card_is_hub_ready(smoke_run):
    card = ModelCard.load(smoke_run["out"] / "README.md")  # parses: valid YAML metadata
    assert {"trl", "grpo", "hf-rlloss"} <= set(card.data.tags)
    assert card.data.library_name == "transformers"
    assert card.data.datasets == "builtin:arithmetic"
    # The tiny model is a random init (no Hub origin): named in the text, not in the `base_model` metadata.
    assert card.data.base_model is None
    assert "fine-tuned version of `builtin:tiny-random` on the `builtin:arithmetic` dataset" in card.text
    assert "None" not in card.text.split("## Training procedure")[0]
    assert 'model="./out"' in card.text  # the quick start loads the folder, relative to where the run started
    assert "licence" not in card.data.to_dict() and "license" not in card.data.to_dict()  # a random init: none
    recorded = loss_config_from_card(card)
    expected = RLLossGRPOConfig(
        output_dir=str(smoke_run["out"]), use_cpu=True, rl_loss=yaml.safe_load(SMOKE.read_text())["rl_loss"]
    ).rl_loss_config
    assert GRPOLossConfig(**recorded) == expected
    assert recorded["rollout_is"]["upper"] == 2.0 and recorded["kl_loss_type"] == "k3"


@slow_launch
@pytest.mark.slow
def test_output_folder_loads_and_generates(smoke_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = smoke_run["out"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.use_cache
    messages = [{"role": "user", "content": "What is 2 + 3? Reply with only the number."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    torch.manual_seed(0)
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    new_tokens = generated[0, prompt["input_ids"].shape[1] :]
    assert 0 < len(new_tokens) <= 6
    assert isinstance(tokenizer.decode(new_tokens, skip_special_tokens=True), str)


@slow_launch
@pytest.mark.slow
def test_end_of_run_summary_and_no_deprecation_warning(smoke_run):
    (line,) = [line for line in smoke_run["stdout"].splitlines() if line.startswith("run summary:")]
    out = smoke_run["out"]
    assert f"(first {STEPS} steps)" in line and f"(last {STEPS} steps)" in line and f"over {STEPS} steps" in line
    assert f"curves: {out / 'training_curves.png'}" in line and line.endswith(f"model: {out}")
    assert (out / "training_curves.png").exists()
    warnings = [line for line in smoke_run["stderr"].splitlines() if "Warning:" in line]
    assert not warnings, warnings  # run with -W default: every DeprecationWarning/FutureWarning would show


def test_run_summary_line():
    summary = RunSummaryCallback(k=2)
    logs = [{"step_time": t, "rewards/accuracy_reward/mean": r} for t, r in [(1.0, 0.0), (3.0, 0.5), (2.0, 1.0)]]
    for log in [{"train_runtime": 9.0}, *logs]:  # the final summary log (no step_time) is not a step
        summary.on_log(None, None, None, logs=log)
    line = summary.summary("out", "out/training_curves.png")
    assert line == (
        "run summary: accuracy reward 0.25 (first 2 steps) -> 0.75 (last 2 steps); mean step time 2.00 s over 3 "
        "steps; curves: out/training_curves.png; model: out"
    )
    only_total = RunSummaryCallback(k=8)
    only_total.on_log(None, None, None, logs={"step_time": 1.0, "reward": 0.5})
    assert only_total.summary("m").startswith("run summary: reward 0.50 (first 1 steps) -> 0.50 (last 1 steps)")


def test_base_model_metadata_only_for_hub_ids(tmp_path):
    assert hub_origin(SMOLLM2) == "HuggingFaceTB/SmolLM2-135M-Instruct" and hub_origin(TINY) == TINY
    assert is_hub_repo_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_repo_id("gpt2")
    assert not is_hub_repo_id(TINY) and not is_hub_repo_id(str(tmp_path)) and not is_hub_repo_id(None)
    text = "---\ntags: [trl]\n---\n\nThis model is a fine-tuned version of [None](https://huggingface.co/None).\n"
    card = complete_model_card(ModelCard(text), {"use_kl_loss": False}, base_model="Qwen/Qwen2.5-0.5B-Instruct")
    card = ModelCard(str(card))  # still parses after the edits
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert "[Qwen/Qwen2.5-0.5B-Instruct](https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct)" in card.text
    assert loss_config_from_card(card) == {"use_kl_loss": False}
    bare = complete_model_card(ModelCard(text), {}, base_model=None)
    assert bare.data.base_model is None and "None" not in bare.text.split("---")[-1].split("##")[0]


class OfflineHubApi(HfApi):
    """`HfApi` whose network calls are replaced: `upload_folder` runs its real file selection, then records the
    commit instead of sending it."""

    def __init__(self):
        super().__init__(token="hf_offline")
        self.created: list[str] = []
        self.uploaded: list[str] = []
        self.card = None

    def create_repo(self, repo_id, **kwargs):
        from huggingface_hub import RepoUrl

        self.created.append(repo_id)
        return RepoUrl(f"https://huggingface.co/{repo_id if '/' in repo_id else 'offline-user/' + repo_id}")

    def _validate_yaml(self, content, **kwargs):  # the Hub's validation endpoint; here: it must parse
        self.card = ModelCard(content, ignore_metadata_errors=False)

    def create_commit(self, repo_id, operations, **kwargs):
        self.uploaded = sorted(op.path_in_repo for op in operations)
        return self.uploaded


def test_push_to_hub_uploads_card_and_weights(tmp_path, monkeypatch):
    import huggingface_hub.hf_api
    import transformers.trainer

    api = OfflineHubApi()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: api)
    monkeypatch.setattr(huggingface_hub.hf_api, "is_xet_available", lambda: False)  # the single-commit path
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    model.config._name_or_path = "Qwen/Qwen2.5-0.5B-Instruct"  # as if loaded from the Hub
    rl_loss = {"policy_loss_cfg": {"loss_type": "gspo"}, "use_kl_loss": True, "kl_loss_type": "k3"}
    args = RLLossGRPOConfig(output_dir=str(tmp_path / "my-model"), rl_loss=rl_loss, **BASE_ARGS)
    trainer = RLLossGRPOTrainer(
        model, reward_length, args=args, train_dataset=make_dataset(4), processing_class=tokenizer
    )
    uploaded = trainer.push_to_hub(dataset_name="openai/gsm8k")
    assert api.created == ["my-model"]
    assert {"README.md", "model.safetensors", "config.json", "tokenizer.json", "training_args.bin"} <= set(uploaded)
    assert not [path for path in uploaded if path.startswith(("_", "checkpoint-"))]
    card = api.card
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct" and card.data.datasets == "openai/gsm8k"
    assert {"trl", "grpo", "hf-rlloss"} <= set(card.data.tags) and card.data.model_name == "my-model"
    assert 'model="offline-user/my-model"' in card.text
    assert GRPOLossConfig(**loss_config_from_card(card)) == args.rl_loss_config


def test_activation_checkpointing_defaults_without_warning_and_old_name_still_works(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        default = RLLossGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert default.activation_checkpointing is True and default.gradient_checkpointing is True  # TRL's default
    # the old name warns where transformers renamed it (5.23); before that it is the current name
    renamed = pytest.warns(FutureWarning, match="`gradient_checkpointing` is deprecated")
    with renamed if RENAMED_CHECKPOINTING else contextlib.nullcontext():
        old = RLLossGRPOConfig(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=False)
    assert old.activation_checkpointing is False and old.gradient_checkpointing is False


@pytest.mark.parametrize("config_class", ["sync", "async"])
def test_the_new_checkpointing_names_reach_the_names_transformers_reads_on_every_release(tmp_path, config_class):
    from hf_rlloss import RLLossAsyncGRPOConfig

    cls = RLLossGRPOConfig if config_class == "sync" else RLLossAsyncGRPOConfig
    kwargs = {"use_reentrant": False}
    args = cls(
        output_dir=str(tmp_path), use_cpu=True, activation_checkpointing=False, activation_checkpointing_kwargs=kwargs
    )
    assert args.gradient_checkpointing is False and args.activation_checkpointing is False
    assert args.gradient_checkpointing_kwargs == kwargs and args.activation_checkpointing_kwargs == kwargs
    on = cls(output_dir=str(tmp_path), use_cpu=True, activation_checkpointing=True)
    assert on.gradient_checkpointing is True and on.activation_checkpointing is True


def test_checkpointing_toggles_through_one_name_on_every_release():
    from hf_rlloss.trainer.common.engines import activation_checkpointing_disabled
    from hf_rlloss.trainer.common.transformers_compat import enable_checkpointing, is_checkpointing

    model = make_model(make_tokenizer())
    assert not is_checkpointing(model)
    enable_checkpointing(model, {"use_reentrant": False})
    assert is_checkpointing(model)
    with activation_checkpointing_disabled(model, {"use_reentrant": False}):
        assert not is_checkpointing(model)
    assert is_checkpointing(model)
