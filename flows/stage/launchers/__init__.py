"""The engines that run stages (`infra.launcher`), behind one interface
(`flows.stage.launchers.base`).

`launcher_for` picks a stage's engine from its plan: `local` for ingest and for the local
launcher, else the recipe's. The engines' modules are imported only when used: the Kubernetes
client is an optional dependency.
"""

from __future__ import annotations

from flows.stage.launchers.base import Launcher
from posttrain.runtime.spec import PlannedStage


def launcher_for(stage: PlannedStage) -> Launcher:
    """The engine that runs `stage`, configured from the infra section it was planned with."""
    if stage.launcher == "local":
        from flows.stage.launchers.local import LocalLauncher

        return LocalLauncher()
    if stage.launcher == "slurm":
        from flows.stage.launchers.slurm import SlurmLauncher

        return SlurmLauncher.from_infra(stage.infra)
    if stage.launcher == "kubernetes":
        from flows.stage.launchers.kubernetes import KubernetesLauncher

        return KubernetesLauncher.from_infra(stage.infra)
    raise ValueError(f"unknown launcher {stage.launcher!r}")
