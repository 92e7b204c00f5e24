#!/bin/sh
# An `ssh` stand-in for the simulated nodes of tests/simnodes.py, for launchers
# that call `ssh` by name (horovodrun checks `ssh HOST true`, and Open MPI's
# default remote-start agent is `ssh`). A test puts a file named `ssh` first on
# PATH that runs
#
#   simnodes_ssh.sh MAP [ssh options] HOST [ssh options] COMMAND...
#
# MAP is SimulatedNodes.agent_map. Like OpenSSH, options may come before and
# after HOST (horovodrun passes `ssh -o ... HOST -o ConnectTimeout=10 true`);
# they are dropped (those that take a value with it) and HOST COMMAND... go to
# simnodes_agent.sh, which runs COMMAND in that node as sshd would.
set -u
if [ $# -lt 1 ]; then
    echo "simnodes_ssh.sh: usage: MAP [options] HOST [options] COMMAND..." >&2
    exit 255
fi
map=$1
shift
# Counts in $skipped the leading ssh options of "$@" (with their values).
skip_options() {
    skipped=0
    while [ $# -gt 0 ]; do
        case "$1" in
            -[bcDEeFIiJLlmOoPpQRSWw]) [ $# -ge 2 ] || break; shift 2; skipped=$((skipped + 2)) ;;
            -*) shift; skipped=$((skipped + 1)) ;;
            *) break ;;
        esac
    done
}
skip_options "$@"
shift $skipped
if [ $# -lt 1 ]; then
    echo "simnodes_ssh.sh: no host given" >&2
    exit 255
fi
host=$1
shift
skip_options "$@"
shift $skipped
if [ $# -lt 1 ]; then
    echo "simnodes_ssh.sh: no command for $host (an interactive login is not simulated)" >&2
    exit 255
fi
exec "$(dirname "$0")/simnodes_agent.sh" "$map" "$host" "$@"
