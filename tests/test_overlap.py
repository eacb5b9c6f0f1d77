"""The overlap assumptions (autopp.data.overlap) and the request's default for them."""

from __future__ import annotations

from autopp.data.catalog import cluster_from_catalog, load_device
from autopp.data.cluster import Cluster
from autopp.data.overlap import NO_OVERLAP, TRAINER_OVERLAP, Overlap
from autopp.solve import PlanRequest


def test_the_trainers_overlap_fsdp_prefetch_and_gradient_reduction_not_async_tp() -> None:
    assert (TRAINER_OVERLAP.fsdp_prefetch, TRAINER_OVERLAP.grad_reduce, TRAINER_OVERLAP.async_tp) == \
        (True, True, False)
    assert TRAINER_OVERLAP.describe() == "overlap: fsdp_prefetch, grad_reduce"
    assert NO_OVERLAP.describe() == "overlap: none"


def test_the_default_is_the_trainers_on_a_catalog_gpu_and_none_for_cpu_ranks() -> None:
    gpu = cluster_from_catalog(load_device("h100-sxm"), 8)
    cpu = cluster_from_catalog(load_device("cpu"), 2)
    assert PlanRequest(cluster=gpu, global_batch=8).assumed_overlap == TRAINER_OVERLAP
    assert PlanRequest(cluster=cpu, global_batch=8).assumed_overlap == NO_OVERLAP
    assert PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**30), global_batch=8).assumed_overlap \
        == NO_OVERLAP
    asked = Overlap(async_tp=True)
    assert PlanRequest(cluster=cpu, global_batch=8, overlap=asked).assumed_overlap is asked
