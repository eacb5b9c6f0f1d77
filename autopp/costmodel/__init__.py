"""The cost model: the only code that turns a profile's per-unit costs, a cluster and a stage into seconds and bytes.

Modules: `units` (the profile as per-unit arrays at a microbatch size: F, I, W, B, recompute, static, activation and
cut bytes, the optimizer step's shares, working memory), `stage` (a stage's times for the simulator, its memory,
device speeds), `terms` (point-to-point transfers, message overheads, progress delays, ring all-reduce, the step's
data-parallel synchronisation, optimizer step), `parallel` (tensor-parallel collectives, ZeRO sharding, experts
sharded over ep and their all-to-alls), `fsdp` (FSDP2 at pp 1, beside ep too), `experts` (the expert GEMMs re-timed
at ep), `context` (context parallelism: a rank's share of the sequence, its K/V ring). The DP, the judge, the CP-SAT
models, the bounds and the explanations read these; nothing else computes a cost term.
"""

from .stage import (ideal_step_time, memory_prefix, stage_costs, stage_outputs, stage_speeds, stage_transient,
                    unit_memory)
from .context import AttentionShape, ContextTable, attention_shape, causal_share, check_sequence, context_parallel
from .fsdp import check_expert_zero, fsdp_outside_pipeline
from .parallel import (ExpertTable, data_sharded, expert_parallel, group_table, group_terms, replica_terms,
                       scatter_in_backward, sp_offered, tensor_parallel)
from .terms import (allreduce_time, allreduce_times, comm_times, exposed_sync_time, gradient_allreduce_time,
                    message_overheads, optimizer_time, progress_delays, rank_sync_times, send_times, step_end_floor,
                    step_end_time, sync_time, transfer_time)
from .units import ProfileTable, TpComm, UnitArrays, unit_arrays

__all__ = ["UnitArrays", "TpComm", "ProfileTable", "unit_arrays", "group_table", "group_terms", "replica_terms",
           "tensor_parallel", "data_sharded", "fsdp_outside_pipeline", "scatter_in_backward",
           "exposed_sync_time", "rank_sync_times",
           "ExpertTable", "expert_parallel", "sp_offered", "check_expert_zero",
           "AttentionShape", "ContextTable", "attention_shape", "causal_share", "check_sequence", "context_parallel",
           "allreduce_times", "sync_time", "stage_speeds", "stage_costs",
           "memory_prefix", "unit_memory", "stage_transient", "stage_outputs", "ideal_step_time", "transfer_time",
           "send_times",
           "comm_times",
           "message_overheads", "progress_delays", "allreduce_time", "gradient_allreduce_time", "optimizer_time",
           "step_end_time", "step_end_floor"]
