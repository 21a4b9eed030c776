"""Lightning's Trainer and Fabric with their DeepSpeed strategies, on zeromem or on DDP.

Run by test_lightning.py under torchrun (2 gloo ranks): `lightning_script.py MODE OUT`,
MODE "ddp" (the reference: Lightning's DDP strategy) or "zeromem" (Lightning's own
DeepSpeedStrategy classes over `install_as_deepspeed()`). Each rank writes
OUT/MODE_RANK.json: per-step training losses and validation losses of each run, the
losses after resuming from a checkpoint, and the validation losses of a model loaded
from that checkpoint made one file by Lightning's converter.

Lightning refuses DeepSpeed on a CPU accelerator in two checks (the accelerator's class,
CUDA device indices); the strategies below skip only those. Everything else, from the
config Lightning builds to its checkpoints, is Lightning's own code.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

MODE, OUT = sys.argv[1], Path(sys.argv[2])
ZEROMEM = MODE == "zeromem"
# a Lightning checkpoint real DeepSpeed saved (mode "deepspeed"), which zeromem resumes
FROM_DEEPSPEED = Path(__file__).parent.parent / "data" / "lightning_deepspeed_checkpoint"
if ZEROMEM:
    from zeromem.deepspeed import install_as_deepspeed
    install_as_deepspeed()  # before Lightning is imported, as HF's

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.strategies import DDPStrategy as FabricDDP  # noqa: E402
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeed  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint as torch_checkpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

torch.manual_seed(0)
DATA = TensorDataset(torch.randn(64, 16), torch.randn(64, 4))


class TrainerDeepSpeed(DeepSpeedStrategy):
    def setup_environment(self) -> None:  # Lightning: "only supported on CUDA GPUs"
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:  # Lightning: device indices must be CUDA's
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class RealDeepSpeedOnCPU(TrainerDeepSpeed):
    @property
    def root_device(self) -> torch.device:  # real DeepSpeed takes its index as a device rank
        return torch.device("cpu", self.local_rank)


class FabricDeepSpeedOnCPU(FabricDeepSpeed):
    def setup_environment(self) -> None:
        FabricDDP.setup_environment(self)

    def _setup_distributed(self) -> None:
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True
        # Fabric leaves gradient_clipping unset: DeepSpeed 0.19.8 (and zeromem) then clip at
        # 1.0, and the DDP run this loop is compared with does not clip
        self.config.setdefault("gradient_clipping", 0.0)


class Net(L.LightningModule):
    """Layers built in `configure_model` (under `zero.Init` at stage 3, as Lightning's
    guide for ZeRO-3 says), the middle one activation-checkpointed (DeepSpeed's
    `checkpointing.checkpoint` on zeromem, with the policy Lightning configured)."""

    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.layers: nn.ModuleList | None = None
        self.losses: list[float] = []
        self.vals: list[float] = []

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.ModuleList([nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.layers is not None
        x = torch.tanh(self.layers[0](x))
        if ZEROMEM:
            import deepspeed
            x = deepspeed.checkpointing.checkpoint(self.layers[1], x)
        else:
            x = torch_checkpoint(self.layers[1], x, use_reentrant=False)
        return self.layers[2](torch.tanh(x))

    def training_step(self, batch, index):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, index):
        x, y = batch
        self.vals.append(nn.functional.mse_loss(self(x), y).item())

    def configure_optimizers(self):
        # SGD with momentum: a wrong gradient scale shows (Adam would hide it)
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return {"optimizer": optimizer,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.5)}


def trainer(epochs: int, precision: str = "32-true", accumulate: int = 1, summary: bool = False,
            **deepspeed) -> L.Trainer:
    strategy = TrainerDeepSpeed(process_group_backend="gloo", **deepspeed) if ZEROMEM else "ddp"
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs,
                     precision=precision, accumulate_grad_batches=accumulate, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=summary, num_sanity_val_steps=2)


def fit(tr: L.Trainer, lr: float = 0.1, ckpt_path: str | None = None) -> dict:
    """Train (validating first, Lightning's sanity check, and after each epoch)."""
    L.seed_everything(1)
    model = Net(lr)
    tr.fit(model, DataLoader(DATA, batch_size=4), DataLoader(DATA, batch_size=16),
           ckpt_path=ckpt_path)
    return {"losses": model.losses, "vals": model.vals}


def trainer_runs() -> dict:
    runs = {}
    stage3 = dict(stage=3, partition_activations=True, cpu_checkpointing=True)
    runs["stage3"] = fit(trainer(2, summary=True, **stage3))
    runs["offload"] = fit(trainer(1, stage=3, offload_optimizer=True, offload_parameters=True))
    runs["bf16"] = fit(trainer(1, precision="bf16-mixed", stage=2))
    # Lightning divides the loss by accumulate_grad_batches and so does DeepSpeed's
    # engine.backward: the gradient is 1/accumulate of DDP's. Measured with DeepSpeed
    # 0.19 itself (same model and batches): its losses are DDP's at half the lr, as here.
    runs["accumulate"] = fit(trainer(1, accumulate=2, stage=2), lr=0.1 if ZEROMEM else 0.05)
    first = trainer(1, **stage3)
    runs["first_epoch"] = fit(first)
    saved = str(OUT / f"{MODE}.ckpt")
    first.save_checkpoint(saved)
    runs["resumed"] = fit(trainer(2, **stage3), ckpt_path=saved)
    runs["full_weights"] = validate_one_file(saved, first)
    if ZEROMEM:  # the checkpoint real DeepSpeed saved, resumed as a user switching would
        runs["from_deepspeed"] = fit(trainer(2, stage=2),
                                     ckpt_path=str(FROM_DEEPSPEED / "ds.ckpt"))
    return runs


def deepspeed_checkpoint() -> None:
    """Mode `deepspeed`, run by hand with real DeepSpeed (a test-data tool):

        DS_ACCELERATOR=cpu .venv-ds/bin/torchrun --nproc-per-node 2 \\
            tests/distributed/lightning_script.py deepspeed OUT

    One epoch at stage 2 (SGD with momentum and StepLR: the script's own, which DeepSpeed
    steps), saved by Lightning into FROM_DEEPSPEED/ds.ckpt; then the fit resumed from it
    for a second epoch, its losses in FROM_DEEPSPEED/expected_<rank>.json."""
    def stage2(epochs: int) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=2, max_epochs=epochs, logger=False,
                         strategy=RealDeepSpeedOnCPU(process_group_backend="gloo", stage=2),
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=2)

    first = stage2(1)
    fit(first)
    first.save_checkpoint(str(FROM_DEEPSPEED / "ds.ckpt"))
    resumed = fit(stage2(2), ckpt_path=str(FROM_DEEPSPEED / "ds.ckpt"))
    (FROM_DEEPSPEED / f"expected_{first.global_rank}.json").write_text(json.dumps(resumed))
    for script in (FROM_DEEPSPEED / "ds.ckpt").glob("*.py"):  # DeepSpeed's converters
        script.unlink(missing_ok=True)


