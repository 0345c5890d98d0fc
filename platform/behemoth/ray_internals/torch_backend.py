"""Ray Train's torch backend without torch in Ray Train's controller. Read against Ray 2.60.0
(ray/train/torch/config.py: TorchConfig, _TorchBackend).

Every fit starts a controller actor, a new process, which unpickles the trainer's backend config before it
starts the workers. Ray's TorchConfig lives in a module that imports torch at its top, so the controller imported
torch (1.5-2.0 s on 2 cores, on the path of every fit's start) only to call functions that run on the workers.
LazyTorchConfig holds the same settings; its backend does in the controller what _TorchBackend.on_start and
on_shutdown do there (pick the backend, ask rank 0 for an address, call the setup on every worker) and has the
workers run Ray's own functions, imported there. TPU process groups are not set up (behemoth trains on GPUs and
CPUs); a TPU backend is refused.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray._common.network_utils import build_address
from ray._private import ray_constants
from ray.exceptions import GetTimeoutError
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
from ray.train.v2._internal.util import TrainingFramework

logger = logging.getLogger(__name__)


def _ray_torch(name: str, **kwargs):
    """Ray's function `name` of ray.train.torch.config, run on a worker (where torch is imported anyway)."""
    from ray.train.torch import config

    return getattr(config, name)(**kwargs)


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


class _DeviceContext:
    """TorchConfigContextManager (a worker's default CUDA device set before the loop), imported where it runs."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager

        self._inner = TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


@dataclass
class LazyTorchConfig(BackendConfig):
    """TorchConfig's fields, meanings and defaults (backend None: nccl on GPUs, else gloo; init_method env or
    tcp; timeout_s for the process group's operations)."""

    backend: str | None = None
    init_method: str = "env"
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return _LazyTorchBackend

    @property
    def train_func_context(self):
        return _DeviceContext

    @property
    def framework(self):
        return TrainingFramework.TORCH

    def to_dict(self) -> dict:
        return {"backend": self.backend, "init_method": self.init_method, "timeout_s": self.timeout_s}


class _LazyTorchBackend(Backend):
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: LazyTorchConfig):
        backend, resources = backend_config.backend, worker_group.get_resources_per_worker()
        if backend is None:
            backend = "nccl" if resources.get("GPU", 0) > 0 else "gloo"
        if backend == "tpu_dist" or resources.get("TPU", 0) > 0:
            raise ValueError("behemoth's torch backend sets up no TPU process group (Ray's TorchConfig does)")
        addr, port = worker_group.execute_single(0, get_address_and_port)
        if backend_config.init_method == "env":
            worker_group.execute(_set_master, addr=addr, port=port)
            url = "env://"
        elif backend_config.init_method == "tcp":
            url = f"tcp://{build_address(addr, port)}"
        else:
            raise ValueError(f"The provided init_method ({backend_config.init_method}) is not supported. Must be "
                             f"either 'env' or 'tcp'.")
        # LOCAL_RANK, RANK, WORLD_SIZE, ... before init_process_group (Ray Train V2's worker groups)
        worker_group.execute(_ray_torch, "_set_torch_distributed_env_vars")
        ray.get([worker_group.execute_single_async(
            i, _ray_torch, "_setup_torch_process_group", backend=backend, world_rank=i,
            world_size=len(worker_group), init_method=url, timeout_s=backend_config.timeout_s)
            for i in range(len(worker_group))])

    def on_shutdown(self, worker_group, backend_config):
        futures = worker_group.execute_async(_ray_torch, "_shutdown_torch",
                                             destroy_process_group=len(worker_group) > 1)
        timeout_s = ray_constants.env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                              DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning(f"Torch process group shutdown timed out after {timeout_s} seconds")
