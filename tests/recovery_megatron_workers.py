"""The demo's actor with accessors for the megatron recovery tests (importable by Ray workers)."""

from __future__ import annotations

import os

import torch

from rankmesh.dispatch import Dispatch, register
from rankmesh.megatron.roles import ActorWorker


class TrainActor(ActorWorker):
    """The demo's actor, plus two accessors the tests compare bit by bit."""

    @register(Dispatch.ONE_TO_ALL)
    def state_bytes(self) -> dict:
        opt = self.optimizer.state_dict()
        return {
            "params": {k: v.detach().clone().numpy().tobytes() for k, v in self.stage.state_dict().items()
                       if torch.is_tensor(v)},
            "opt": {i: {k: (v.numpy().tobytes() if torch.is_tensor(v) else v) for k, v in st.items()}
                    for i, st in opt["state"].items()},
            "pid": os.getpid(),
        }
