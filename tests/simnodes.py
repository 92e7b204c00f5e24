"""Simulated nodes on one machine, for cross-node tests (DESIGN.md §6).

Each node has its own network namespace, its own mount namespace with a private
tmpfs on /dev/shm (and on /tmp with `private_tmp`), its own hostname (listed with
the others in its own /etc/hosts) and its own IPC namespace. The nodes (2 to 8)
are joined by a Linux bridge in a network namespace of its own (the "switch"):
each node's interface SIMNET_DEV (the same name on every node, as on a real
cluster) is one end of a veth pair whose other end is a port of the bridge;
addresses of one private /24, reachable from nowhere else. Nothing is added to
the host's namespace. Each node's link can be shaped (`shape_link`). A long-lived holder process (`sleep infinity`) keeps a node's
namespaces; a command enters them with `nsenter -t HOLDER`. Open MPI's mpirun
runs inside node 0 and starts its daemon on the other node through
tests/simnodes_agent.sh, an ssh stand-in. There is no PID namespace: a rank's
pid is the same everywhere, so tests can signal ranks directly.

Every wait has a timeout; on a timeout every process in the nodes is killed,
and leaving the context always removes the holders and namespaces (and with
them the veth pair and the tmpfs).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import harness
import preload

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT = os.path.join(HERE, "simnodes_agent.sh")
SUBNET = "10.231.7"  # node i has SUBNET.(i+1)/24
SIMNET_DEV = "simeth0"  # each node's interface (its own namespace: one name for all)
MAX_NODES = 8
# Variables every rank gets from mpirun (-x), besides those a launch passes.
FORWARD = ("PATH", "HOME", "PYTHONPATH", "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL",
           "LD_LIBRARY_PATH")
TOOLS = ("ip", "unshare", "nsenter", "mpirun")
# Each node's preload fork server (tests/preload.py), in the node's own /dev/shm: a
# rank forked by it runs in that node's namespaces.
NODE_PRELOAD = "/dev/shm/tf_smb-test-preload/socket"


class NodesUnavailable(RuntimeError):
    """This machine cannot make simulated nodes: a tool is missing or the kernel
    refuses a namespace. The message names the command and its error."""


class NodesTimeout(AssertionError):
    """A command in the nodes ran past its timeout (everything was killed)."""


@dataclasses.dataclass
class Launch:
    """How a command in the nodes ended.

    leftovers: "pid cmdline" of processes still in the nodes after the command
    ended (and a short grace), killed since.
    """

    argv: List[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    leftovers: List[str]

    def rank_output(self, rank: int) -> str:
        """What `rank` wrote (stdout, then stderr), without mpirun's tags."""
        return rank_output(rank, self.stdout, self.stderr)

    def untagged_output(self) -> str:
        """What mpirun printed itself (no rank tag): its own errors."""
        return tagged_streams(self.stdout, self.stderr)[1]


# The tag mpirun --tag-output puts before what a rank wrote: [job,rank]<stream>:
_TAG = re.compile(r"\[\d+,(\d+)\]<(stdout|stderr)>:")


def tagged_streams(*texts: str) -> Tuple[Dict[Tuple[int, str], str], str]:
    """What each rank wrote to each stream ({(rank, "stdout"|"stderr"): text}) in
    mpirun --tag-output's output `texts` (its stdout and stderr), and what mpirun
    printed itself. mpirun tags every chunk it forwards and every line within
    one, but a chunk may end mid-line and another rank's chunk come next: a line
    is then split, the second piece tagged on (or after) another rank's line.
    Open MPI's TCP errors flooding a rank's stderr split lines often. So the
    pieces are joined per rank and stream: a piece runs from its tag to the
    next; what follows its first newline carries no tag, so mpirun printed it."""
    streams: Dict[Tuple[int, str], List[str]] = {}
    untagged: List[str] = []
    for text in texts:
        tags = list(_TAG.finditer(text))
        untagged.append(text[:tags[0].start()] if tags else text)
        for i, tag in enumerate(tags):
            piece = text[tag.end():tags[i + 1].start() if i + 1 < len(tags) else len(text)]
            cut = piece.find("\n") + 1 or len(piece)
            streams.setdefault((int(tag.group(1)), tag.group(2)), []).append(piece[:cut])
            untagged.append(piece[cut:])
    return {key: "".join(pieces) for key, pieces in streams.items()}, "".join(untagged)