def validate_one_file(saved: str, tr: L.Trainer) -> dict:
    """Validation of a fresh model loaded from the checkpoint: on zeromem made one file by
    Lightning's `convert_zero_checkpoint_to_fp32_state_dict`, loaded whole
    (`load_full_weights`); DDP's checkpoint is one file already."""
    path = saved
    if ZEROMEM:
        path = str(OUT / "one_file.pt")
        if tr.global_rank == 0:
            from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
            convert_zero_checkpoint_to_fp32_state_dict(saved, path)
        tr.strategy.barrier()
    model = Net()
    validator = trainer(1, stage=3, load_full_weights=True) if ZEROMEM else trainer(1)
    validator.validate(model, DataLoader(DATA, batch_size=16), ckpt_path=path, verbose=False)
    saved_whole = torch.load(path, map_location="cpu", weights_only=False)
    state = saved_whole.pop("state_dict")
    return {"vals": model.vals, "weights": {k: v.flatten().tolist() for k, v in state.items()},
            # Lightning's own entries (loops, callbacks, hyper-parameters) kept beside the weights
            "entries": sorted(saved_whole), "epoch": saved_whole["epoch"],
            "hyper_parameters": dict(saved_whole["hyper_parameters"])}


def fabric_run() -> dict:
    """Fabric's loop: ranks seeded differently, the model built in `init_module()` (under
    `zero.Init` at stage 3), `fabric.backward`, `optimizer.step()` (DeepSpeed's optimizer,
    not the engine), `fabric.save`, then `fabric.load` and the same steps again."""
    strategy = FabricDeepSpeedOnCPU(stage=3, process_group_backend="gloo") if ZEROMEM else "ddp"
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    x, y = DATA.tensors
    rank = fabric.global_rank
    fabric.seed_everything(1 + rank)
    with fabric.init_module():
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    losses: list[float] = []

    def steps(first: int, last: int) -> None:
        for i in range(first, last):
            rows = slice(8 * i + 4 * rank, 8 * i + 4 * rank + 4)
            loss = nn.functional.mse_loss(model(x[rows]), y[rows])
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())

    steps(0, 4)
    state = {"model": model, "optimizer": optimizer, "step": 4}
    path = str(OUT / f"{MODE}_fabric.ckpt")
    fabric.save(path, state)
    steps(4, 8)
    trained = list(losses)
    state["step"] = 0
    fabric.load(path, state)
    losses.clear()
    steps(4, 8)
    return {"losses": trained, "resumed": losses, "step": state["step"]}


def main() -> None:
    if MODE == "deepspeed":
        deepspeed_checkpoint()
        return
    results = {"trainer": trainer_runs(), "fabric": fabric_run()}
    if ZEROMEM:  # the group `deepspeed.init_distributed` created is zeromem's to end
        import torch.distributed as dist
        import zeromem
        zeromem.shutdown()
        results["group_ended"] = not dist.is_initialized()
    rank = int(os.environ["RANK"])
    (OUT / f"{MODE}_{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):
        main()
