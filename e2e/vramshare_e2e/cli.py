"""The local control plane from the command line (`make cluster`): `python -m vramshare_e2e.cli`, or
`--prepare` to build the tools only."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

from vramshare_e2e.cluster import ClusterSettings, LocalCluster
from vramshare_e2e.fleet import Fleet, default_fleet
from vramshare_e2e.node_images import node_images
from vramshare_e2e.process import ClusterError, say
from vramshare_e2e.tools import prometheus_binary, tools_bin_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run vramshare's local control plane in the foreground.")
    parser.add_argument("--workdir", type=Path, help="keep certificates, data and logs here")
    parser.add_argument("--fleet", type=Path, help="fleet JSON (default: 2 x A100 40GB + 3 x T4)")
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="only build the binaries and install Prometheus where missing, then exit (before parallel "
        "test workers start clusters: they must not both run apt-get)",
    )
    args = parser.parse_args(argv)
    if args.prepare:
        try:
            say(f"control-plane binaries in {tools_bin_dir()}; Prometheus at {prometheus_binary()}")
            say(f"real-node images: {', '.join(p.name for p in node_images())}")
        except ClusterError as exc:
            raise SystemExit(f"[vramshare cluster] {exc}") from None
        return
    settings = ClusterSettings(
        workdir=args.workdir,
        keep_workdir=args.workdir is not None,
        fleet=Fleet.load(args.fleet) if args.fleet else default_fleet(),
    )
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with LocalCluster.start(settings=settings) as cluster:
        print(cluster.describe(), flush=True)
        print("Ctrl-C stops everything.", flush=True)
        while not stop:
            for c in cluster.components:
                if not c.running:
                    say(f"{c.name} exited; last log lines:\n{c.tail()}")
                    stop = True
            time.sleep(0.5)
    say("stopped")


if __name__ == "__main__":
    main()
