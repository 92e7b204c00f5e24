"""A real Slurm cluster on simulated nodes (tests/simnodes.py), for tests.

Debian's slurmctld runs in node 0 and a slurmd in every node (its NodeName is the
node's hostname, its NodeAddr the node's address); one munged, in node 0, serves
them all through a socket in a folder every node sees. The configuration
(DESIGN.md §8, measured with Slurm 22.05) lives in that folder too, bind-mounted
on /etc/slurm inside the nodes only, so clients (sinfo, srun, sbatch) run inside
a node find it as on a real cluster and nothing on the machine changes.

The folder is under /var/tmp, not /tmp: PMIx needs each node to have its own /tmp
(`SimulatedNodes(private_tmp=True)`; with a shared one the second node fails with
`Cannot create directory "/tmp/spmix_appdir_...": File exists`), so what the nodes
share (configuration, spool, logs, job results) must live elsewhere.

Every wait has a timeout; leaving the context kills every process in the nodes
(daemons and jobs) and removes the folder, on failure too.
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from typing import Dict, List, Mapping, Optional, Sequence

import simnodes

# What the daemons and clients need (Debian: slurmctld slurmd slurm-client munge;
# the MPI plugins come with slurm-wlm-basic-plugins).
TOOLS = ("munged", "mungekey", "setpriv", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue")
MPI_PLUGIN_DIR = "/usr/lib/x86_64-linux-gnu/slurm-wlm"
SHARED_ROOT = "/var/tmp"  # outside /tmp, which each node has its own of


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed here (the message names what is missing)."""


def missing_tools() -> List[str]:
    """The Slurm and munge tools (and the PMIx plugin) this machine lacks."""
    missing = [tool for tool in TOOLS if not shutil.which(tool)]
    if not os.path.exists(os.path.join(MPI_PLUGIN_DIR, "mpi_pmix.so")):
        missing.append(f"{MPI_PLUGIN_DIR}/mpi_pmix.so (slurm-wlm-basic-plugins)")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        missing.append("the munge user (package munge)")
    return missing


