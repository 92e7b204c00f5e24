#!/bin/sh
# Open MPI's remote-shell agent for the simulated nodes of tests/simnodes.py:
# an ssh stand-in that "logs in" to a node by entering its namespaces.
#
#   simnodes_agent.sh MAP [ssh options] HOST WORD...
#
# MAP is a file of "HOST HOLDER_PID" lines written by SimulatedNodes; it is part
# of plm_rsh_agent ("simnodes_agent.sh MAP"), so a daemon that spawns further
# daemons (tree spawn) passes it on too. Open MPI 4.1.4 calls the agent as
#   AGENT HOST ' orted' -mca ess '"env"' -mca ess_base_jobid '"2401828864"' ...
# i.e. one argv word per token, values already quoted for a shell, the command
# meant for the remote login shell. Like sshd, run the words through
# /bin/sh -c "$*" in the node, with a login's small environment (no variables
# leak from the caller: ranks get only what mpirun forwards with -x).
set -u
map=$1
shift
# Skip ssh-style options (none are passed to a custom agent by Open MPI 4.1.4,
# but plm_rsh_args may add some); options that take a value skip it too.
while [ $# -gt 0 ]; do
    case "$1" in
        -[bcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
if [ $# -lt 2 ]; then
    echo "simnodes_agent.sh: usage: MAP [options] HOST COMMAND..." >&2
    exit 255
fi
host=$1
shift
pid=$(awk -v h="$host" '$1 == h { print $2; exit }' "$map")
if [ -z "$pid" ]; then
    echo "simnodes_agent.sh: no simulated node named $host in $map" >&2
    exit 255
fi
exec nsenter -t "$pid" --net --mount --uts --ipc -- \
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME="${HOME:-/root}" LANG=C.UTF-8 /bin/sh -c "$*"
