"""Job launcher: ``python -m tf_smb.run -np N [--timeout S] [--staging-bytes B] [--] COMMAND...``.

Creates the job's shared-memory box, starts N copies of COMMAND with TF_SMB_RANK,
TF_SMB_SIZE and TF_SMB_JOB_ID set (and TF_CPP_MIN_LOG_LEVEL=2 unless set: no
TensorFlow INFO banners or C++ warnings from every worker), prints their merged output
prefixed with ``[rank]: `` and, when one worker fails, stops the others and names the
failing rank. Each worker runs on its own block of CPUs (``--bind-to core``, the
default, as mpirun binds ranks to cores) unless there are more workers than CPUs.
The processes are started and watched by tf_smb.supervisor; the
defaults (timeout, staging, heap) are the C++ core's, from tf_smb._box.

With Horovod's elastic options (``--min-np``, ``--max-np``,
``--host-discovery-script``, ``-H``, ...) the job is elastic: workers may fail and
hosts come and go while it runs (tf_smb/elastic/driver.py, docs/elastic.md).
"""
from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import sys
from typing import List, Optional, Sequence

try:
    from tf_smb import _box
except ImportError as e:  # e.g. a source checkout whose extensions are not built
    raise ImportError(
        f"tf_smb's C++ module tf_smb._box is missing or does not load ({e}). Build "
        "it: `pip install .` in the tf_smb source checkout (or `bash tools/install.sh`), "
        "or `python setup.py build_ext --inplace` to build it in the checkout") from e
from tf_smb import supervisor  # noqa: E402  (after the check above)
from tf_smb.elastic import driver as elastic_driver  # noqa: E402

_PREFIX = "tf_smb.run: "


