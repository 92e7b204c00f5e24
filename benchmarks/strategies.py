"""The strategies the suite compares: how each is launched, what its workers run, how
it is labelled and drawn, and whether this machine can run it.

To add a strategy: an entry in STRATEGIES (and, if its workers need new code, a kind
in benchmarks/roles/allreduce.py or benchmarks/roles/fit.py), and a line in
`availability` if it needs something the machine may lack.
"""
from __future__ import annotations

import dataclasses
import shutil
from typing import Dict, Optional

from benchmarks import processes


@dataclasses.dataclass(frozen=True)
class Strategy:
    label: str
    color: str
    launch: str               # processes.LAUNCHES
    comm_kind: Optional[str]  # roles.allreduce --kind; None: roles.async_steps
    fit_kind: str             # roles.fit --kind
    async_mode: str = "push"  # roles.async_steps --comm_modes, with comm_kind None


STRATEGIES: Dict[str, Strategy] = {
    "smb_sync": Strategy("SMB sync", "tab:red", "tf_smb.run", "smb", "smb_sync"),
    "smb_async": Strategy("SMB async", "tab:orange", "tf_smb.run", None, "smb_async"),
    "smb_async_push": Strategy("SMB async read_at=push", "tab:brown", "tf_smb.run", None,
                               "smb_async_push", async_mode="pushread"),
    "horovod_mpi": Strategy("Horovod-MPI", "tab:blue", "mpirun", "horovod", "horovod"),
    "horovod_gloo": Strategy("Horovod-Gloo", "tab:cyan", "horovodrun", "horovod", "horovod"),
    "mwms": Strategy("MWMS-RING", "tab:green", "mwms", "mwms", "mwms"),
    "single": Strategy("one worker", "0.6", "single", None, "single"),  # fit only
}
COMM_STRATEGIES = ("smb_sync", "smb_async", "smb_async_push", "horovod_mpi", "horovod_gloo",
                   "mwms")
FIT_STRATEGIES = ("smb_sync", "smb_async", "horovod_mpi", "horovod_gloo", "mwms", "single")
# The series of the one-worker fit job ("single"): three models in one process.
SINGLE_SERIES = ("none_1", "onedevice_1", "smb_1")
LABELS = {**{name: s.label for name, s in STRATEGIES.items()},
          "memcpy": "memcpy", "none_1": "no strategy (1 worker)",
          "onedevice_1": "OneDeviceStrategy (1 worker)", "smb_1": "SMB sync (1 worker)"}
COLORS = {**{name: s.color for name, s in STRATEGIES.items()},
          "memcpy": "0.4", "none_1": "0.6", "onedevice_1": "tab:purple", "smb_1": "tab:red"}


def availability(info: dict) -> Dict[str, str]:
    """Why each strategy cannot run here ("" when it can), from the probe's `info`."""
    reasons = {s: "" for s in STRATEGIES}
    hint = "install it with `bash tools/install_horovod.sh`"
    if "horovod_error" in info:
        for s in ("horovod_mpi", "horovod_gloo"):
            reasons[s] = f"Horovod not available ({info['horovod_error']}); {hint}"
        return reasons
    if not info.get("horovod_mpi"):
        reasons["horovod_mpi"] = f"Horovod built without MPI; {hint}"
    elif not shutil.which("mpirun"):
        reasons["horovod_mpi"] = "mpirun not found on PATH (Open MPI not installed)"
    if not info.get("horovod_gloo"):
        reasons["horovod_gloo"] = f"Horovod built without Gloo; {hint}"
    elif not processes.horovodrun_path():
        reasons["horovod_gloo"] = "horovodrun not found beside python or on PATH"
    return reasons
