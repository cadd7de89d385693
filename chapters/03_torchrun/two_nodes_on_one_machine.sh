#!/usr/bin/env bash
# Two torchrun "nodes" on one machine, so a laptop can rehearse a multi-node launch.
#
#   bash chapters/03_torchrun/two_nodes_on_one_machine.sh static   # --nnodes/--node_rank/--master-*
#   bash chapters/03_torchrun/two_nodes_on_one_machine.sh c10d     # --rdzv-backend c10d ...
#   bash chapters/03_torchrun/two_nodes_on_one_machine.sh lonely   # node 1 alone: never meets
#
# A free port is chosen at run time (bind port 0, read it, close it), never a fixed one. Each
# command's output is prefixed "[terminal N]", as if typed in two terminals (with c10d, either
# terminal can become node 0: c10d sorts the agents by host name, then pid, and here the host is
# the same, so the agent with the smaller pid is node 0). NPROC_PER_NODE (default 1) sets
# the workers per node; TORCHRUN and PYTHON override the commands used. The exit code is
# non-zero if either node failed.
set -euo pipefail

form=${1:-static}
nproc=${NPROC_PER_NODE:-1}
torchrun=${TORCHRUN:-torchrun}
python=${PYTHON:-python}
script="$(cd "$(dirname "$0")" && pwd)/two_nodes.py"

port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')

node_flags() {  # the torchrun flags of node $1
  case $form in
    static)
      echo --nnodes 2 --node_rank "$1" --master-addr 127.0.0.1 --master-port "$port" ;;
    c10d)
      echo --nnodes 2 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "rehearsal-$$" ;;
    lonely)
      # Nobody hosts the store at 127.0.0.1:$port, as when node 1 of a command without
      # --master-addr dials the default 127.0.0.1:29500 on itself. A short rendezvous timeout
      # turns the endless wait into an error.
      echo --nnodes 2 --node_rank "$1" --master-addr 127.0.0.1 --master-port "$port" \
        --rdzv-conf timeout=2 ;;
    *)
      echo "unknown form '$form': use static, c10d or lonely" >&2; return 2 ;;
  esac
}

launch() {  # the command of terminal $1, output prefixed
  local flags
  flags=$(node_flags "$1")
  echo "[terminal $1] $torchrun $flags --nproc_per_node $nproc two_nodes.py"
  # shellcheck disable=SC2086  # the flags are meant to split into words
  "$torchrun" $flags --nproc_per_node "$nproc" "$script" 2>&1 | sed -u "s/^/[terminal $1] /"
}

node_flags 0 >/dev/null  # fail early on an unknown form
if [[ $form == lonely ]]; then
  launch 1
  exit $?
fi

launch 1 &
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
status=0
launch 0 || status=$?
wait %1 || status=$?
trap - EXIT
exit "$status"
