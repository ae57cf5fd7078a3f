"""FSDP2 on CPU/gloo: the shipped `accelerate_configs/fsdp2.yaml` (sharding as shipped, on CPU, 2 processes, fp32)
really shards the policy and the reference, trains like DDP, saves a loadable model and resumes.

Accelerate turns FSDP into DDP on CPU, so every FSDP2 launch goes through `tests/fsdp2_script.py`, which installs
the test-only shim of `tests/_cpu_fsdp.py` (a real `DistributedType.FSDP` state; `fully_shard` runs on gloo) and then
runs `tests/engine_matrix_script.py` unchanged, as the DDP baseline does. Three launches: DDP and FSDP2 with the
cases sp1 (tied embeddings, KL to an in-memory reference, token rollout IS, off-policy steps), sp2 (Ulysses SP over
the same 2 ranks) and sp1-peft (LoRA; the reference is the base model), 4 optimizer steps each, FSDP2 writing
checkpoints and a final `save_model`; then FSDP2 resumed from the sp1 checkpoint at step 2.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
from _full_matrix import slow_launch
from _launch import ROOT, accelerate_launch, cpu_accelerate_config, launch_once, run

HERE = os.path.dirname(os.path.abspath(__file__))
MATRIX = os.path.join(HERE, "engine_matrix_script.py")
FSDP2 = os.path.join(HERE, "fsdp2_script.py")
TIMEOUT = 600  # seconds per launch (3 cases in 2 processes on 2 shared cores: about 40 s when idle)
CASES = ["sp1", "sp2", "sp1-peft"]
STEPS, SAVE_STEPS = 4, 2
TOL = 1e-5


def _launch(out_dir, config: str, script: str, name: str, *args: str) -> dict:
    out = out_dir / f"{name}.pt"
    cmd = accelerate_launch(cpu_accelerate_config(config, out_dir), script, "--out", str(out), *args)
    proc = run(cmd, TIMEOUT, cwd=out_dir)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun not available")
    root = tmp_path_factory.mktemp("fsdp2")
    steps = ["--steps", str(STEPS)]

    def launch(name: str) -> dict:
        out_dir = root / name
        out_dir.mkdir()
        if name == "ddp":
            record = _launch(out_dir, "ddp", MATRIX, name, "--cases", *CASES, *steps)
        elif name == "fsdp2":
            save = ["--save-steps", str(SAVE_STEPS), "--save-dir", str(out_dir / "saved")]
            record = _launch(out_dir, "fsdp2", FSDP2, name, "--cases", *CASES, *steps, *save)
        else:  # resumed from the sp1 checkpoint the fsdp2 run wrote at step SAVE_STEPS
            checkpoint = root / "fsdp2" / "run" / "sp1" / f"checkpoint-{SAVE_STEPS}"
            get("fsdp2")
            resume = ["--resume-from", str(checkpoint)]
            record = _launch(out_dir, "fsdp2", FSDP2, name, "--cases", "sp1", *steps, *resume)
        record["dir"] = out_dir
        return record

    get = launch_once(launch)
    return get


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_fsdp2_really_shards_policy_and_reference(runs, case):
    record = runs("fsdp2")[case]
    engine, probe = record["engine"], record["fsdp2"]
    assert engine["distributed_type"] == "DistributedType.FSDP" and engine["mixed_precision"] == "no"
    assert engine["wrapper"].startswith("FSDP") and engine["dtensor_params"]
    assert engine["param_dtype"] == "torch.float32"
    after = probe["after_train"]
    assert after["policy_fsdp_module"] and after["policy_all_dtensor"]
    if case.endswith("peft"):
        assert engine["ref_wrapper"] is None  # the reference is the policy with its adapter disabled
    else:  # the in-memory policy's reference: a copy taken before sharding, then sharded like the policy
        assert engine["ref_wrapper"].startswith("FSDP") and after["ref_fsdp_module"] and after["ref_all_dtensor"]
    # Every loss and log-prob pass ran inside the root module's forward: the head weight was unsharded there (full
    # (V, H), not a DTensor), with and without gradients; after each no-gradient pass and after training it is a
    # shard again (not kept), and it stays tied to the embeddings.
    calls = probe["head_calls"]
    vocab, hidden = after["head_full_shape"]
    assert calls and all(not c["sharded"] and c["shape"] == (vocab, hidden) for c in calls), calls
    assert {c["grad"] for c in calls} == {True, False}
    assert probe["sharded_after_logps"] and all(probe["sharded_after_logps"])  # old/ref passes: resharded after
    assert after["head_local_shape"] == ((vocab + 1) // 2, hidden)
    assert after["tied"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_fsdp2_matches_ddp(runs, case):
    ddp, fsdp2 = runs("ddp")[case], runs("fsdp2")[case]
    assert ddp["engine"]["wrapper"] == "DistributedDataParallel" and ddp["world_size"] == fsdp2["world_size"] == 2
    assert ddp["global_step"] == fsdp2["global_step"] == STEPS and len(fsdp2["losses"]) == STEPS
    assert ddp["moved"] > 1e-3 and fsdp2["moved"] > 1e-3
    for a, b in zip(ddp["losses"], fsdp2["losses"]):
        assert abs(a - b) < TOL, (ddp["losses"], fsdp2["losses"])
    assert _max_diff(ddp["params"], fsdp2["params"]) < TOL
    if case == "sp2":  # the SP group spans the 2 global ranks
        assert [r["sp_group_ranks"] for r in fsdp2["ranks"]] == [[0, 1], [0, 1]]
    if case.endswith("peft"):
        assert all("lora_" in name for name in fsdp2["params"])


@pytest.mark.distributed
def test_fsdp2_save_model_writes_a_loadable_consolidated_model(runs):
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, HERE)
    from _trainer_utils import make_model, make_tokenizer

    result = runs("fsdp2")
    folder = result["dir"] / "saved" / "sp1"
    assert "model.safetensors" in os.listdir(folder)  # with fsdp_state_dict_type: SHARDED_STATE_DICT as shipped
    model = AutoModelForCausalLM.from_pretrained(folder)
    loaded = {n: p.detach() for n, p in model.named_parameters()}
    assert _max_diff(result["sp1"]["params"], loaded) == 0.0
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    tok = make_tokenizer()
    prompt = tok("Q01: add 1+1 =", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 4
    # PEFT: the adapter is saved; loaded onto the base model it holds the trained LoRA weights
    from peft import PeftModel

    adapter = PeftModel.from_pretrained(make_model(tok), result["dir"] / "saved" / "sp1-peft")
    lora = {n.replace(".default", ""): p.detach() for n, p in adapter.named_parameters() if "lora_" in n}
    trained = {n.replace(".default", ""): p for n, p in result["sp1-peft"]["params"].items()}
    assert _max_diff(trained, lora) == 0.0


@slow_launch
@pytest.mark.distributed
def test_fsdp2_resume_gives_the_same_next_losses(runs):
    uninterrupted, resumed = runs("fsdp2")["sp1"], runs("resumed")["sp1"]
    assert resumed["global_step"] == STEPS
    new = [(s, loss) for s, loss in zip(resumed["steps"], resumed["losses"]) if s > SAVE_STEPS]
    assert [s for s, _ in new] == list(range(SAVE_STEPS + 1, STEPS + 1))
    for step, loss in new:
        assert abs(loss - uninterrupted["losses"][step - 1]) < 1e-6, (step, loss, uninterrupted["losses"])
    assert _max_diff(uninterrupted["params"], resumed["params"]) < 1e-6


@slow_launch
@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_matches_ddp_with_an_untied_head(tmp_path):
    """A separate LM head: Accelerate puts it in one FSDP unit with the final norm (not with the embeddings)."""
    args = ["--untied", "--cases", "sp1", "sp2", "--steps", str(STEPS)]
    (tmp_path / "ddp").mkdir()
    (tmp_path / "fsdp2").mkdir()
    ddp = _launch(tmp_path / "ddp", "ddp", FSDP2, "ddp", *args)
    fsdp2 = _launch(tmp_path / "fsdp2", "fsdp2", FSDP2, "fsdp2", *args)
    for case in ("sp1", "sp2"):
        assert ddp[case]["engine"]["wrapper"] == "DistributedDataParallel" and not ddp[case]["head"]["tied"]
        after = fsdp2[case]["fsdp2"]["after_train"]
        assert after["policy_all_dtensor"] and after["ref_all_dtensor"] and not after["tied"]
        assert all(fsdp2[case]["fsdp2"]["sharded_after_logps"])
        assert ddp[case]["moved"] > 1e-3
        for a, b in zip(ddp[case]["losses"], fsdp2[case]["losses"], strict=True):
            assert abs(a - b) < TOL, (case, ddp[case]["losses"], fsdp2[case]["losses"])
        assert _max_diff(ddp[case]["params"], fsdp2[case]["params"]) < TOL


@slow_launch
@pytest.mark.distributed
@pytest.mark.slow
def test_recipe_under_fsdp2(tmp_path):
    """`recipes/grpo.py` (HF generate, reference loaded from the model path) under the shipped FSDP2 config."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    cmd = accelerate_launch(
        cpu_accelerate_config("fsdp2", tmp_path),
        os.path.join(HERE, "_cpu_fsdp.py"),
        str(ROOT / "recipes" / "grpo.py"),
        "--config",
        str(ROOT / "recipes" / "tiny" / "arithmetic" / "config_smoke.yaml"),
        "--output_dir",
        str(out),
    )
    proc = run(cmd, TIMEOUT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stderr.count("runs FSDP2 on CPU") == 2  # the shim switched both ranks to FSDP
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, min_new_tokens=2).shape == (1, 5)
