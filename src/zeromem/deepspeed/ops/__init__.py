"""DeepSpeed's `deepspeed.ops` optimizers, as the torch optimizers that compute the same update.

Scripts build them before `initialize` (DeepSpeed-Chat's `FusedAdam` / `DeepSpeedCPUAdam`),
and Accelerate swaps a torch optimizer for `DeepSpeedCPUAdam` / `DeepSpeedCPUAdagrad` when
the optimizer is offloaded. zeromem then steps them over its master shards like any client
optimizer (`zeromem.optim.factory.over_masters`); DeepSpeed's C++/CUDA kernels are not needed.
"""
from . import adagrad, adam, lion

__all__ = ["adam", "adagrad", "lion"]
