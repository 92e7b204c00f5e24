"""tf_smb opens no listening socket of its own (issue 8, point 5; README "Across
nodes": all traffic between nodes is Open MPI's).

A process's TCP/UDP sockets are read from /proc: the socket inodes of
/proc/<pid>/fd, looked up in /proc/<pid>/net/{tcp,tcp6,udp,udp6} (the tables of
the process's own network namespace, so a rank in a simulated node is seen in
its node). A socket is *exposed* when it is a TCP socket in state LISTEN (0A) or
a UDP socket bound to a port (any local port but 0).

* One node, no MPI: a 2-worker sync `model.fit` under `tf_smb.run -np 2`,
  paused mid-training: neither the launcher nor any worker (nor anything they
  started) has an exposed socket.
* Two simulated nodes x 2 workers under mpirun (tests/simnodes.py): Open MPI
  itself listens inside every rank (its TCP BTL). Each tf_smb rank may hold no
  more exposed sockets, per address family, than the same rank of a reference
  MPI program (tests/workers/mpi_reference.c: MPI_Init_thread, a barrier, a
  wait) launched with the same mpirun options across the same nodes, and none
  on an address outside the veth network the MCA settings name
  (btl_tcp_if_include / oob_tcp_if_include), except the wildcard address when
  the reference holds it too (measured with Open MPI 4.1.4: the TCP BTL listens
  on 0.0.0.0 and :: whatever btl_tcp_if_include says; see the test).
* The source: cc/ calls no socket()/bind()/listen()/accept() and includes no
  socket header; tf_smb/ imports no socket or server module and calls no
  server function; the built extensions in tf_smb/ import no socket function.
  Each check is also run on planted code (or a planted listener) to show it
  fails when it must.
"""
from __future__ import annotations

import ast
import collections
import dataclasses
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Dict, Iterable, List, Optional, Sequence

import pytest

from harness import REPO, WORKERS, base_env
from simnodes import describe_failure

WORKER = os.path.join(WORKERS, "socket_worker.py")
REFERENCE_C = os.path.join(WORKERS, "mpi_reference.c")
START_TIMEOUT = 180  # s until every worker paused (TensorFlow start on a busy 2-core machine)
PAUSE_TIMEOUT = 240  # s a paused worker waits for "go" before it gives up (exit 3)
END_TIMEOUT = 120  # s from "go" to the job's end

# --- a process's sockets, from /proc --------------------------------------------

TABLES = {"tcp": socket.AF_INET, "tcp6": socket.AF_INET6,
          "udp": socket.AF_INET, "udp6": socket.AF_INET6}
TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
              "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
              "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}
UDP_STATES = {"01": "connected", "07": "unconnected"}


@dataclasses.dataclass(frozen=True)
class Sock:
    table: str  # tcp, tcp6, udp, udp6
    local: str  # address
    port: int
    remote: str
    remote_port: int
    state: str  # the kernel's hex state (0A: LISTEN)
    inode: int

    @property
    def exposed(self) -> bool:
        """A listening TCP socket, or a UDP socket bound to a port."""
        return self.state == "0A" if self.table.startswith("tcp") else self.port != 0

    @property
    def wildcard(self) -> bool:
        return ipaddress.ip_address(self.local).is_unspecified

    def __str__(self) -> str:
        states = TCP_STATES if self.table.startswith("tcp") else UDP_STATES
        text = f"{self.table} {_endpoint(self.local, self.port)} {states.get(self.state, self.state)}"
        if self.remote_port:
            text += f" to {_endpoint(self.remote, self.remote_port)}"
        return text


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _decode(hexaddr: str, family: int):
    """'0100007F:0016' -> ('127.0.0.1', 22): the kernel prints each 32-bit word
    of the address in host (little-endian) order, the port in plain hex."""
    address, port = hexaddr.split(":")
    raw = b"".join(struct.pack("<I", int(address[i:i + 8], 16))
                   for i in range(0, len(address), 8))
    return socket.inet_ntop(family, raw), int(port, 16)


def socket_inodes(pid: int) -> set:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def inet_sockets(pid: int) -> List[Sock]:
    """Every TCP/UDP socket (IPv4 and IPv6) open in process `pid`."""
    inodes = socket_inodes(pid)
    found = []
    for table, family in TABLES.items():
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)  # header
            for line in f:
                cols = line.split()
                inode = int(cols[9])
                if inode in inodes:
                    local, port = _decode(cols[1], family)
                    remote, remote_port = _decode(cols[2], family)
                    found.append(Sock(table, local, port, remote, remote_port, cols[3], inode))
    return found