def rank_outputs(*texts: str) -> Dict[int, str]:
    """What each rank wrote (stdout, then stderr) in mpirun --tag-output's output
    `texts`, its lines whole (see tagged_streams), by rank."""
    streams = tagged_streams(*texts)[0]
    return {rank: streams.get((rank, "stdout"), "") + streams.get((rank, "stderr"), "")
            for rank in {rank for rank, _ in streams}}


def rank_output(rank: int, *texts: str) -> str:
    """What `rank` wrote (stdout, then stderr) in `texts` (see rank_outputs)."""
    return rank_outputs(*texts).get(rank, "")


class Running:
    """A command started in the nodes (see SimulatedNodes.start). One that owns
    the nodes (mpirun) has what remains in them killed when it ends.

    With `drain`, threads read its output as it comes (output() shows it so far):
    a job whose ranks print much (Open MPI's TCP errors after a peer died fill a
    64 KiB pipe in seconds) never blocks mpirun on a full pipe, which would hold
    back the ranks' later lines until mpirun is killed and lose them."""

    def __init__(self, nodes: "SimulatedNodes", argv: List[str], proc: subprocess.Popen,
                 owns_nodes: bool, drain: bool = False):
        self.nodes, self.argv, self.proc, self.owns_nodes = nodes, argv, proc, owns_nodes
        self.started = time.monotonic()
        self._read: Optional[Tuple[List[str], List[str]]] = None
        self._readers: List[threading.Thread] = []
        if drain:
            self._read = ([], [])
            for stream, lines in zip((proc.stdout, proc.stderr), self._read):
                reader = threading.Thread(target=_read_lines, args=(stream, lines), daemon=True)
                reader.start()
                self._readers.append(reader)

    def output(self) -> str:
        """What a draining command printed so far (stdout, then stderr)."""
        assert self._read is not None, "output() needs a Running started with drain"
        return "".join(self._read[0]) + "".join(self._read[1])

    def rank_outputs(self) -> Dict[int, str]:
        """What each rank wrote so far in a draining mpirun (see rank_outputs)."""
        assert self._read is not None, "rank_outputs() needs a Running started with drain"
        return rank_outputs("".join(self._read[0]), "".join(self._read[1]))

    def kill(self) -> Tuple[str, str]:
        """Kills the command (its whole session) and returns its (stdout, stderr)."""
        _killpg(self.proc.pid)
        return self._communicate(30)

    def _communicate(self, timeout: float) -> Tuple[str, str]:
        if self._read is None:
            return self.proc.communicate(timeout=timeout)
        self.proc.wait(timeout=timeout)
        deadline = time.monotonic() + 30  # what is left in the pipes once it ended
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        return "".join(self._read[0]), "".join(self._read[1])

    def wait(self, timeout: float) -> Launch:
        """Waits up to `timeout` s for the command; when it owns the nodes, then
        for what it left in them (3 s), and kills what remains. Raises NodesTimeout
        (with the output) after killing everything in the nodes when the command
        ran too long."""
        try:
            out, err = self._communicate(timeout)
        except subprocess.TimeoutExpired:
            killed = self.nodes.kill_processes()
            out, err = self.kill()
            raise NodesTimeout(
                f"{_show(self.argv)} did not finish within {timeout:.0f}s; killed it and "
                f"{len(killed)} processes in the nodes.\nstdout:\n{out[-6000:]}\n"
                f"stderr:\n{err[-6000:]}") from None
        seconds = time.monotonic() - self.started
        if not self.owns_nodes:
            return Launch(self.argv, self.proc.returncode, out, err, seconds, [])
        deadline = time.monotonic() + 3.0
        while self.nodes.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        return Launch(self.argv, self.proc.returncode, out, err, seconds,
                      self.nodes.kill_processes())