def _size(nbytes: int) -> str:
    """`nbytes` for a help text: '1 MiB', '4 GiB', else bytes."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} bytes"


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tf_smb.run",
        description="Runs N workers of a tf_smb job on this machine.")
    parser.add_argument("-np", dest="np", type=int, required=True,
                        help="number of workers (>= 1)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="collective timeout in seconds, passed as TF_SMB_TIMEOUT "
                             f"(default: the workers' own, {_box.DEFAULT_TIMEOUT_S:g} s "
                             "unless TF_SMB_TIMEOUT is set)")
    parser.add_argument("--staging-bytes", type=int, default=_box.DEFAULT_STAGING_BYTES,
                        help="staging area of the box in bytes (default "
                             f"{_size(_box.DEFAULT_STAGING_BYTES)})")
    parser.add_argument("--heap-bytes", type=int, default=_box.DEFAULT_HEAP_BYTES,
                        help="room for all-reduce result buffers and parameter "
                             "segments (async mode) in bytes (default "
                             f"{_size(_box.DEFAULT_HEAP_BYTES)}; sparse, only what is "
                             "used costs memory)")
    parser.add_argument("--timeline", default=None, metavar="PATH",
                        help="write a Chrome-trace/Perfetto JSON of every worker's steps "
                             "and collectives to PATH (sets TF_SMB_TIMELINE)")
    parser.add_argument("--bind-to", choices=("core", "none"), default="core",
                        help="core (default): give each worker its own block of this "
                             "machine's CPUs (those the launcher may use, split evenly; "
                             "not when there are more workers than CPUs), as mpirun binds "
                             "to cores; none: every worker may run on every CPU")
    parser.add_argument("--keep-going", action="store_true",
                        help="when a worker fails, let the others finish (for "
                             "SMBStrategy(mode='async')); exit non-zero at the end")
    elastic = parser.add_argument_group(
        "elastic training (Horovod's options; docs/elastic.md): workers may fail, hosts "
        "come and go, and the job goes on with the members left")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, default=None,
                         help="the fewest workers the job runs with (default: -np)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, default=None,
                         help="the most workers the job grows to (default: every slot)")
    elastic.add_argument("--host-discovery-script", default=None, metavar="SCRIPT",
                         help="prints the available hosts, one `host:slots` per line "
                              "(run every second)")
    elastic.add_argument("-H", "--hosts", default=None, metavar="HOST:SLOTS,...",
                         help="fixed hosts (this machine's names: localhost, 127.0.0.1, "
                              "its hostname)")
    elastic.add_argument("--reset-limit", type=int, default=None,
                         help="fail the job after this many membership changes")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2, default=None,
                         metavar=("LOW", "HIGH"),
                         help="a failed host comes back after LOW..HIGH seconds (doubling "
                              "with each failure); without it, never")
    elastic.add_argument("--elastic-timeout", type=float, default=600.0,
                         help="how long to wait for --min-np slots (default 600 s)")
    elastic.add_argument("--across-nodes", action="store_true",
                         help="run each generation as one Open MPI mpirun over its hosts "
                              "(the default when a first host is another machine)")
    elastic.add_argument("--mpi-args", default="", metavar="ARGS",
                         help="extra mpirun arguments across nodes, e.g. \"--mca "
                              "btl_tcp_if_include eth0 -x MY_VAR\"")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command each worker runs")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.np < 1:
        parser.error(f"-np must be at least 1, got {args.np}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    if args.heap_bytes < 0:
        parser.error(f"--heap-bytes must be non-negative, got {args.heap_bytes}")
    if args.staging_bytes < 1:
        parser.error(f"--staging-bytes must be positive, got {args.staging_bytes}")
    if not args.command:
        parser.error("missing COMMAND to run")
    args.elastic = any(v is not None for v in (args.min_np, args.max_np,
                                                args.host_discovery_script, args.hosts))
    if args.elastic:
        args.min_np = args.np if args.min_np is None else args.min_np
        # As horovodrun: the job takes every slot there is, up to --max-np if given.
        args.max_np = sys.maxsize if args.max_np is None else args.max_np
        if not 1 <= args.min_np <= args.np <= args.max_np:
            parser.error(f"expected 1 <= --min-np <= -np <= --max-np, got {args.min_np}, "
                         f"{args.np}, {args.max_np}")
        if args.host_discovery_script and args.hosts:
            parser.error("give --host-discovery-script or -H, not both")
        if args.reset_limit is not None and args.reset_limit < 0:
            parser.error(f"--reset-limit must be >= 0, got {args.reset_limit}")
        cooldown = args.blacklist_cooldown_range
        if cooldown is not None and not 0 < cooldown[0] <= cooldown[1]:
            parser.error(f"--blacklist-cooldown-range needs 0 < LOW <= HIGH, got {cooldown}")
        if args.timeline or args.keep_going:
            parser.error("--timeline and --keep-going are not available in elastic jobs")
        try:
            args.mpi_args = shlex.split(args.mpi_args)
        except ValueError as e:
            parser.error(f"--mpi-args: {e}")
    elif args.across_nodes or args.mpi_args:
        parser.error("--across-nodes and --mpi-args are for elastic jobs (give --min-np, "
                     "--max-np, --host-discovery-script or -H)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the launcher with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    try:
        args = _parse_args(argv)
    except SystemExit as e:  # argparse usage errors and --help
        return e.code if isinstance(e.code, int) else 2
    job_id = f"run-{os.getpid()}-{secrets.token_hex(4)}"

    received: List[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if args.elastic:
            return elastic_driver.run(elastic_driver.Options(
                command=args.command, np=args.np, min_np=args.min_np, max_np=args.max_np,
                discovery_script=args.host_discovery_script, hosts=args.hosts,
                reset_limit=args.reset_limit,
                cooldown_range=(tuple(args.blacklist_cooldown_range)
                                if args.blacklist_cooldown_range else None),
                elastic_timeout=args.elastic_timeout, timeout_s=args.timeout,
                staging_bytes=args.staging_bytes, heap_bytes=args.heap_bytes,
                bind=args.bind_to == "core", across_nodes=args.across_nodes,
                mpi_args=args.mpi_args),
                log=_log, interrupted=lambda: received[0] if received else None)
        try:
            box = _box.create_box(job_id, args.np, staging_bytes=args.staging_bytes,
                                  heap_bytes=args.heap_bytes)
        except (RuntimeError, ValueError) as e:
            print(f"{_PREFIX}cannot create the box for job {job_id}: {e}", file=sys.stderr)
            return 1
        try:
            return _run_workers(args, job_id, received)
        finally:
            try:
                box.unlink()
            finally:
                box.close()
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)


def _run_workers(args: argparse.Namespace, job_id: str, received: List[int]) -> int:
    """Starts and watches the workers; stops them all on failure or signal."""
    commands = [(args.command, supervisor.worker_env(rank=rank, size=args.np, job_id=job_id,
                                                     box_created=True,
                                                     timeout_s=args.timeout))
                for rank in range(args.np)]
    if args.timeline:
        for _, env in commands:
            env["TF_SMB_TIMELINE"] = os.path.abspath(args.timeline)

    def on_failure(rank: int) -> None:
        print(workers.report(rank, _PREFIX), file=sys.stderr, flush=True)
        if args.keep_going:
            print(f"{_PREFIX}--keep-going: the other workers continue",
                  file=sys.stderr, flush=True)

    try:
        # Workers that share every CPU crowd each other's compute threads;
        # measured on 2 cores, 2 workers' small-CNN fit steps took 1.6x as long.
        cpus = supervisor.split_cpus(args.np) if args.bind_to == "core" else None
        workers = supervisor.Workers(commands, output="prefix", log=_log, cpus=cpus)
    except supervisor.StartError as e:
        print(f"{_PREFIX}{e}", file=sys.stderr)
        return 127
    with workers:
        outcome = workers.wait(stop_on_failure=not args.keep_going,
                               interrupted=lambda: received[0] if received else None,
                               on_failure=on_failure)
    if outcome.signal is not None:
        return 128 + outcome.signal
    if outcome.failed:
        code = outcome.returncodes[outcome.failed[0]]
        return code if code and code > 0 else 1
    return 0


def _log(message: str) -> None:
    print(f"{_PREFIX}{message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
