"""Leave a local control plane running for development.

python -m tests.cluster up [--dir DIR] [--nodes 2] [--cards 8] [--card-resource ibm.com/spyre_pf]
python -m tests.cluster down [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .controlplane import ControlPlane, ControlPlaneError, Proc, spyre_nodes, terminate

DEFAULT_DIR = Path("/tmp/spyre-serve-cluster")


def up(args: argparse.Namespace) -> int:
    workdir = Path(args.dir)
    if (workdir / "state.json").exists():
        print(f"a cluster is already recorded in {workdir}; run `down` first", file=sys.stderr)
        return 1
    workdir.mkdir(parents=True, exist_ok=True)
    cp = ControlPlane(workdir=workdir, die_with_parent=False)
    try:
        cp.start()
        cp.register_nodes(spyre_nodes(args.nodes, args.cards, args.card_resource))
    except ControlPlaneError as e:
        print(f"control plane failed to start: {e}", file=sys.stderr)
        return 1
    print(f"control plane up in {cp.startup_seconds:.1f} s at {cp.server}")
    print(f"export KUBECONFIG={cp.kubeconfig}")
    return 0


def down(args: argparse.Namespace) -> int:
    state_file = Path(args.dir) / "state.json"
    if not state_file.exists():
        print(f"no cluster recorded in {args.dir}")
        return 0
    state = json.loads(state_file.read_text())
    for name, pid in reversed(list(state["pids"].items())):
        terminate(Proc(name, pid, Path(state["logs"][name])))
        print(f"stopped {name} (pid {pid})")
    state_file.unlink()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start a control plane and leave it running")
    p_up.add_argument("--dir", default=str(DEFAULT_DIR))
    p_up.add_argument("--nodes", type=int, default=2)
    p_up.add_argument("--cards", type=int, default=8)
    p_up.add_argument("--card-resource", default="ibm.com/spyre_pf")
    p_down = sub.add_parser("down", help="stop the control plane started by `up`")
    p_down.add_argument("--dir", default=str(DEFAULT_DIR))
    args = parser.parse_args(argv)
    return up(args) if args.command == "up" else down(args)


if __name__ == "__main__":
    sys.exit(main())
