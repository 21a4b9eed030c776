"""DeepSpeed-Chat's RLHF pipeline in small, run by a DeepSpeed-style launcher.

Shared by tests/distributed/test_deepspeed_chat.py (the launcher: `zeromem launch`) and
tools/make_deepspeed_chat_reference.py (the launcher: DeepSpeed's own `deepspeed`), so
both run the very same commands and read their output the same way. The scripts and
inputs are under tests/data/deepspeed_chat/ (see its README).

The pipeline, as DeepSpeed-Chat's training scripts run it, on 2 ranks, bf16:
1. sft: step 1, supervised fine-tuning of the tiny OPT at ZeRO-3;
2. reward: step 2, the reward model from the same OPT at ZeRO-2 (DeepSpeed 0.19.8 on CPU
   asserts at ZeRO-3 here: its stage 3 wants one dtype, the reward head is fp32);
3. dpo: step 2's DPO variant on the SFT model, ZeRO-3 with the optimizer offloaded and
   the reference model offloaded;
4. ppo: step 3, PPO with the SFT model as actor (ZeRO-3) and the reward model as critic
   (ZeRO-2), stopped after 3 steps (its test mode).

DPO and PPO start from DeepSpeed's SFT and reward models (`MODELS`, saved by the
reference run), so that both launchers give them the same inputs: PPO's generation
turns the last bf16 bit of a weight into other tokens.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from harness import free_port

CHAT = Path(__file__).parent / "data" / "deepspeed_chat"
MODELS = CHAT / "deepspeed_models"  # DeepSpeed's SFT model (actor) and reward model (critic)
STAGES = ("sft", "reward", "dpo", "ppo")
# step 3's --seed defaults to None (data shuffled anew each run): every stage gets one
_COMMON = ["--data_path", "local/jsonfile", "--data_split", "2,4,4", "--num_train_epochs", "1",
           "--dtype", "bf16", "--deepspeed", "--seed", "1234"]


def arguments(stage: str, out: Path) -> tuple[str, list[str]]:
    """The training script of `stage` and its arguments; outputs go under `out`."""
    model = str(CHAT / "tiny-opt")
    data = ["--data_output_path", str(out / "data_files")]
    batch = ["--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
             "--max_seq_len", "32", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3"]
    if stage == "sft":
        return "training/step1_supervised_finetuning/main.py", [
            *_COMMON, *data, *batch, "--model_name_or_path", model, "--zero_stage", "3",
            "--dropout", "0.0", "--print_loss", "--output_dir", str(out / "actor")]
    if stage == "reward":
        return "training/step2_reward_model_finetuning/main.py", [
            *_COMMON, *data, *batch, "--model_name_or_path", model, "--zero_stage", "2",
            "--dropout", "0.0", "--num_padding_at_beginning", "0",
            "--output_dir", str(out / "critic")]
    if stage == "dpo":
        return "training/step2_dpo_finetuning/main.py", [
            *_COMMON, *data, *batch, "--model_name_or_path", str(MODELS / "actor"),
            "--zero_stage", "3", "--dropout", "0.0", "--offload", "--offload_reference_model",
            "--print_loss", "--output_dir", str(out / "dpo")]
    assert stage == "ppo", stage
    return "training/step3_rlhf_finetuning/main.py", [
        *_COMMON, *data, "--actor_model_name_or_path", str(MODELS / "actor"),
        "--critic_model_name_or_path", str(MODELS / "critic"), "--num_padding_at_beginning", "0",
        "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
        "--generation_batches", "1", "--ppo_epochs", "1", "--max_answer_seq_len", "8",
        "--max_prompt_seq_len", "16", "--actor_learning_rate", "1e-4",
        "--critic_learning_rate", "1e-4", "--gradient_accumulation_steps", "1",
        "--num_warmup_steps", "0", "--actor_zero_stage", "3", "--critic_zero_stage", "2",
        "--actor_dropout", "0.0", "--critic_dropout", "0.0", "--enable_test_mode",
        "--test_stop_step", "3", "--output_dir", str(out / "ppo")]


def run(launcher: list[str], stage: str, out: Path, env: dict[str, str],
        extra: tuple[str, ...] = (), timeout_s: float = 300) -> subprocess.CompletedProcess:
    """`launcher --num_gpus 2 --master_port P script args extra` from the script's directory."""
    script, args = arguments(stage, out)
    args += extra
    path = CHAT / script
    env = {**env, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(CHAT), env.get("PYTHONPATH", "")])}
    command = [*launcher, "--num_gpus", "2", "--master_port", str(free_port()), path.name, *args]
    return subprocess.run(command, cwd=path.parent, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


_NUMBER = r"(-?[0-9.]+(?:e-?[0-9]+)?)"
_READ = {  # what each stage prints, as (label, pattern): every match's numbers, in order
    "sft": [("loss", rf"Step: \d+, Rank: 0, loss = {_NUMBER}"),
            ("eval", rf"ppl: {_NUMBER}, loss: {_NUMBER}")],
    "reward": [("eval", rf"chosen_last_scores \(higher is better\) : {_NUMBER}, "
                        rf"rejected_last_scores \(lower is better\) : {_NUMBER}")],
    "dpo": [("loss", rf"Step: \d+, Rank: 0, loss = {_NUMBER}"),
            ("eval", rf"chosen: {_NUMBER}, rejected: {_NUMBER}, loss: {_NUMBER}")],
    "ppo": [("loss", rf"Actor Loss: {_NUMBER} \| Critic Loss: {_NUMBER}"),
            ("reward", rf"Average reward score: {_NUMBER}")],
}


def read(stage: str, stdout: str) -> dict[str, list[float]]:
    """The figures `stage` printed: {label: numbers in the order printed}."""
    return {label: [float(x) for match in re.findall(pattern, stdout)
                    for x in ((match,) if isinstance(match, str) else match)]
            for label, pattern in _READ[stage]}
