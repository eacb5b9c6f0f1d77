"""The cluster of `autopp plan`'s flags: a catalog device, a cluster file, or devices with memory and links."""

from __future__ import annotations

import argparse
import sys

from ..errors import AutoppError

__all__ = ["plan_cluster"]


def plan_cluster(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The cluster `autopp plan` plans for: --device NAME from the catalog, --cluster FILE, or --devices N with
    --memory SIZE and the links' flags (less a --memory-reserve)."""
    from ..data.cluster import DEFAULT_LINK, Cluster, Link
    from ..data.cluster_file import load_cluster
    if args.device:
        return _device_cluster(args)
    if args.nodes or args.devices_per_node:
        raise AutoppError("--nodes and --devices-per-node go with --device NAME (or give a cluster file of nodes, "
                          "docs/cluster-format.md)")
    if args.intra_node_bandwidth or args.inter_node_bandwidth:
        raise AutoppError("--intra-node-bandwidth and --inter-node-bandwidth go with --device NAME (or give the "
                          "links in a cluster file of nodes, docs/cluster-format.md)")
    if args.cluster:
        for flag, value, field in (("--message-overhead", args.message_overhead, "overhead_s"),
                                   ("--progress-delay", args.progress_delay, "progress_s")):
            if value is not None:
                raise AutoppError(f"{flag} applies to --devices; with --cluster give each link's {field} in the file")
        if args.memory_reserve is not None:
            raise AutoppError("--memory-reserve applies to --device and --devices; with --cluster give each device's "
                              "memory less its reserve in the file")
        for flag, value in (("--devices", args.devices), ("--memory", args.memory), ("--latency", args.latency),
                            ("--bandwidth", args.bandwidth), ("--links", args.links)):
            if value is not None:  # a tester: they were dropped without a word
                raise AutoppError(f"give --cluster or {flag}, not both: the cluster file gives its devices, their "
                                  "memory and the links (docs/cluster-format.md)")
        return load_cluster(args.cluster)
    if args.devices is None or args.memory is None:
        raise AutoppError("give --devices N and --memory SIZE, --device NAME (`autopp devices`), or --cluster FILE")
    base = DEFAULT_LINK
    if args.links:
        from ..measure.links import load_link
        base = load_link(args.links)
    link = Link(latency_s=args.latency if args.latency is not None else base.latency_s,
                bandwidth_bytes_per_s=args.bandwidth or base.bandwidth_bytes_per_s,
                overhead_s=args.message_overhead if args.message_overhead is not None else base.overhead_s,
                progress_s=args.progress_delay if args.progress_delay is not None else base.progress_s)
    reserve = args.memory_reserve or 0
    if reserve >= args.memory:
        raise AutoppError(f"--memory-reserve {reserve / 2**30:.3g} GiB leaves nothing of --memory "
                          f"{args.memory / 2**30:.3g} GiB: give a smaller --memory-reserve")
    return Cluster(num_devices=args.devices, memory_bytes=args.memory - reserve, link=link,
                   memory_reserve_bytes=reserve)


def _device_cluster(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """--device NAME: memory and links from the catalog; --devices, or --nodes x --devices-per-node, devices."""
    from ..data.catalog import LinkOverrides, cluster_from_catalog, load_device
    for flag, value in (("--cluster", args.cluster), ("--links", args.links)):
        if value:
            why = "the cluster file names its devices and links" if flag == "--cluster" else \
                "the device's catalog entry gives its links; --intra-node-bandwidth, --inter-node-bandwidth, " \
                "--latency or --bandwidth override them"
            raise AutoppError(f"give --device or {flag}, not both ({why})")
    spec = load_device(args.device)
    if args.memory is not None and args.memory > spec.memory_bytes:  # a tester: taken without a word
        print(f"autopp: warning: --memory {args.memory / 2**30:.4g} GiB is above {spec.name}'s "
              f"{spec.memory_bytes / 2**30:.4g} GiB (its catalog entry): the plan is for a device with more memory "
              "than the one named", file=sys.stderr)
    overrides = LinkOverrides(intra_bandwidth=args.intra_node_bandwidth, inter_bandwidth=args.inter_node_bandwidth,
                              latency_s=args.latency, bandwidth=args.bandwidth, overhead_s=args.message_overhead,
                              progress_s=args.progress_delay)
    return cluster_from_catalog(spec, args.devices, nodes=args.nodes,
                                devices_per_node=args.devices_per_node, memory_bytes=args.memory, overrides=overrides,
                                memory_reserve=args.memory_reserve)