def _read_lines(stream, lines: List[str]) -> None:
    for line in stream:
        lines.append(line)


class SimulatedNodes:
    """Context manager: `nodes` simulated nodes (2 to 8) on one bridge.

    workers: how many workers each node runs by default (an int for every node,
    or one count per node, e.g. [2, 1]): the hostfile's slots of `mpirun`,
    `launch_workers`' layout. private_tmp: each node gets its own /tmp (Slurm's
    PMIx needs one; results then go through a shared folder elsewhere).
    Names carry this process's id, so parallel test runs do not collide.
    Raises NodesUnavailable on entry when the machine cannot make them.
    """

    _made = 0  # instances so far in this process: part of their names

    def __init__(self, nodes: int = 2, workers: "int | Sequence[int]" = 1,
                 subnet: str = SUBNET, private_tmp: bool = False):
        if not 2 <= nodes <= MAX_NODES:
            raise ValueError(f"SimulatedNodes makes 2 to {MAX_NODES} nodes, got {nodes}")
        self.workers = [workers] * nodes if isinstance(workers, int) else list(workers)
        if len(self.workers) != nodes or min(self.workers) < 1:
            raise ValueError(f"workers must be a count >= 1 for each of the {nodes} nodes, "
                             f"got {workers!r}")
        SimulatedNodes._made += 1
        tag = f"{os.getpid()}{chr(ord('a') + SimulatedNodes._made % 26)}"
        self.count = nodes
        self.private_tmp = private_tmp
        self.netns = [f"smbsim{tag}n{i}" for i in range(nodes)]
        self.switch = f"smbsim{tag}sw"  # the bridge's namespace
        self.hostnames = [f"simnode{i}-{tag}" for i in range(nodes)]
        self.addresses = [f"{subnet}.{i + 1}" for i in range(nodes)]
        self.cidr = f"{subnet}.0/24"
        self.veth = [SIMNET_DEV] * nodes  # each node's end, in its namespace
        self.ports = [f"port{i}" for i in range(nodes)]  # the bridge's ends, in the switch
        self.holders: List[subprocess.Popen] = []
        self.holder_pids: List[int] = []
        self.dir = ""
        self._netns_links: List[str] = []
        self.preload_pids: List[int] = []  # each node's preload server, once started
        self._preload_servers: List[Running] = []
        self._preload_failed = False

    # --- setup and teardown -------------------------------------------------

    def __enter__(self) -> "SimulatedNodes":
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        for tool in TOOLS:
            if not shutil.which(tool):
                raise NodesUnavailable(f"`{tool}` is not installed (needed for simulated nodes)")
        reap_stale()
        self.dir = tempfile.mkdtemp(prefix=f"simnodes-{os.getpid()}-")
        _setup_cmd(["ip", "netns", "add", self.switch])
        _setup_cmd(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _setup_cmd(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for ns, port, dev, addr in zip(self.netns, self.ports, self.veth, self.addresses):
            _setup_cmd(["ip", "netns", "add", ns])
            _setup_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            _setup_cmd(["ip", "-n", self.switch, "link", "add", port, "type", "veth",
                        "peer", "name", dev, "netns", ns])
            _setup_cmd(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
            _setup_cmd(["ip", "-n", self.switch, "link", "set", port, "up"])
            _setup_cmd(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            _setup_cmd(["ip", "-n", ns, "link", "set", dev, "up"])
        with open(os.path.join(self.dir, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames))
        for ns, host in zip(self.netns, self.hostnames):
            self._start_holder(ns, host)
        self._netns_links = [os.readlink(f"/proc/{p}/ns/net") for p in self.holder_pids]
        with open(self.agent_map, "w") as f:
            f.writelines(f"{a} {p}\n{h} {p}\n" for a, h, p in
                         zip(self.addresses, self.hostnames, self.holder_pids))

    def _start_holder(self, ns: str, hostname: str) -> None:
        hosts = os.path.join(self.dir, "hosts")
        tmp = ""
        if self.private_tmp:
            # The node's own /tmp, but what the nodes run from stays visible: the
            # machine's /tmp is kept at /mnt (in this mount namespace only) and
            # the folders under it that hold the checkout, the Python
            # environment and this cluster's files are bound back in place.
            real = [os.path.realpath(p) for p in (harness.REPO, sys.prefix, self.dir)]
            keep = sorted({"/tmp/" + p.split("/")[2] for p in real if p.startswith("/tmp/")})
            tmp = "mount --bind /tmp /mnt && mount -t tmpfs -o mode=1777 tmpfs /tmp && "
            tmp += "".join(f"mkdir -p {k} && mount --bind /mnt/{k[len('/tmp/'):]} {k} && "
                           for k in keep)
        # /etc/hosts first: its source is under the machine's /tmp, which a
        # private /tmp would hide.
        script = (f"mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
                  f"mount --bind {hosts} /etc/hosts && {tmp}hostname {hostname} "
                  "&& echo ready $$ && exec sleep infinity")
        argv = ["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "--ipc",
                "--propagation", "private", "sh", "-c", script]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        self.holders.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], 10.0)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("ready "):
            _killpg(proc.pid)
            _, err = proc.communicate(timeout=10)
            raise NodesUnavailable(f"`{_show(argv)}` failed: {err.strip() or 'no answer in 10s'}")
        self.holder_pids.append(int(line.split()[1]))

    def close(self) -> None:
        """Kills every process in the nodes and the holders, deletes the namespaces
        (so the veth pair and the tmpfs go too) and the temporary folder."""
        self.kill_processes(holders=True)
        for proc in [s.proc for s in self._preload_servers] + self.holders:
            _killpg(proc.pid)
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                  timeout=30).stdout if shutil.which("ip") else ""
        for ns in [*self.netns, self.switch]:
            if re.search(rf"^{ns}\b", existing, re.M):
                subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def agent_map(self) -> str:
        """The file of "HOST HOLDER_PID" lines simnodes_agent.sh reads."""
        return os.path.join(self.dir, "agent_map")

    # --- processes in the nodes ---------------------------------------------

    def python(self) -> List[str]:
        """How ranks in the nodes start Python: a client of their node's preload
        fork server (TensorFlow imported once; started here on first use), or the
        plain interpreter with TF_SMB_TEST_FRESH=1 or where a server did not start.
        Such a rank's worker is the server's child, not the client's: signal it
        through the client only with signals the client relays (not SIGSTOP)."""
        if os.environ.get(harness.FRESH_VAR) == "1" or self._preload_failed:
            return [sys.executable]
        if not self.preload_pids:
            env = preload.server_env({k: v for k, v in harness.base_env().items()
                                      if k != preload.SOCKET_VAR})
            for node in range(self.count):
                server = self.start(node, preload.serve_argv(NODE_PRELOAD), env)
                try:
                    preload.wait_ready(server.proc.stdout, 120)
                except RuntimeError:
                    self._preload_failed = True
                    self.kill_processes(holders=True, only=[server.proc.pid, *self.preload_pids])
                    self.preload_pids = []
                    return [sys.executable]
                self.preload_pids.append(server.proc.pid)
                self._preload_servers.append(server)
        return [sys.executable, "-S", preload.CLIENT]

    def preload_env(self, python: Sequence[str]) -> Dict[str, str]:
        """What a rank started with `python` (from `python()`) needs in its environment."""
        return {preload.SOCKET_VAR: NODE_PRELOAD} if preload.CLIENT in python else {}

    def processes(self, holders: bool = False) -> List[Tuple[int, str]]:
        """(pid, cmdline) of every process in the nodes' network namespaces; the
        holders and preload servers only with `holders`."""
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or (not holders and (int(name) in self.holder_pids
                                                       or int(name) in self.preload_pids)):
                continue
            try:
                if os.readlink(f"/proc/{name}/ns/net") not in self._netns_links:
                    continue
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:  # gone, or a zombie
                continue
            found.append((int(name), cmd))
        return found

    def kill_processes(self, holders: bool = False,
                       only: Optional[Sequence[int]] = None) -> List[str]:
        """SIGKILLs every process in the nodes (not the holders and preload servers
        unless told; of `only`'s pids, when given) until none is left (10 s at
        most); "pid cmdline" of those killed."""
        killed: Dict[int, str] = {}
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            found = [(pid, cmd) for pid, cmd in self.processes(holders)
                     if only is None or pid in only]
            if not found:
                break
            for pid, cmd in found:
                killed.setdefault(pid, cmd)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        return [f"{pid} {cmd}" for pid, cmd in killed.items()]

    def kill_in_node(self, node: int, match: str, sig: int = signal.SIGKILL) -> List[int]:
        """Sends `sig` to the processes of node `node` whose command line
        contains `match` (a node dying, or stalling with SIGSTOP, while mpirun
        in node 0 lives on); their pids."""
        holder_link = os.readlink(f"/proc/{self.holder_pids[node]}/ns/net")
        found = []
        for pid, cmd in self.processes():
            try:
                if os.readlink(f"/proc/{pid}/ns/net") == holder_link and match in cmd:
                    found.append(pid)
            except OSError:
                pass
        # A node dies at once: stopped first, none of them sees another die
        # (and reports it to the other nodes) before the kill reaches it too.
        signals = [signal.SIGSTOP, sig] if sig == signal.SIGKILL else [sig]
        killed = []
        for each in signals:
            killed = []
            for pid in found:
                try:
                    os.kill(pid, each)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
        return killed

    # --- the links ------------------------------------------------------------

    def shape_link(self, node: int, rate: Optional[str], burst: str = "1mb",
                   latency: str = "1ms") -> None:
        """Shapes node `node`'s link to `rate` (tc's units, e.g. "1gbit") both
        ways: a token bucket on the node's interface (what it sends) and on its
        bridge port (what it receives). None: unshaped again."""
        for ns, dev in ((self.netns[node], self.veth[node]), (self.switch, self.ports[node])):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=30)  # fails when there is none
            if rate is not None:
                _setup_cmd(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                            "tbf", "rate", rate, "burst", burst, "latency", latency])

    def bytes_sent(self, node: int) -> int:
        """Bytes node `node` has sent on its link so far (its interface's counter)."""
        with open(f"/proc/{self.holder_pids[node]}/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == self.veth[node]:
                    return int(rest.split()[8])
        raise RuntimeError(f"node {node} has no interface {self.veth[node]}")

    # --- running commands ---------------------------------------------------

    def start(self, node: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
              cwd: Optional[str] = None, owns_nodes: bool = False,
              drain: bool = False) -> Running:
        """Starts `argv` inside node `node` (in a session of its own), output
        captured (read as it comes with `drain`, see Running); env default:
        harness.base_env(); cwd default: the checkout."""
        full = ["nsenter", "-t", str(self.holder_pids[node]), "--net", "--mount", "--uts",
                "--ipc", f"--wd={cwd or harness.REPO}", "--", *argv]
        proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                                env=dict(env) if env is not None else harness.base_env())
        return Running(self, full, proc, owns_nodes, drain)

    def run(self, node: int, argv: Sequence[str], timeout: float = 60,
            env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> Launch:
        """Runs `argv` inside node `node` and waits for it (see Running.wait)."""
        return self.start(node, argv, env, cwd).wait(timeout)

    def layout(self, per_node: "Optional[int | Sequence[int]]" = None) -> List[int]:
        """Workers on each node: `per_node` (one count for all, or one per node,
        0 leaving a node out of the job), else what the nodes were made with."""
        if per_node is None:
            return list(self.workers)
        counts = [per_node] * self.count if isinstance(per_node, int) else list(per_node)
        if len(counts) != self.count or min(counts) < 0 or sum(counts) < 1:
            raise ValueError(f"expected a worker count >= 0 for each of the {self.count} "
                             f"nodes, got {counts}")
        return counts

    def hostfile(self, per_node: "Optional[int | Sequence[int]]" = None) -> str:
        """A hostfile giving each node its slots (see layout)."""
        counts = self.layout(per_node)
        path = os.path.join(self.dir, "hostfile-" + "-".join(map(str, counts)))
        with open(path, "w") as f:
            # (A node given no workers is left out: the job runs on the others.)
            f.writelines(f"{a} slots={n}\n" for a, n in zip(self.addresses, counts) if n)
        return path

    def mpirun_argv(self, np_: int, per_node: "Optional[int | Sequence[int]]",
                    argv: Sequence[str], forward: Sequence[str] = (),
                    extra_mca: Sequence[Tuple[str, str]] = ()) -> List[str]:
        """`mpirun` across the nodes, `per_node` slots each (see layout), ranks
        filling node 0 first; forwards the `forward` variables to every rank (-x)."""
        hostfile = self.hostfile(per_node)
        out = [shutil.which("mpirun") or "mpirun", "--allow-run-as-root", "--tag-output",
               "-np", str(np_), "--hostfile", hostfile, *self.mpirun_options(extra_mca)]
        for name in dict.fromkeys(forward):
            out += ["-x", name]
        return out + list(argv)

    def mpirun_options(self, extra_mca: Sequence[Tuple[str, str]] = ()) -> List[str]:
        """What mpirun needs to run across the nodes (also tf_smb.run --mpi-args)."""
        mca = [("plm_rsh_agent", f"{AGENT} {self.agent_map}"),
               ("btl", "tcp,self,vader"), ("btl_tcp_if_include", self.cidr),
               ("oob_tcp_if_include", self.cidr), ("mpi_yield_when_idle", "1"),
               *extra_mca]
        # Unbound: each node's mpirun daemon would bind its first rank to core 0, and
        # the simulated nodes share this machine's cores, so one rank per node
        # would put every rank on the same core (half speed at 2 x 1); real nodes
        # each have their own core 0.
        out = ["--bind-to", "none"]
        for key, value in mca:
            out += ["--mca", key, value]
        return out

    def start_mpirun(self, np_: int, per_node: "Optional[int | Sequence[int]]", argv: Sequence[str],
                     env: Optional[Mapping[str, str]] = None,
                     extra_mca: Sequence[Tuple[str, str]] = (),
                     cwd: Optional[str] = None) -> Running:
        """Starts mpirun in node 0, owning the nodes, its output read as it comes
        (see Running). Its environment:
        harness.base_env() without launcher or TF_SMB_ variables, then `env`, whose
        variables reach every rank; `cwd`: the ranks' working folder (the checkout)."""
        e = {k: v for k, v in harness.base_env().items()
             if not k.startswith("TF_SMB_") and k not in harness.env_lib.LAUNCHER_VARS}
        e.update(env or {})
        forward = [k for k in FORWARD if k in e] + list(env or {})
        return self.start(0, self.mpirun_argv(np_, per_node, argv, forward, extra_mca), e,
                          cwd=cwd, owns_nodes=True, drain=True)

    def mpirun(self, np_: int, per_node: "Optional[int | Sequence[int]]", argv: Sequence[str], timeout: float,
               env: Optional[Mapping[str, str]] = None,
               extra_mca: Sequence[Tuple[str, str]] = (),
               cwd: Optional[str] = None) -> Launch:
        """Runs mpirun across the nodes and waits up to `timeout` s."""
        return self.start_mpirun(np_, per_node, argv, env, extra_mca, cwd).wait(timeout)


def reap_stale() -> List[str]:
    """Deletes simulated nodes left by test processes that no longer exist (killed
    before their teardown ran): their processes, namespaces and temporary folders."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=30).stdout
    reaped = []
    for ns, pid in re.findall(r"^(smbsim(\d+)[a-z](?:n\d+|sw))\b", listed, re.M):
        if os.path.exists(f"/proc/{pid}"):
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                              timeout=30).stdout.split()
        for p in pids:
            try:
                os.kill(int(p), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        reaped.append(ns)
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        m = re.match(r"simnodes-(\d+)-", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
            reaped.append(name)
    return reaped


def launch_workers(nodes: SimulatedNodes, per_node: "Optional[int | Sequence[int]]", args: Sequence[str], timeout: float,
                   result_dir: str, env: Optional[Mapping[str, str]] = None,
                   preload: bool = True) -> Tuple[Launch, List[dict]]:
    """Runs `python args... --result_dir DIR` on per_node ranks of every node
    (an int, one count per node, or None: the nodes' own layout)
    (like harness.run_mpirun); the launch (for the ranks' output) and each rank's
    result file, by rank. Fails naming every rank without a result (every rank
    when mpirun failed though all wrote one), with its output. `preload=False`:
    plain interpreters, not the nodes' preload servers."""
    np_ = sum(nodes.layout(per_node))
    python = nodes.python() if preload else [sys.executable]
    launch = nodes.mpirun(np_, per_node, [*python, *args, "--result_dir", result_dir],
                          timeout, {**nodes.preload_env(python), **(env or {})})
    results, missing = [], []
    for rank in range(np_):
        path = os.path.join(result_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            missing.append(rank)
    if launch.returncode != 0 or missing:
        raise AssertionError(describe_failure(launch, missing or list(range(np_))))
    return launch, results


def run_workers(nodes: SimulatedNodes, per_node: "Optional[int | Sequence[int]]", args: Sequence[str], timeout: float,
                result_dir: str, env: Optional[Mapping[str, str]] = None,
                preload: bool = True) -> List[dict]:
    """launch_workers' results alone."""
    return launch_workers(nodes, per_node, args, timeout, result_dir, env, preload)[1]


def describe_failure(launch: Launch, ranks: Sequence[int]) -> str:
    """mpirun's exit code and own messages, and the output of each rank in `ranks`."""
    parts = [f"mpirun exited with {launch.returncode} after {launch.seconds:.0f}s; "
             f"ranks without a result: {list(ranks)}"]
    for rank in ranks:
        parts.append(f"--- rank {rank} output:\n{launch.rank_output(rank)[-3000:]}")
    parts.append(f"--- mpirun's own output:\n{launch.untagged_output()[-3000:]}")
    return "\n".join(parts)


def open_or_skip(**kwargs: object) -> SimulatedNodes:
    """Entered SimulatedNodes; skips the test when the machine cannot make them,
    but fails instead when CI=true (a skip must not hide a broken CI)."""
    import pytest  # pylint: disable=import-outside-toplevel
    try:
        return SimulatedNodes(**kwargs).__enter__()  # type: ignore[arg-type]
    except NodesUnavailable as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but simulated nodes cannot be made: {e}")
        pytest.skip(f"simulated nodes cannot be made here: {e}")
        raise  # unreachable


def _setup_cmd(argv: List[str]) -> None:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NodesUnavailable(f"`{_show(argv)}` failed: {e}") from e
    if p.returncode != 0:
        raise NodesUnavailable(f"`{_show(argv)}` failed (exit {p.returncode}): "
                               f"{p.stderr.strip()}")


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _show(argv: Sequence[str]) -> str:
    return " ".join(argv)