class SlurmCluster:
    """Context manager: slurmctld, slurmd on every node of `nodes` and munged,
    each node offering `cpus` CPUs (more than the machine has is fine: the config
    overrides what slurmd finds, and tasks need a CPU each or wait forever).

    Attributes once entered: dir (the shared folder), results (an empty folder
    in it for jobs to write to), conf (slurm.conf's path), partition.
    """

    partition = "simnodes"

    def __init__(self, nodes: simnodes.SimulatedNodes, cpus: int = 4, timeout: float = 60):
        if not nodes.private_tmp:
            raise ValueError("Slurm's PMIx needs SimulatedNodes(private_tmp=True)")
        self.nodes, self.cpus, self.timeout = nodes, cpus, timeout
        self.dir = self.results = self.conf = ""
        self._daemons: List[simnodes.Running] = []

    # --- setup and teardown ---------------------------------------------------

    def __enter__(self) -> "SlurmCluster":
        missing = missing_tools()
        if missing:
            raise SlurmUnavailable("missing: " + ", ".join(missing))
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        self.dir = tempfile.mkdtemp(prefix=f"tf_smb-slurm-{os.getpid()}-", dir=SHARED_ROOT)
        os.chmod(self.dir, 0o755)  # munged refuses a socket under a folder others can write
        for sub in ("etc", "state", "log", "results", "munge"):
            os.makedirs(os.path.join(self.dir, sub))
        for host in self.nodes.hostnames:
            os.makedirs(os.path.join(self.dir, "spool", host))
        self.results = os.path.join(self.dir, "results")
        os.chmod(self.results, 0o777)  # jobs run as root here, but say what it is for
        self._start_munged()
        self.conf = os.path.join(self.dir, "etc", "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(self.config())
        # slurmd loads a cgroup plugin even with task/none and proctrack/linuxproc,
        # and its autodetection fails in a node ("No filesystem mounted on
        # /sys/fs/cgroup": `ip netns exec` gives the node a sysfs of its own).
        with open(os.path.join(self.dir, "etc", "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\n")
        for node in range(self.nodes.count):
            mounted = self.nodes.run(node, ["mount", "--bind", os.path.join(self.dir, "etc"),
                                            "/etc/slurm"], timeout=30)
            if mounted.returncode != 0:
                raise RuntimeError(f"node {node}: mounting the config on /etc/slurm failed: "
                                   f"{mounted.stderr.strip()}")
        self._daemons.append(self.nodes.start(0, ["slurmctld", "-D", "-i"]))
        for node, host in enumerate(self.nodes.hostnames):
            self._daemons.append(self.nodes.start(node, ["slurmd", "-D", "-N", host]))
        self.wait_idle()

    def _start_munged(self) -> None:
        """One munged (as the munge user, which it insists on) with its own key
        and socket in the shared folder: Slurm's daemons on every node reach it
        there (AuthInfo=socket=...), and the machine's own munged, if any, is
        left alone."""
        folder = os.path.join(self.dir, "munge")
        key = os.path.join(folder, "munge.key")
        made = subprocess.run(["mungekey", "--create", "--keyfile", key], capture_output=True,
                              text=True, timeout=30)
        if made.returncode != 0:
            raise RuntimeError(f"mungekey failed: {made.stderr.strip()}")
        munge = pwd.getpwnam("munge")
        for path in (folder, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        os.chmod(folder, 0o755)
        os.chmod(key, 0o600)
        self.munge_socket = os.path.join(folder, "munge.socket")
        argv = ["setpriv", f"--reuid={munge.pw_uid}", f"--regid={munge.pw_gid}",
                "--clear-groups", "munged", "--foreground", f"--socket={self.munge_socket}",
                f"--key-file={key}", f"--log-file={folder}/munged.log",
                f"--pid-file={folder}/munged.pid", f"--seed-file={folder}/munged.seed"]
        self._daemons.append(self.nodes.start(0, argv))
        self._wait(lambda: os.path.exists(self.munge_socket), "munged's socket",
                   lambda: self._log(f"{folder}/munged.log"))

    def config(self) -> str:
        """slurm.conf for these nodes. Each line is one DESIGN.md §8 found needed."""
        d = self.dir
        lines = [
            "ClusterName=tfsmb",
            f"SlurmctldHost={self.nodes.hostnames[0]}({self.nodes.addresses[0]})",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            # Root daemons, no cgroups (the nodes share the machine's cgroup tree).
            "SlurmUser=root", "SlurmdUser=root",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            # The configured CPUs count, not the machine's (2 cores for 4 tasks).
            "SlurmdParameters=config_overrides",
            "ReturnToService=2", "MpiDefault=none",
            # Every node its own spool, pid and log (%n: the node's name).
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=5",
        ]
        lines += [f"NodeName={h} NodeAddr={a} CPUs={self.cpus} State=UNKNOWN"
                  for h, a in zip(self.nodes.hostnames, self.nodes.addresses)]
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES "
                     "MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        """Kills every process in the nodes (jobs and daemons, munged last since
        the others need it to say goodbye) and removes the shared folder."""
        self.nodes.kill_processes()
        for daemon in self._daemons:
            daemon.kill()
        self._daemons = []
        for node in range(self.nodes.count):
            try:  # the mount goes with the node's namespace anyway; this is tidiness
                self.nodes.run(node, ["umount", "/etc/slurm"], timeout=30)
            except simnodes.NodesTimeout:
                pass
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # --- waiting and logs -------------------------------------------------------

    def _wait(self, ready, what: str, explain) -> None:
        deadline = time.monotonic() + self.timeout
        while not ready():
            for daemon in self._daemons:
                if daemon.proc.poll() is not None:
                    out, err = daemon.proc.communicate(timeout=10)
                    raise RuntimeError(
                        f"waiting for {what}: `{' '.join(daemon.argv[-6:])}` exited with "
                        f"{daemon.proc.returncode}: {(out + err).strip()[-2000:]}\n{explain()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {self.timeout:.0f}s\n{explain()}")
            time.sleep(0.2)

    def wait_idle(self) -> None:
        """Waits until sinfo (in node 0) shows every node idle."""
        def idle() -> bool:
            shown = self.client(["sinfo", "--noheader", "-N", "-o", "%N %t"], timeout=30)
            states = dict(line.split() for line in shown.stdout.splitlines() if line.strip())
            return all(states.get(h) == "idle" for h in self.nodes.hostnames)
        self._wait(idle, "idle nodes in sinfo", self.logs)

    def _log(self, path: str, chars: int = 2000) -> str:
        try:
            with open(path, errors="replace") as f:
                return f"--- {os.path.basename(path)}:\n{f.read()[-chars:]}"
        except OSError as e:
            return f"--- {os.path.basename(path)}: {e}"

    def logs(self, chars: int = 2000) -> str:
        """The end of every daemon's log (for failure messages)."""
        log = os.path.join(self.dir, "log")
        names = sorted(os.listdir(log)) if os.path.isdir(log) else []
        return "\n".join(self._log(os.path.join(log, n), chars) for n in names)

    # --- running things -----------------------------------------------------------

    def client(self, argv: Sequence[str], timeout: float = 60, node: int = 0,
               env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None
               ) -> simnodes.Launch:
        """Runs a Slurm client command (sinfo, srun, sbatch, ...) inside `node`."""
        return self.nodes.run(node, list(argv), timeout=timeout, env=env, cwd=cwd)

    def wait_job(self, job_id: str, timeout: float) -> str:
        """Waits until job `job_id` left the queue; its state (from the
        controller's memory: there is no accounting database here)."""
        deadline = time.monotonic() + timeout
        while True:
            shown = self.client(["scontrol", "-o", "show", "job", job_id], timeout=30)
            fields: Dict[str, str] = dict(
                word.split("=", 1) for word in shown.stdout.split() if "=" in word)
            state = fields.get("JobState", "")
            if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return state
            if time.monotonic() > deadline:
                self.client(["scancel", job_id], timeout=30)
                raise TimeoutError(f"job {job_id} still {state or '?'} after {timeout:.0f}s; "
                                   f"cancelled\n{self.logs()}")
            time.sleep(0.5)