def exposed_sockets(pid: int) -> List[Sock]:
    return [s for s in inet_sockets(pid) if s.exposed]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> List[int]:
    """`root` and every live process below it."""
    children: Dict[int, List[int]] = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children[ppid].append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _show(socks: Iterable[Sock]) -> str:
    return ", ".join(str(s) for s in socks) or "none"


def test_inspection_sees_listeners_and_bound_udp(tmp_path):
    """The check itself: of a process with a TCP listener, a bound UDP socket, an
    unbound UDP socket and a connected TCP client, the first two are exposed."""
    code = r"""
import socket, sys
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(1)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 0))
idle = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
c = socket.create_connection(l.getsockname(), timeout=5)
print(l.getsockname()[1], u.getsockname()[1], flush=True)
sys.stdin.read()
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        tcp_port, udp_port = map(int, proc.stdout.readline().split())
        socks = inet_sockets(proc.pid)
        exposed = sorted(str(s) for s in socks if s.exposed)
        assert exposed == sorted([f"tcp 127.0.0.1:{tcp_port} LISTEN",
                                  f"udp 127.0.0.1:{udp_port} unconnected"]), _show(socks)
        # the client's connection is seen (not exposed); an unbound UDP socket is in
        # no table at all; the server side, never accepted, holds no descriptor
        assert len(socks) == 3 and f"to 127.0.0.1:{tcp_port}" in _show(socks), _show(socks)
    finally:
        _killpg(proc.pid)
        proc.communicate(timeout=30)


# --- one node, no MPI -------------------------------------------------------------


def _one_node_offenders(tmp_path, plant: bool = False) -> List[str]:
    """Runs `tf_smb.run -np 2` with a sync fit paused mid-training; "who holds
    what" for every exposed socket of the launcher and every process below it
    (the workers) at the pause. Then lets the job finish and checks it did."""
    out_path = tmp_path / "launcher.log"
    env = {k: v for k, v in base_env({"TF_SMB_TIMEOUT": "120"}).items()
           if not k.startswith(("OMPI_", "PMIX_"))}
    argv = [sys.executable, "-m", "tf_smb.run", "-np", "2", sys.executable, WORKER,
            str(tmp_path), "--timeout", str(PAUSE_TIMEOUT)] + (["--plant_listener"] * plant)
    started: Dict[int, dict] = {}
    with open(out_path, "w") as out:
        launcher = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
    try:
        started = _wait_started(tmp_path, 2, START_TIMEOUT, lambda: launcher.poll() is None,
                                lambda: out_path.read_text()[-4000:])
        tree = descendants(launcher.pid)
        for rank, info in started.items():
            assert info["pid"] in tree, (
                f"rank {rank} (pid {info['pid']}) is not below the launcher "
                f"(pid {launcher.pid}): {tree}")
            assert info["size"] == 2 and info["rank"] == rank, info
        names = {launcher.pid: f"the launcher tf_smb.run (pid {launcher.pid})"}
        names.update({i["pid"]: f"rank {r} (pid {i['pid']})" for r, i in started.items()})
        offenders = []
        for pid in tree:
            try:
                socks = exposed_sockets(pid)
            except FileNotFoundError:  # a short-lived helper that ended meanwhile
                continue
            who = names.get(pid, f"process {pid} below the launcher ({_cmdline(pid)[:120]})")
            offenders += [f"{who} holds {s}" for s in socks]
        (tmp_path / "go").touch()
        launcher.wait(timeout=END_TIMEOUT)
        log = out_path.read_text()
        assert launcher.returncode == 0, (
            f"tf_smb.run exited with {launcher.returncode}:\n{log[-4000:]}")
        for rank in (0, 1):
            with open(tmp_path / f"rank{rank}.json") as f:
                result = json.load(f)
            assert result["steps"] == 8, f"rank {rank} trained {result['steps']} steps"
        left = [i["pid"] for i in started.values() if _is_worker(i["pid"])]
        assert not left, f"workers outlived tf_smb.run: {left}"
        return offenders
    finally:
        _stop_tree(launcher, [i["pid"] for i in started.values()])


def test_one_node_job_listens_nowhere(tmp_path):
    """`tf_smb.run -np 2`, sync fit paused mid-training: the launcher and every
    process below it hold no listening TCP and no bound UDP socket."""
    offenders = _one_node_offenders(tmp_path)
    assert not offenders, ("a one-node tf_smb job opened sockets others can reach:\n"
                           + "\n".join(offenders))


def test_one_node_check_sees_a_planted_listener(tmp_path):
    """The same check when the workers do open a listener (--plant_listener)."""
    offenders = _one_node_offenders(tmp_path, plant=True)
    for rank in (0, 1):
        mine = [o for o in offenders if o.startswith(f"rank {rank} ")]
        assert len(mine) == 2 and re.search(r"tcp 127\.0\.0\.1:\d+ LISTEN", mine[0] + mine[1]) \
            and re.search(r"udp 0\.0\.0\.0:\d+ unconnected", mine[0] + mine[1]), offenders
    assert len(offenders) == 4, offenders


def _is_worker(pid: int) -> bool:
    return WORKER in _cmdline(pid)


def _stop_tree(launcher: subprocess.Popen, worker_pids: Sequence[int]) -> None:
    """SIGKILLs the process group of every process below the launcher and of
    each worker (each worker leads a session of its own), then the launcher's."""
    if launcher.poll() is None:
        pids = set(descendants(launcher.pid)) | {p for p in worker_pids if _is_worker(p)}
        pids.discard(launcher.pid)
        for pid in pids:
            try:
                pgid = os.getpgid(pid)
            except ProcessLookupError:
                continue
            if pgid != os.getpgid(0):
                _killpg(pgid)
        _killpg(launcher.pid)
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    for pid in worker_pids:  # the launcher ended; a worker it left must not stay
        if _is_worker(pid):
            _killpg(pid)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_started(directory, count: int, timeout: float, alive, output) -> Dict[int, dict]:
    """The started<rank>.json of ranks 0..count-1, by rank, once all exist;
    fails naming the missing ranks when the job ended or `timeout` passed."""
    deadline = time.monotonic() + timeout
    started: Dict[int, dict] = {}
    while len(started) < count:
        missing = sorted(set(range(count)) - set(started))
        for rank in missing:
            path = os.path.join(directory, f"started{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    started[rank] = json.load(f)
        if len(started) == count:
            break
        if not alive():
            raise AssertionError(f"the job ended before ranks {missing} paused:\n{output()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks {missing} did not pause within {timeout:.0f}s:\n"
                                 f"{output()}")
        time.sleep(0.2)
    return started


# --- two simulated nodes, under mpirun ---------------------------------------------




@dataclasses.dataclass
class JobSockets:
    """Exposed sockets of every rank and of Open MPI's daemons of one mpirun job."""
    ranks: Dict[int, dict]  # rank -> started<rank>.json
    exposed: Dict[int, List[Sock]]  # rank -> its exposed sockets
    connected: Dict[int, List[Sock]]  # rank -> its TCP sockets with a peer
    daemons: Dict[str, List[Sock]]  # "pid cmdline" -> exposed sockets (mpirun, orted)
    others: Dict[str, List[Sock]]  # any other process in the nodes

    def who(self, rank: int) -> str:
        return f"rank {rank} (pid {self.ranks[rank]['pid']}, {self.ranks[rank]['host']})"

    def describe(self, title: str) -> List[str]:
        return ([title] + [f"  {self.who(r)}: {_show(self.exposed[r])}" for r in range(4)]
                + [f"  {who}: {_show(s)}" for who, s in self.daemons.items()])


def _paused_job_sockets(nodes, argv: Sequence[str], directory: str, env=None) -> JobSockets:
    """Starts mpirun 2 nodes x 2 ranks of `argv`; once every rank paused
    (directory/started<rank>.json), reads the sockets of every process in the
    nodes; then lets the ranks go (directory/go) and expects mpirun to exit with
    0. Kills everything in the nodes on any failure."""
    running = nodes.start_mpirun(4, 2, argv, env=env)
    try:
        started = _wait_started(directory, 4, START_TIMEOUT,
                                lambda: running.proc.poll() is None,
                                lambda: describe_failure(running.wait(timeout=30), range(4)))
        hosts = [started[r]["host"] for r in range(4)]
        assert hosts == [nodes.hostnames[0]] * 2 + [nodes.hostnames[1]] * 2, started
        by_pid = {info["pid"]: rank for rank, info in started.items()}
        job = JobSockets(started, {}, {}, {}, {})
        for pid, cmd in nodes.processes():
            try:
                socks = inet_sockets(pid)
            except FileNotFoundError:
                if pid in by_pid:
                    raise AssertionError(f"rank {by_pid[pid]} (pid {pid}) ended while paused")
                continue  # e.g. the remote-start agent's shell, gone meanwhile
            exposed = [s for s in socks if s.exposed]
            if pid in by_pid:
                job.exposed[by_pid[pid]] = exposed
                job.connected[by_pid[pid]] = [s for s in socks if s.table.startswith("tcp")
                                              and s.state == "01"]
            elif os.path.basename(cmd.split(" ", 1)[0]) in ("mpirun", "orted"):
                job.daemons[f"{pid} {cmd[:40]}"] = exposed
            else:
                job.others[f"{pid} {cmd[:120]}"] = exposed
        assert sorted(job.exposed) == [0, 1, 2, 3], (
            f"ranks not found in the nodes: pids {by_pid}, processes {nodes.processes()}")
    except BaseException:
        nodes.kill_processes()
        try:
            running.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        raise
    with open(os.path.join(directory, "go"), "w"):
        pass
    launch = running.wait(timeout=END_TIMEOUT)  # kills everything in the nodes on a timeout
    assert launch.returncode == 0, describe_failure(launch, range(4))
    assert not launch.leftovers, f"processes outlived mpirun: {launch.leftovers}"
    return job


@pytest.fixture(scope="module")
def reference_job(nodes, tmp_path_factory) -> JobSockets:
    """The sockets of tests/workers/mpi_reference.c (MPI_Init_thread, a barrier,
    a wait), 2 nodes x 2 ranks, launched like the tf_smb workers."""
    mpicc = shutil.which("mpicc")
    if mpicc is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but mpicc is missing (apt-get install libopenmpi-dev)")
        pytest.skip("mpicc is missing (apt-get install libopenmpi-dev)")
    folder = tmp_path_factory.mktemp("mpi_reference")
    exe = str(folder / "mpi_reference")
    p = subprocess.run([mpicc, "-O1", "-o", exe, REFERENCE_C], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, f"mpicc failed:\n{p.stderr}"
    return _paused_job_sockets(nodes, [exe, str(folder), str(PAUSE_TIMEOUT)], str(folder))


def _in_network(sock: Sock, network: ipaddress.IPv4Network) -> bool:
    address = ipaddress.ip_address(sock.local)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return address in network


def _across_nodes_problems(nodes, reference: JobSockets, tmp_path, plant: bool = False
                           ) -> List[str]:
    """Runs 2 nodes x 2 sync tf_smb workers paused mid-fit; what each rank holds
    beyond what the reference's same rank holds (more exposed sockets of a
    family; an address outside the veth network, but a wildcard the reference
    holds too), a rank without a TCP connection to the other node (not an MPI
    job across nodes), and any other process in the nodes with an exposed socket."""
    network = ipaddress.ip_network(nodes.cidr)
    options = " ".join(nodes.mpirun_argv(1, 1, ["true"]))  # what every launch passes
    for name in ("btl_tcp_if_include", "oob_tcp_if_include"):
        assert f"--mca {name} {nodes.cidr}" in options, options
    argv = [sys.executable, WORKER, str(tmp_path), "--timeout", str(PAUSE_TIMEOUT)]
    smb = _paused_job_sockets(nodes, argv + ["--plant_listener"] * plant, str(tmp_path),
                              env={"TF_SMB_TIMEOUT": "120"})
    print("\n".join(reference.describe("Open MPI's exposed sockets (reference MPI program):")
                    + smb.describe("tf_smb job (sync fit paused):")))
    problems = []
    for rank in range(4):
        who = f"tf_smb {smb.who(rank)}"
        mine = collections.Counter(s.table for s in smb.exposed[rank])
        theirs = collections.Counter(s.table for s in reference.exposed[rank])
        for table in sorted(mine):
            if mine[table] > theirs[table]:
                problems.append(
                    f"{who} holds {mine[table]} exposed {table} socket(s) where the "
                    f"reference MPI program's rank {rank} holds {theirs[table]}: "
                    f"{_show(smb.exposed[rank])} (reference: {_show(reference.exposed[rank])})")
        ref_wildcards = {s.table for s in reference.exposed[rank] if s.wildcard}
        for s in smb.exposed[rank]:
            if not (_in_network(s, network) or (s.wildcard and s.table in ref_wildcards)):
                problems.append(f"{who} holds {s}: outside {nodes.cidr} (btl_tcp_if_include"
                                "/oob_tcp_if_include) and not a wildcard Open MPI holds too")
        other = nodes.addresses[1 - rank // 2]
        if not [s for s in smb.connected[rank] if s.remote == other]:
            problems.append(f"{who} has no TCP connection to the other node ({other}): "
                            f"not an MPI job across nodes? {_show(smb.connected[rank])}")
    for who, socks in smb.others.items():
        if socks:
            problems.append(f"process {who} in the nodes (neither a rank nor Open MPI's "
                            f"daemon) holds {_show(socks)}")
    return problems


def test_across_nodes_ranks_hold_only_open_mpis_sockets(nodes, reference_job, tmp_path):
    """2 nodes x 2 sync workers under mpirun, paused mid-fit: each rank holds no
    more listening/bound sockets per family than the same rank of a program that
    only initializes MPI, and none outside the veth network the MCA settings
    name (but the wildcard address when the reference holds it too: Open MPI
    4.1.4's TCP BTL listens on 0.0.0.0 and :: whatever btl_tcp_if_include says)."""
    problems = _across_nodes_problems(nodes, reference_job, tmp_path)
    assert not problems, "\n".join(
        problems + reference_job.describe("Open MPI's own (reference MPI program):"))


def test_across_nodes_check_sees_a_planted_listener(nodes, reference_job, tmp_path):
    """The same check when the workers do open a listener on 127.0.0.1 and bind
    UDP on 0.0.0.0 (--plant_listener): every rank is named with both."""
    problems = _across_nodes_problems(nodes, reference_job, tmp_path, plant=True)
    for rank in range(4):
        mine = "\n".join(p for p in problems if p.startswith(f"tf_smb rank {rank} "))
        assert re.search(r"2 exposed tcp socket\(s\) where the reference .* holds 1:", mine) \
            and re.search(r"1 exposed udp socket\(s\) where the reference .* holds 0:", mine) and \
            re.search(r"holds tcp 127\.0\.0\.1:\d+ LISTEN: outside", mine) and \
            re.search(r"holds udp 0\.0\.0\.0:\d+ unconnected: outside", mine), problems
    assert len(problems) == 16, "\n".join(problems)


# --- the source --------------------------------------------------------------------

C_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp")
# A call of the socket API: `socket(`, `::bind(`, `listen (` ... but not a member
# or another namespace's function (`std::bind(`, `sig.bind(`, `p->listen(`).
C_SOCKET_CALL = re.compile(
    r"(?<![\w.>:])(?:::\s*)?\b(socket|socketpair|bind|listen|accept4?)\s*\(")
C_SOCKET_HEADER = re.compile(
    r"#\s*include\s*[<\"](sys/socket\.h|netinet/[\w.]+|arpa/inet\.h|netdb\.h|sys/un\.h)[>\"]")
C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
C_STRING = re.compile(r"\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'")
PY_FORBIDDEN = ("socket", "_socket", "socketserver", "http.server", "xmlrpc.server",
                "multiprocessing.connection", "multiprocessing.managers", "zmq", "grpc")
PY_SERVER_CALLS = {"create_server", "start_server", "start_unix_server", "serve_forever",
                   "Listener", "listen"}


def _is_forbidden(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in PY_FORBIDDEN)


def c_socket_uses(root: str) -> List[str]:
    """'path:line: text' of every socket call or socket header in C/C++ under root
    (comments and string literals do not count)."""
    found = []
    for path in _files(root, C_SUFFIXES):
        with open(path, errors="replace") as f:
            text = f.read()
        code = C_COMMENT.sub(_blank, text)  # offsets and lines stay
        for m in C_SOCKET_HEADER.finditer(code):
            found.append(_where(path, text, m.start()))
        for m in C_SOCKET_CALL.finditer(C_STRING.sub(_blank, code)):
            found.append(_where(path, text, m.start(1)))
    return found


def _blank(m: "re.Match[str]") -> str:
    return re.sub(r"[^\n]", " ", m.group(0))


def py_socket_uses(root: str) -> List[str]:
    """'path:line: text' of every import of a socket or server module (plain,
    from-import or importlib/__import__ by name) and every call of a server
    function (create_server, listen, ...) in Python under root."""
    found = []
    for path in _files(root, (".py",)):
        with open(path, errors="replace") as f:
            text = f.read()
        for node in ast.walk(ast.parse(text, path)):
            bad = False
            if isinstance(node, ast.Import):
                bad = any(_is_forbidden(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                bad = _is_forbidden(node.module) or any(
                    _is_forbidden(f"{node.module}.{a.name}") for a in node.names)
            elif isinstance(node, ast.Call):
                name = (node.func.attr if isinstance(node.func, ast.Attribute) else
                        node.func.id if isinstance(node.func, ast.Name) else "")
                if name in ("import_module", "__import__") and node.args and isinstance(
                        node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                    bad = _is_forbidden(node.args[0].value)
                else:
                    bad = name in PY_SERVER_CALLS
            if bad:
                found.append(_where(path, text, None, node.lineno))
    return found


def _files(root: str, suffixes: Sequence[str]) -> List[str]:
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [os.path.join(folder, n) for n in names if n.endswith(tuple(suffixes))]
    return sorted(out)


def _where(path: str, text: str, offset: Optional[int], line: int = 0) -> str:
    if offset is not None:
        line = text.count("\n", 0, offset) + 1
    return f"{os.path.relpath(path, REPO)}:{line}: {text.splitlines()[line - 1].strip()}"


def test_source_opens_no_socket():
    cc = c_socket_uses(os.path.join(REPO, "cc"))
    assert not cc, "tf_smb's C++ code uses the socket API:\n" + "\n".join(cc)
    py = py_socket_uses(os.path.join(REPO, "tf_smb"))
    assert not py, "tf_smb's Python code uses sockets or a server:\n" + "\n".join(py)
    assert _files(os.path.join(REPO, "cc"), C_SUFFIXES) and _files(
        os.path.join(REPO, "tf_smb"), (".py",)), "the source trees were not found"


SOCKET_SYMBOLS = {"socket", "socketpair", "bind", "listen", "accept", "accept4"}


def test_built_libraries_call_no_socket_function():
    """The compiled extensions in tf_smb/ (built from cc/, with whatever they link
    in statically) import none of libc's socket functions; Open MPI's stay in
    libmpi, a library of its own."""
    nm = shutil.which("nm")
    libraries = sorted(os.path.join(REPO, "tf_smb", n) for n in os.listdir(
        os.path.join(REPO, "tf_smb")) if n.endswith(".so"))
    if nm is None or not libraries:
        pytest.skip(f"nothing to inspect (nm: {nm}, built libraries in tf_smb/: {libraries})")
    for library in libraries:
        p = subprocess.run([nm, "-D", "--undefined-only", library], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, f"nm {library} failed: {p.stderr}"
        names = {line.split()[-1].split("@")[0] for line in p.stdout.splitlines() if line.strip()}
        assert names, f"nm found no undefined symbol in {library}: not a shared library?"
        assert not names & SOCKET_SYMBOLS, (
            f"{os.path.relpath(library, REPO)} calls {sorted(names & SOCKET_SYMBOLS)}")


def test_source_check_finds_what_it_must(tmp_path):
    """The source check on planted code: every socket use is found, look-alikes
    (std::bind, Signature.bind, comments, strings) are not."""
    (tmp_path / "bad.cc").write_text(
        '#include <sys/socket.h>\n'
        'int a = socket(AF_INET, SOCK_STREAM, 0);\n'
        'int b = ::bind(a, addr, len);\n'
        'int c = listen (a, 5);\n'
        'int d = accept4(a, 0, 0, 0);\n')
    (tmp_path / "fine.cc").write_text(
        '// socket( bind( listen( in a comment\n'
        '/* accept(fd) */ auto f = std::bind(g, 1);\n'
        'auto s = "listen(";  x.bind(1); p->listen(2);\n'
        'int bind_count(int); int my_socket(int);\n')
    found = c_socket_uses(str(tmp_path))
    assert [l.split(": ", 1)[0].rsplit("/", 1)[-1] for l in found] == [
        "bad.cc:1", "bad.cc:2", "bad.cc:3", "bad.cc:4", "bad.cc:5"], found

    (tmp_path / "bad.py").write_text(
        "import socket\n"
        "from socket import create_server\n"
        "import http.server as hs\n"
        "from http import server\n"
        "import importlib\n"
        "importlib.import_module('socketserver')\n"
        "from multiprocessing.connection import Listener\n"
        "s.listen(5)\n")
    (tmp_path / "fine.py").write_text(
        "import inspect\n"
        "bound = inspect.signature(print).bind(1)\n"
        "# import socket\n"
        "text = 'import socket'\n"
        "import socket_free_module\n")
    found = py_socket_uses(str(tmp_path))
    lines = sorted({int(l.split(": ", 1)[0].rsplit(":", 1)[1]) for l in found
                    if "/bad.py:" in l or l.startswith("bad.py:")})
    assert lines == [1, 2, 3, 4, 6, 7, 8] and all("bad.py:" in l for l in found), found
