"""autopp beside published training runs: each run's model, cluster, configuration and measured throughput (with its
source), autopp's prediction for that configuration pinned, and autopp's own choice with its prediction, as a
markdown table (quoted in docs/published.md).

The models are HF configs under examples/configs/; their analytic profiles (counted on the meta device, timed by the
catalog's roofline of the run's GPU, with the run's tensor-parallel rows: 2, 4 and 8 for the Llama runs) are cached
under profiles/ and counted when missing (Llama 3.1 405B: 15 minutes on the 2-core development machine beside other
work; 2 without the TP rows; DeepSeek-V3: 17 minutes per recipe and Qwen3-30B-A3B 12, three counts at once, and 35 s
alone in bf16-pure; BLOOM-176B 7 minutes and Llama 3 70B in fp8 3, with TP rows 2, 4 and 8, beside other work).

    .venv/bin/python scripts/published.py                  # every run
    .venv/bin/python scripts/published.py --runs llama3-8k  # one of them
    .venv/bin/python scripts/published.py --no-search      # the pinned configurations only (fast)
    .venv/bin/python scripts/published.py --runs deepseek-v3 --precision bf16  # another recipe than the run's
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopp.data.catalog import cluster_from_catalog, load_device  # noqa: E402
from autopp.data.cluster import Cluster  # noqa: E402
from autopp.data.layout import LayoutPins  # noqa: E402
from autopp.data.overlap import Overlap  # noqa: E402
from autopp.data.plan import Plan  # noqa: E402
from autopp.data.precision import KERNELS, RECIPES  # noqa: E402
from autopp.data.profile import Profile, load_profile  # noqa: E402
from autopp.data.zero import ZERO  # noqa: E402
from autopp.errors import AutoppError  # noqa: E402
from autopp.schedule import Activation, ScheduleName, tally  # noqa: E402
from autopp.sizes import parse_size  # noqa: E402
from autopp.solve import PlanRequest, RecomputeMode, make_plan  # noqa: E402

DEVICE = "h100-sxm"
MICROBATCH_SIZES = (1, 2)
#: Tensor-parallel degrees counted: every one up to the H100 node's 8 that divides the model's heads (autopp's search
#: takes these and 1).
TP_DEGREES = (2, 4, 8)
GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class Published:
    """One published training run: what ran, on what, and what was measured, with where it is written."""

    key: str
    model: str
    config: str
    """The HF config.json of the model (examples/configs/)."""
    device: str = DEVICE
    """The catalog's device the run's GPUs are (autopp/data/devices/), or a device file (examples/devices/*.json)."""
    precision: str = "bf16"
    """The mixed-precision recipe its profile is counted in (autopp.data.precision; not bf16: a profile of its own)."""
    kernels: str
    """The elementwise kernels the run ran, as its profile counts them (autopp.measure.fusion): "fused" (torch.compile,
    Transformer Engine, Megatron's or DeepSeek's fused kernels: a profile of its own) or "eager" (op by op)."""
    tp_degrees: tuple[int, ...] = TP_DEGREES
    """The tensor-parallel degrees its profile counts and autopp's own choice may take."""
    microbatch_sizes: tuple[int, ...] = MICROBATCH_SIZES
    seq_len: int
    gpus: int
    cluster: str
    memory_bytes: int | None = None
    """Per-GPU memory when it is not the catalog device's."""
    layout: LayoutPins
    """tp, pp, dp, ep and the ZeRO stage as run; `v` None: not stated, autopp picks it (2 or 4)."""
    schedule: ScheduleName
    microbatches: int
    microbatch_size: int
    recompute: RecomputeMode
    """The stages' activations as run (NONE: kept, where `activations` is None)."""
    activations: tuple[Activation, ...] | None = None
    """The activation policy the run used where autopp has it (per-unit recomputation for block-by-block
    checkpointing), in place of `recompute`'s."""
    overlap: Overlap | None = None
    """The collectives the run hides (None: the planner's default, autopp.data.overlap)."""
    frees_outputs: bool = False
    """The run's pipeline frees each stage's outputs once sent (`PlanRequest.frees_outputs`: Megatron-LM, DualPipe,
    Llama 3's), pinned and in autopp's own choice; False: held until their backward, as torch's PipelineStage does."""
    tied_across_stages: bool = False
    """The run's trainer sums a weight tied between stages shard by shard under tp and ZeRO (Megatron's embedding
    group): planned so (`PlanRequest.tied_across_stages`), pinned and in autopp's own search."""
    global_batch: int
    """Sequences per step."""
    per_gpu: float
    """The published throughput per GPU, in `unit`."""
    unit: str
    """"TFLOP/s" (model FLOPs, as an MFU counts them) or "tokens/s"."""
    measured: str
    """What else the source says beside the figure (e.g. the MFU)."""
    source: str
    assumed: str
    """What the source does not state, and what this comparison takes for it."""


#: Llama 3.1 405B (examples/configs/llama-3.1-405b.json, meta-llama/Llama-3.1-405B's config.json).
CONFIG_405B = "examples/configs/llama-3.1-405b.json"

#: torchtitan's 512-GPU Llama 3.1 405B run with 1F1B; its Interleaved 1F1B run differs only in the schedule.
TITAN_1F1B = Published(
    key="titan-1f1b", model="Llama 3.1 405B", config=CONFIG_405B, seq_len=8192, gpus=512,
    cluster="512 H100 96GB HBM2e (500 W), 8 per host on NVLink, RDMA 400 Gb/s per GPU", memory_bytes=96 * 10**9,
    precision="fp8", kernels="fused", layout=LayoutPins(tp=8, pp=8, dp=8, zero=ZERO[1], v=1, sp=True),
    schedule=ScheduleName.ONE_F_ONE_B, microbatches=32, microbatch_size=1, recompute=RecomputeMode.NONE,
    activations=(Activation.BLOCKS,), overlap=Overlap(async_tp=True), global_batch=256,
    per_gpu=100.0, unit="tokens/s", measured="1F1B; 82.5 GiB peak",
    source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bf), Table 5",
    assumed="seq 8192 (torchtitan's llama3_405b.toml; the table does not state it), microbatch size 1 "
            "(torchtitan's default: 32 microbatches); FSDP under PP keeps parameters (torchtitan's default) = "
            "ZeRO 1; pinned as the table ran it where autopp has it: Float8 = the fp8 recipe (linear matmuls at the "
            "FP8 peak), AsyncTP = SP with `async_tp` overlap (torchtitan's TP plan shards the norms along the "
            "sequence), full AC (block by block) = per-unit recomputation (recompute-units); torch.compile (the "
            "table's runs use it) = fused elementwise kernels (`--kernels fused`); the catalog's h100-sxm (700 W, "
            "3.35 TB/s) with the run's 96 GB, not its 500 W HBM2e GPU")

#: torchtitan's Llama 3.1 70B on 256 H100 (examples/configs/llama-3-70b.json: Llama 3 and 3.1 70B share their shapes;
#: 3.1 differs in RoPE scaling and context length, neither of which changes a step's cost at 8,192): FSDP 32 x TP 8,
#: no pipeline; its AsyncTP row differs only in the overlap.
TITAN_70B = Published(
    key="titan-70b", model="Llama 3.1 70B", config="examples/configs/llama-3-70b.json", seq_len=8192, gpus=256,
    cluster="256 H100 96GB HBM2e (500 W), 8 per host on NVLink, RDMA 400 Gb/s per GPU", memory_bytes=96 * 10**9,
    precision="fp8", kernels="fused", microbatch_sizes=(1, 16),
    layout=LayoutPins(tp=8, pp=1, dp=32, zero=ZERO[3], v=1, sp=True),
    schedule=ScheduleName.ONE_F_ONE_B, microbatches=1, microbatch_size=16, recompute=RecomputeMode.NONE,
    activations=(Activation.BLOCKS,), global_batch=512, per_gpu=829.0, unit="tokens/s",
    measured="2D (FSDP + TP), torch.compile, Float8; 71.9 GiB peak",
    source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bf), Table 4",
    assumed="seq 8192 (torchtitan's llama3_70b.toml; the table does not state it); its local batch 16 as one "
            "microbatch of 16 (pp 1: nothing to interleave); FSDP with pp 1 = ZeRO 3 (parameters resharded after "
            "forward); Float8 = the fp8 recipe (linear matmuls at the FP8 peak); TP with SP (torchtitan's Llama TP "
            "plan shards the norms along the sequence), its collectives not overlapped (the AsyncTP row overlaps "
            "them); full AC (block by block) = per-unit recomputation (recompute-units); torch.compile = fused "
            "elementwise kernels (`--kernels fused`); the catalog's h100-sxm (700 W, 3.35 TB/s) with the run's "
            "96 GB, not its 500 W HBM2e GPU")

#: DeepSeek-V3's pre-training (examples/configs/deepseek-v3.json, deepseek-ai/DeepSeek-V3's config.json): 180K H800
#: GPU-hours per trillion tokens, i.e. 1e12 / (180e3 x 3600 s) = 1,543 tokens/s per GPU (3.7 days per trillion
#: tokens on 2,048 GPUs, as the report says).
DEEPSEEK_V3 = Published(
    key="deepseek-v3", model="DeepSeek-V3 (671B, 37B active)", config="examples/configs/deepseek-v3.json",
    device="h800", tp_degrees=(), microbatch_sizes=(1, 4), precision="fp8", kernels="fused", seq_len=4096,
    gpus=2048,
    cluster="2,048 H800 80GB, 8 per node on NVLink (400 GB/s), InfiniBand 400 Gb/s per GPU",
    layout=LayoutPins(tp=1, pp=16, dp=128, ep=64, zero=ZERO[1], v=2), schedule=ScheduleName.DUAL_PIPE_V,
    microbatches=120, microbatch_size=1, recompute=RecomputeMode.AUTO, global_batch=15360, frees_outputs=True,
    per_gpu=1e12 / (180e3 * 3600), unit="tokens/s",
    measured="180K H800 GPU-hours per trillion tokens, FP8 mixed precision",
    source="DeepSeek-V3 Technical Report (arXiv:2412.19437v2), s.1 (GPU-hours), s.3.2 (PP16 DualPipe, EP64 over 8 "
           "nodes, ZeRO-1 DP), s.4.2 (batch 15,360 sequences of 4,096 tokens)",
    assumed="fp8 recipe (s.3.3: its GEMMs in FP8; autopp's linear and expert GEMMs at the FP8 peak, the rest in "
            "bf16, bf16 weights with fp32 master, gradients and Adam states); DualPipe (bidirectional, "
            "two copies of each stage) as DualPipeV, its V-shaped half; microbatch size 1 (120 per DP group; not "
            "stated); recomputation chosen by autopp (the report recomputes RMSNorm and the MLA up-projections); the "
            "multi-token-prediction module (one more MoE layer, 14 B parameters) not modelled; balanced routing; "
            "its all-to-alls as s.3.2.2 and s.3.3.4 run them: node-limited (each token across nodes once per "
            "target node, at most 4, forwarded over NVLink) with the dispatch in FP8 (autopp.costmodel.alltoall); "
            "fused elementwise kernels (`--kernels fused`: the report describes kernels of its own, for the "
            "all-to-alls and the fine-grained FP8 quantization, and says nothing of elementwise fusion; an "
            "assumption); each stage's outputs freed once sent, as DualPipe's reference code frees them "
            "(deepseek-ai/DualPipe, dualpipe.py: `_send_forward` queues them, `_free_tensors` empties them)")

#: torchtitan's Llama 3.1 8B with FSDP alone on 128 H100 (examples/configs/llama-3-8b.json: Llama 3 and 3.1 8B share
#: their shapes; 3.1 differs in RoPE scaling and context length, neither of which changes a step's cost at 8,192).
TITAN_8B_FSDP = Published(
    key="titan-8b-fsdp", model="Llama 3.1 8B", config="examples/configs/llama-3-8b.json", seq_len=8192, gpus=128,
    cluster="128 H100 96GB HBM2e (500 W), 8 per host on NVLink, RDMA 400 Gb/s per GPU",
    device="examples/devices/h100-96gb-500w-sxm-peak.json", kernels="eager",
    layout=LayoutPins(tp=1, pp=1, dp=128, zero=ZERO[3], v=1), schedule=ScheduleName.ONE_F_ONE_B,
    microbatches=1, microbatch_size=2, recompute=RecomputeMode.NONE, activations=(Activation.SELECTIVE_UNITS,),
    global_batch=256, per_gpu=5605.0, unit="tokens/s", measured="FSDP, no torch.compile, bf16; 67.0 GiB peak",
    source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bf), Table 3",
    assumed="seq 8192 (torchtitan's llama3_8b.toml; the table does not state it); its local batch 2 as one "
            "microbatch of 2, its selective AC (llama3_8b.toml: mode 'selective', option 'op', each block wrapped) "
            "as per-unit selective recomputation (selective-units: each block keeps its input and its matmul and "
            "attention outputs and redoes the rest); its "
            "GPU (96GB HBM2e at 2.4 TB/s, 500 W, peak 'between SXM and NVL', their footnote 2) at the SXM end of "
            "that bracket: H100 SXM's 989.5 TFLOP/s bf16 at 2.4 TB/s (examples/devices/h100-96gb-500w-sxm-peak.json, "
            "less the catalog's 3 GiB reserve)")

#: NeMo AutoModel's Qwen3-30B-A3B pre-training benchmark on one DGX-H100 (examples/configs/qwen3-30b-a3b.json,
#: Qwen/Qwen3-30B-A3B's config.json): FSDP2 over the 8 GPUs with the experts over ep 8, every block checkpointed.
QWEN3_30B = Published(
    key="automodel-qwen3-30b", model="Qwen3-30B-A3B (30.5B, 3.3B active)",
    config="examples/configs/qwen3-30b-a3b.json",
    tp_degrees=(), microbatch_sizes=(1, 4), seq_len=4096, gpus=8, precision="bf16-pure", kernels="fused",
    cluster="8 H100 80GB (DGX-H100), NVLink",
    layout=LayoutPins(tp=1, pp=1, dp=8, ep=8, zero=ZERO[3], v=1), schedule=ScheduleName.ONE_F_ONE_B,
    microbatches=16, microbatch_size=4, recompute=RecomputeMode.NONE, activations=(Activation.BLOCKS,),
    global_batch=512, per_gpu=12040.0, unit="tokens/s",
    measured="BF16, 277 model TFLOP/s per GPU (28% MFU), 21.773 s per step of 512 x 4,096 tokens",
    source="NVIDIA-NeMo/Automodel docs/performance-summary.md (commit 01926a5, 2025-10-02), Pre-Training Performance, "
           "DGX-H100 BF16, row Qwen3 MoE 30B (GBS 512, MBS 4, GA 16, TP1 PP1 CP1 EP8 FSDP8, TE + DeepEP)",
    assumed="pure bf16 (bf16-pure: bf16 weights, gradients and Adam moments, no fp32 master; at commit 01926a5 "
            "`initialize_weights` in nemo_automodel/components/models/qwen3_moe/model.py casts the model to bf16, "
            "the config's optimizer is torch.optim.Adam, whose moments take the parameters' dtype, and apply_fsdp's "
            "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) in nemo_automodel/components/moe/"
            "parallelizer.py keeps bf16 shards); FSDP8 beside EP8 as ZeRO 3 at pp 1 (FSDP2 without a pipeline, "
            "autopp.costmodel.fsdp): the dense weights (1.5 B parameters) sharded over the 8 ranks and gathered per "
            "block under compute (AutoModel's parallelize_model leaves reshard_after_forward False, which keeps them "
            "gathered from a microbatch's forward to its backward: not modelled); with ep = dp = 8 each rank's "
            "experts whole on their rank, FSDP2 over that one rank as torchtitan wraps them (dp_shard_mod_ep of size "
            "1: the bf16 copy gathered per block without a collective; AutoModel leaves them unwrapped, to the "
            "block's ignored_params, and makes no copy); every block checkpointed "
            "(examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml, activation_checkpointing: true) = per-unit "
            "recomputation; its 'fake balanced gate' = autopp's balanced routing; TE's fused kernels = fused "
            "elementwise kernels (`--kernels fused`; DeepEP's fused permutation is not: the gathers and scatters "
            "around the grouped GEMMs are counted as transformers runs them); DeepEP's all-to-all as the ep "
            "all-to-all costs it")

#: Megatron-Bridge's Llama 3 70B pre-training benchmark on 64 H100 (DGX-H100), FP8 with current scaling: TP 4 x PP 8
#: (5 virtual stages per rank) x DP 2; the profile of torchtitan's 70B rows (same config, device, recipe, sequence).
BRIDGE_70B = replace(
    TITAN_70B, key="bridge-70b", model="Llama 3 70B", gpus=64, memory_bytes=None,
    cluster="64 H100 80GB (8 DGX-H100), NVLink, InfiniBand 400 Gb/s per GPU",
    layout=LayoutPins(tp=4, pp=8, dp=2, zero=ZERO[1], v=5, sp=True), schedule=ScheduleName.INTERLEAVED_1F1B,
    microbatches=64, microbatch_size=1, recompute=RecomputeMode.NONE, activations=None,
    overlap=Overlap(async_tp=True), global_batch=128, per_gpu=1602.0, unit="tokens/s", frees_outputs=True,
    measured="FP8-CS, 719 model TFLOP/s per GPU",
    source="NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (commit 00b7660), 25.11 NeMo container, "
           "DGX-H100, row LLAMA3_70B (64 GPUs, GBS 128, MBS 1, seq 8192, FSDP 0, TP4 PP8 CP1 VP5, GA 64); "
           "scripts/performance/configs/llama/llama3_workload_base_configs.py "
           "(LLAMA3_70B_PRETRAIN_CONFIG_H100_FP8_CS_V1)",
    assumed="no activation recomputation (the preset sets none; the 8B H100 FP8 preset names its "
            "recompute_num_layers); "
            "Megatron's distributed optimizer (ZeRO 1) and sequence parallelism with TP (not in the table; "
            "Megatron-Bridge's performance recipes' defaults), its TP communication overlap (TE userbuffers) as "
            "`async_tp` overlap, its DP gradient reduction overlapped (the planner's default); FP8 current scaling "
            "= the fp8 recipe (linear matmuls at the FP8 peak); TE's fused kernels = fused elementwise kernels "
            "(`--kernels fused`, the 70B profile of the torchtitan rows); each stage's outputs freed once sent "
            "(Megatron's deallocate_pipeline_outputs, on in Megatron-Bridge's GPTModelProvider); CUDA graphs not "
            "modelled")


#: Megatron-DeepSpeed's "TFLOPs" per GPU, as BLOOM's logs print it: Narayanan et al. 2021 (arXiv:2104.04473), eq. 3,
#: 24 f b s l h^2 (1 + s / 6h + V / 16lh) per step, with f = 4 under activation checkpointing (the recomputed forward
#: counted): its README's "15.23 s/iteration, 16 x 2,048 tokens, TFLOPs: 8.04" on 384 GPUs is this count with f = 4.
def megatron_flops_per_token(layers: int, hidden: int, vocab: int, seq_len: int, factor: int = 4) -> float:
    return 24 * factor * layers * hidden ** 2 * (1 + seq_len / (6 * hidden) + vocab / (16 * layers * hidden))


#: BLOOM-176B (examples/configs/bloom-176b.json, bigscience/bloom's config.json) on Jean Zay: 48 nodes of 8 A100 80GB,
#: TP 4 x PP 12 x DP 8, about 150 TFLOP/s per GPU as Megatron-DeepSpeed counts it (recomputation included), i.e.
#: 150e12 / megatron_flops_per_token(70, 14336, 250880, 2048) = 104.5 tokens/s per GPU.
BLOOM = Published(
    key="bloom-176b", model="BLOOM-176B", config="examples/configs/bloom-176b.json",
    device="examples/devices/a100-80gb-jean-zay.json", seq_len=2048, gpus=384, kernels="fused",
    cluster="384 A100 SXM4 80GB (48 nodes of 8), NVLink inside, 4 x 100 Gb/s Omni-Path per node",
    layout=LayoutPins(tp=4, pp=12, dp=8, zero=ZERO[1], v=1, sp=False), schedule=ScheduleName.ONE_F_ONE_B,
    microbatches=128, microbatch_size=2, recompute=RecomputeMode.NONE, activations=(Activation.BLOCKS,),
    tied_across_stages=True, global_batch=2048, unit="tokens/s",
    per_gpu=150e12 / megatron_flops_per_token(70, 14336, 250880, 2048),
    measured="about 150 TFLOP/s per GPU by Megatron-DeepSpeed's count with recomputation (156 'sustained', "
             "GENCI), bf16",
    source="BigScience: bigscience-workshop/bigscience train/tr11-176B-ml/README.md (TP4 PP12 DP8, MBS 2, GBS 2048, "
           "seq 2048, ZeRO-1 in the BF16 optimizer, DeepSpeed activation checkpointing); bigscience.notion.site "
           "'BigScience 176B Model' ('training throughput: about 150 TFLOPs'); genci.fr, BLOOM's HPCwire award "
           "('sustained performance of 156 TFlops/GPU (50% of FP32/BF16 peak performance)'); BLOOM paper "
           "(arXiv:2211.05100), s.3.4",
    assumed="the published ~150 TFLOP/s converted to 104.5 tokens/s per GPU by Megatron-DeepSpeed's own formula "
            "(Narayanan et al. 2021 eq. 3 with the recomputation factor 4, as BLOOM's logs count: their 8.04 TFLOPs "
            "at 16 x 2,048 tokens in 15.23 s on 384 GPUs); DeepSpeed's pipeline engine = 1F1B, 128 microbatches of "
            "2 per DP group; the BF16 optimizer's ZeRO-1 = ZeRO 1; activation checkpointing of every layer = "
            "per-unit recomputation (recompute-units); Megatron TP without sequence parallelism (the README names "
            "none; Korthikanti et al. published it in May 2022, after the run began); the split autopp's (the run "
            "put the tied embedding on the first and last "
            "stages with 5 blocks each, 6 on the others); attention as transformers' BloomAttention (eager: "
            "baddbmm with the ALiBi bias, softmax, bmm; the run used Megatron's fused softmax), Megatron-DeepSpeed's "
            "fused kernels (its fused LayerNorm, bias-GeLU and masked softmax) = fused elementwise kernels "
            "(`--kernels fused`); the TP plan "
            "Megatron's (autopp.model.hf_plans), the tied embedding's gradient summed shard by shard between the "
            "first and last stages as Megatron does (plan only: `tied_across_stages`; that sum is not costed); "
            "links: examples/devices/a100-80gb-jean-zay.json (50 Gb/s per GPU "
            "between nodes)")

#: torchtitan's context-parallel Llama 3.1 8B at 131,072 tokens on one host of 8 H100, FSDP 2 x CP 4
#: (examples/configs/llama-3.1-8b.json, meta-llama/Llama-3.1-8B's config.json: 131,072 positions, llama3 RoPE scaling).
TITAN_8B_CP = Published(
    key="titan-8b-cp", model="Llama 3.1 8B", config="examples/configs/llama-3.1-8b.json", seq_len=131072, gpus=8,
    cluster="8 H100 96GB HBM2e (500 W), one host on NVLink", device="examples/devices/h100-96gb-500w-sxm-peak.json",
    precision="fp8", kernels="fused", microbatch_sizes=(1,),
    layout=LayoutPins(tp=1, cp=4, pp=1, dp=2, zero=ZERO[3], v=1), schedule=ScheduleName.ONE_F_ONE_B,
    microbatches=1, microbatch_size=1, recompute=RecomputeMode.NONE, activations=(Activation.BLOCKS,),
    global_batch=2, per_gpu=1071.0, unit="tokens/s",
    measured="FSDP 2, CP 4, torch.compile + Float8, full AC; 84.0 GiB peak",
    source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bf), Table 2 row 3",
    assumed="local batch size 1 per FSDP rank = global batch 2 sequences of 131,072 tokens, one microbatch each; "
            "FSDP with pp 1 (parameters resharded after forward, torchtitan's default) = ZeRO 3 over dp x cp = 8; "
            "full AC (each block wrapped) = per-unit recomputation (recompute-units); Float8 = the fp8 recipe; "
            "torch.compile = fused elementwise kernels (`--kernels fused`); CP's K/V exchange as autopp's ring costs "
            "it (torchtitan's default "
            "all-gather rotation not modelled); its GPU at the SXM end of the bracket of the pure-FSDP 8B row "
            "(examples/devices/h100-96gb-500w-sxm-peak.json); microbatch size 1 only counted")

RUNS = (
    Published(
        key="llama3-8k", model="Llama 3 405B", config=CONFIG_405B, kernels="fused", seq_len=8192, gpus=8192,
        cluster="8,192 H100 80GB (700 W), 8 per server on NVLink, RoCE 400 Gb/s per GPU",
        layout=LayoutPins(tp=8, pp=16, dp=64, zero=ZERO[2], v=None, sp=True), schedule=ScheduleName.INTERLEAVED_1F1B,
        microbatches=32, microbatch_size=1, recompute=RecomputeMode.NONE, global_batch=64 * 32, frees_outputs=True,
        per_gpu=430.0, unit="TFLOP/s", measured="43% BF16 MFU",
        source="Llama 3 paper (arXiv:2407.21783v3), Table 4 row 1 and §3.3.2",
        assumed="microbatch size 1 (32 microbatches per DP group; not stated), v chosen by autopp (not stated); "
                "FSDP that shards optimizer state and gradients, parameters not resharded after forward = ZeRO 2; "
                "TP with sequence parallelism (not stated; taken as Megatron-style TP runs it at this scale, "
                "Korthikanti et al. 2022), its collectives not overlapped (no async TP stated); fused elementwise "
                "kernels (`--kernels fused`; not stated, as every trainer at this scale runs them); each stage's "
                "outputs freed once sent (s.3.3.2: \"we proactively deallocate tensors that will not be used for "
                "future computation, including the input and output tensors of each pipeline stage\")"),
    Published(
        key="llama3-8k-16k", model="Llama 3 405B", config=CONFIG_405B, kernels="fused", seq_len=8192, gpus=16384,
        cluster="16,384 H100 80GB (700 W), 8 per server on NVLink, RoCE 400 Gb/s per GPU",
        layout=LayoutPins(tp=8, pp=16, dp=128, zero=ZERO[2], v=None, sp=True), schedule=ScheduleName.INTERLEAVED_1F1B,
        microbatches=16, microbatch_size=1, recompute=RecomputeMode.NONE, global_batch=128 * 16, frees_outputs=True,
        per_gpu=400.0, unit="TFLOP/s", measured="41% BF16 MFU",
        source="Llama 3 paper (arXiv:2407.21783v3), Table 4 row 2 and §3.3.2",
        assumed="its batch size per DP 16 as 16 microbatches of 1 (not stated), v chosen by autopp (not stated); "
                "ZeRO 2, SP and the freed stage outputs as row 1 (the 8,192-GPU row)"),
    Published(
        key="llama3-131k", model="Llama 3 405B", config=CONFIG_405B, kernels="fused", seq_len=131072, gpus=16384,
        cluster="16,384 H100 80GB (700 W), 8 per server on NVLink, RoCE 400 Gb/s per GPU",
        layout=LayoutPins(tp=8, cp=16, pp=16, dp=8, zero=ZERO[2], v=None, sp=True),
        schedule=ScheduleName.INTERLEAVED_1F1B,
        microbatches=16, microbatch_size=1, recompute=RecomputeMode.NONE, global_batch=8 * 16, frees_outputs=True,
        per_gpu=380.0, unit="TFLOP/s", measured="38% BF16 MFU",
        source="Llama 3 paper (arXiv:2407.21783v3), Table 4 row 3 and §3.3.2",
        assumed="DP 8 where the table prints DP 4: TP8 x CP16 x PP16 x DP4 is 8,192 GPUs, and its 16,384 GPUs need "
                "DP 8; its 16M tokens per batch are then 128 sequences of 131,072, 16 per DP group; microbatch size 1 "
                "(16 microbatches per DP group; not stated), v chosen by autopp, ZeRO 2, SP and the freed stage "
                "outputs as row 1; cp's K/V ring "
                "as autopp costs it (docs/parallelism.md#context-parallelism)"),
    TITAN_8B_CP,
    TITAN_1F1B,
    replace(TITAN_1F1B, key="titan-interleaved", schedule=ScheduleName.INTERLEAVED_1F1B,
            layout=replace(TITAN_1F1B.layout, v=2),
            per_gpu=128.0, measured="Interleaved 1F1B; 72.7 GiB peak",
            assumed="as the 1F1B row; 2 stages per rank (torchtitan's default for multi-stage schedules)"),
    DEEPSEEK_V3,
    TITAN_8B_FSDP,
    QWEN3_30B,
    TITAN_70B,
    replace(TITAN_70B, key="titan-70b-async-tp", overlap=Overlap(async_tp=True), per_gpu=876.0,
            measured="2D + AsyncTP, torch.compile, Float8; 67.6 GiB peak",
            assumed="as the row above, with AsyncTP = SP with `async_tp` overlap"),
    BLOOM,
    BRIDGE_70B,
    replace(TITAN_8B_FSDP, key="titan-8b-fsdp-nvl", device="examples/devices/h100-96gb-500w-nvl-peak.json",
            assumed="as the row above, at the NVL end of the GPU bracket: H100 NVL's 835.5 TFLOP/s bf16 at 2.4 TB/s "
                    "(examples/devices/h100-96gb-500w-nvl-peak.json)"),
)


def palm_flops_per_token(config: str, seq_len: int) -> tuple[float, int]:
    """Model FLOPs per token as PaLM's MFU counts them (Chowdhery et al. 2022, App. B, which Llama 3 cites for MFU):
    6 N + 12 L H Q T, with N the parameters that multiply (all but the input embedding, a lookup), L layers,
    H heads, Q head size, T the sequence length. Also N."""
    import torch
    from autopp.model.hf import hf_model_file
    mf = hf_model_file(ROOT / config, seq_len)
    with torch.device("meta"):
        model = mf.build()
    embedding = model.get_input_embeddings().weight.numel()
    n = sum(p.numel() for p in model.parameters()) - embedding
    c = model.config
    return 6 * n + 12 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * seq_len, n


def _device(run: Published) -> str:
    """The run's device as `load_device` and `analytic_profile` take it: a catalog name, or a device file's path."""
    return str(ROOT / run.device) if run.device.endswith(".json") else run.device


def profile_for(run: Published, tp: tuple[int, ...], precision: str = "bf16", kernels: str = "eager") -> Profile:
    """The run's model's analytic profile on its device at its sequence length (AdamW) in recipe `precision`
    (autopp.data.precision; other than bf16: a directory of its own) with elementwise `kernels`
    (autopp.measure.fusion; fused: a directory of its own), with rows of the TP degrees `tp`: loaded from
    profiles/ when it is current as `autopp plan` judges a cached profile (the same model fingerprint, HF source,
    recipe, device, TP rows and routing facts: autopp.cli.profile), its TP rows count sequence parallelism and it
    records its recipe (profiles counted before autopp.data.precision kept 2-byte bf16 gradients), else counted and
    saved there."""
    from autopp.cli.profile import _current
    from autopp.costmodel.parallel import sp_offered
    from autopp.data.catalog import load_device
    from autopp.data.hf_config import hf_source
    from autopp.model.experts import moe_facts
    from autopp.model.hf import load_model
    from autopp.model.meta import build_units
    from autopp.model.tp import find_tp_plan
    suffix = ("" if precision == "bf16" else f"-{precision}") + ("-fused" if kernels == "fused" else "")
    out = ROOT / "profiles" / f"{Path(run.config).stem}-{Path(run.device).stem}-s{run.seq_len}{suffix}"
    source = hf_source(ROOT / run.config, run.seq_len, "causal-lm")
    model = load_model(source.config_path, source.to_json())
    if (out / "meta.json").is_file():
        cached = load_profile(out)
        built, _, fingerprint = build_units(model)
        why = _current(cached, fingerprint, source.to_json(), load_device(_device(run)).name, tp, precision,
                       moe_facts(built.model), tp_plan=getattr(find_tp_plan(model, built.model, counting=True),
                                                               "patterns", None), kernels=kernels) \
            or (None if not tp or sp_offered(cached) else "its TP rows have no SP bytes") \
            or (None if "precision" in cached.meta.extra else "counted before the recipes' bytes per parameter")
        if why is None:
            return cached
        print(f"{out.relative_to(ROOT)}/ is not current ({why})", file=sys.stderr, flush=True)
    from autopp.measure import ProfileOptions
    from autopp.measure.analytic import analytic_profile
    print(f"counting {run.config} at seq {run.seq_len} (TP {list(tp)}, {kernels} kernels) ...", file=sys.stderr,
          flush=True)
    start = time.perf_counter()
    options = ProfileOptions(microbatch_sizes=run.microbatch_sizes, dtype="bfloat16", optimizer="adamw",
                             precision=precision, tp_degrees=tp)
    profile = analytic_profile(model, _device(run), options, kernels=kernels)
    profile = replace(profile, meta=replace(profile.meta, extra={**profile.meta.extra, "hf_config": source.to_json()}))
    profile.save(out)
    print(f"  {time.perf_counter() - start:.0f} s, saved {out.relative_to(ROOT)}/", file=sys.stderr, flush=True)
    return profile


def cluster_of(run: Published) -> Cluster:
    """The run's GPUs as whole nodes of the catalog's device (NVLink inside, 400 Gb/s per GPU between nodes: the
    catalog's links), with the run's memory per GPU."""
    return cluster_from_catalog(load_device(_device(run)), run.gpus, memory_bytes=run.memory_bytes)


def pinned_request(run: Published, cluster: Cluster) -> PlanRequest:
    """The published configuration, pinned: only the split (and v where not stated) is autopp's; a weight tied
    between stages planned as the run's trainer sums it where the run says so (`tied_across_stages`)."""
    return PlanRequest(cluster=cluster, global_batch=run.global_batch, pins=run.layout, schedule=run.schedule,
                       num_microbatches=run.microbatches, recompute=run.recompute, activations=run.activations,
                       overlap=run.overlap, tied_across_stages=run.tied_across_stages,
                       frees_outputs=run.frees_outputs)


def own_request(run: Published, cluster: Cluster, shortlist: int) -> PlanRequest:
    """autopp's own choice for the same cluster and global batch: pp, dp, tp (the profiled degrees) with SP, ep
    (mixtures of experts), ZeRO, schedule, microbatches and every activation policy searched, and cp where the
    published run used it, until `shortlist` configurations simulate as fitting; the run's overlap assumed."""
    cp = None if run.layout.cp not in (None, 1) else 1
    return PlanRequest(cluster=cluster, global_batch=run.global_batch,
                       pins=LayoutPins(pp=None, dp=None, cp=cp, tp=None, zero=None, sp=None,
                                       ep=None if (run.layout.ep or 1) > 1 else 1),
                       schedule=None, overlap=run.overlap, tied_across_stages=run.tied_across_stages,
                       recompute=RecomputeMode.AUTO, shortlist=shortlist, frees_outputs=run.frees_outputs)


def _plan(profile: Profile, request: PlanRequest) -> tuple[Plan | None, str, float]:
    """make_plan's plan (or None and autopp's one-line reason) and the seconds it took."""
    start = time.perf_counter()
    try:
        return make_plan(profile, request), "", time.perf_counter() - start
    except (AutoppError, ValueError) as exc:
        return None, str(exc), time.perf_counter() - start


def _activations(plan: Plan) -> str:
    """The stages' activation policies by name ("keep", "recompute-units", "4 keep, 60 offload")."""
    used = {s.activation for s in plan.stages}
    return next(iter(used)).value if len(used) == 1 else tally([s.activation for s in plan.stages])


def _figure(value: float) -> str:
    """A published figure: four significant digits, whole numbers from 10,000 (12040, not 1.204e+04)."""
    return f"{value:.4g}" if value < 1e4 else f"{value:.0f}"


def describe_config(plan: Plan) -> str:
    layout = plan.layout
    ep = f" EP{layout.ep}" if layout.ep > 1 else ""
    cp = f" CP{layout.cp}" if layout.cp > 1 else ""
    sp = "+SP" if layout.sp else ""
    return (f"TP{layout.tp}{sp}{cp} PP{layout.pp} DP{layout.dp}{ep} {layout.zero}, {plan.schedule.value} "
            f"v{layout.v}, {plan.num_microbatches} x {plan.microbatch_size}, activations {_activations(plan)}")


def per_gpu(tokens_per_s: float, run: Published, flops_per_token: float) -> float:
    """Throughput of the whole cluster as the run reports it per GPU (model TFLOP/s by PaLM's count, or tokens/s)."""
    per = tokens_per_s / run.gpus
    return per * flops_per_token / 1e12 if run.unit == "TFLOP/s" else per


def describe_prediction(plan: Plan, run: Published, flops_per_token: float) -> str:
    """Step time, throughput in the published figure's unit, its error against the published figure, and memory."""
    predicted = per_gpu(run.global_batch * run.seq_len / plan.predicted.step_time_s, run, flops_per_token)
    figure = f"{predicted:.0f} {run.unit} per GPU"
    error = predicted / run.per_gpu - 1
    peak = max(plan.predicted.peak_memory_bytes) / GIB
    fits = "fits" if plan.predicted.fits else "DOES NOT FIT"
    return (f"{plan.predicted.step_time_s:.1f} s/step, {figure} ({error:+.0%}), peak {peak:.0f} GiB ({fits}, "
            f"bubble {plan.predicted.bubble_fraction:.0%})")


def published_config(run: Published) -> str:
    pins = run.layout
    v = "v ?" if pins.v is None else f"v{pins.v}"
    ep = f" EP{pins.ep}" if pins.ep and pins.ep > 1 else ""
    cp = f" CP{pins.cp}" if pins.cp not in (None, 1) else ""
    sp = "+SP" if pins.sp else ""
    acts = ",".join(a.value for a in run.activations) if run.activations else f"recompute {run.recompute.value}"
    extra = "".join(f", {x}" for x in (run.precision if run.precision != "bf16" else "",
                                        "async TP" if run.overlap and run.overlap.async_tp else "",
                                        "fused kernels" if run.kernels == "fused" else "",
                                        "outputs freed once sent" if run.frees_outputs else "") if x)
    return (f"TP{pins.tp}{sp}{cp} PP{pins.pp} DP{pins.dp}{ep} {pins.zero}, {run.schedule.value} {v}, "
            f"{run.microbatches} x {run.microbatch_size} of {run.seq_len} tokens, {acts}{extra}")


def _chosen_v(plan: Plan, run: Published) -> str:
    """", v N (autopp's)" where the source does not state the stages per rank."""
    return f", v {plan.layout.v} (autopp's)" if run.layout.v is None else ""


def _at_memory_that_works(profile: Profile, run: Published, cluster: Cluster, why: str, flops: float) -> str:
    """Where the planner's reason names a memory that works (`memory_bytes` X or more), the pinned configuration's
    prediction with that much memory per GPU: its time, apart from autopp's count of its memory."""
    if "`memory_bytes` " not in why or " or more" not in why:
        return ""
    need = parse_size(why.split("`memory_bytes` ")[1].split()[0])
    plan, _, _ = _plan(profile, replace(pinned_request(run, cluster), cluster=replace(cluster, memory_bytes=need)))
    return f"; with {need / GIB:.1f} GiB per GPU: {describe_prediction(plan, run, flops)}" if plan else ""


def row(run: Published, shortlist: int, precision: str | None = None, kernels: str | None = None
        ) -> tuple[list[str], dict[str, Plan]]:
    """The table's cells for `run` counted in recipe `precision` with elementwise `kernels` (None: the run's), and
    its plans by column ("pinned", "own"); autopp's own choice searched with `shortlist` (0: not searched)."""
    flops = palm_flops_per_token(run.config, run.seq_len)[0] if run.unit == "TFLOP/s" else 0.0
    tokens = run.per_gpu * run.gpus * (1e12 / flops if run.unit == "TFLOP/s" else 1)
    profile = profile_for(run, run.tp_degrees, precision or run.precision, kernels or run.kernels)
    cluster = cluster_of(run)
    pinned, why, s1 = _plan(profile, pinned_request(run, cluster))
    print(f"{run.key}: pinned plan {s1:.0f} s", file=sys.stderr, flush=True)
    plans = {"pinned": pinned} if pinned else {}
    if pinned:
        predicted = describe_prediction(pinned, run, flops) + _chosen_v(pinned, run)
        if (precision or run.precision) != run.precision:
            predicted += f", counted in {precision}, not the run's {run.precision}"
        if (kernels or run.kernels) != run.kernels:
            predicted += f", counted with {kernels} kernels, not the run's {run.kernels}"
    elif run.activations is None and run.recompute is RecomputeMode.NONE:  # it needs another policy: say which
        auto, _, _ = _plan(profile, replace(pinned_request(run, cluster), recompute=RecomputeMode.AUTO))
        predicted = f"does not fit keeping every activation in autopp's count ({why.split(';')[0]})"
        if auto:
            plans["pinned"] = auto
            predicted += (f"; with the activation policies autopp chooses per stage (stages: "
                          f"{tally([s.activation for s in auto.stages])}){_chosen_v(auto, run)}: "
                          f"{describe_prediction(auto, run, flops)}")
    else:
        predicted = f"no plan: {why}" + _at_memory_that_works(profile, run, cluster, why, flops)
    cells = [run.model, run.cluster, published_config(run),
             f"{_figure(run.per_gpu)} {run.unit} per GPU ({run.measured}) = {tokens / 1e6:.3g} M tokens/s; {run.source}",
             predicted]
    if shortlist:
        own, why, s2 = _plan(profile, own_request(run, cluster, shortlist))
        print(f"{run.key}: own plan {s2:.0f} s", file=sys.stderr, flush=True)
        cells += [describe_config(own) if own else "no plan", describe_prediction(own, run, flops) if own else why]
        if own:
            plans["own"] = own
    return cells, plans


def at_published_tp(run: Published, precision: str | None, kernels: str | None, shortlist: int
                    ) -> Plan | None:
    """autopp's own search with tp pinned to the published run's degree (SP searched), for comparing its choice term
    by term with the best it finds at that degree."""
    request = own_request(run, cluster_of(run), shortlist)
    request = replace(request, pins=replace(request.pins, tp=run.layout.tp))
    profile = profile_for(run, run.tp_degrees, precision or run.precision, kernels or run.kernels)
    return _plan(profile, request)[0]


def breakdown(plans: dict[str, Plan]) -> list[str]:
    """A markdown table of where each plan's step goes (`TimeBreakdown.rows`: exposed seconds, hidden in brackets),
    one column per plan."""
    names = list(plans)
    lines = ["| term | " + " | ".join(f"{n}: {describe_config(plans[n])}" for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    terms = {n: p.time_breakdown.rows(p.layout.pp) for n, p in plans.items() if p.time_breakdown is not None}
    if not names or len(terms) < len(names):  # no plan at all (both refused), or one without a breakdown
        return []
    by_term = {n: {term: (exposed, hidden) for term, exposed, hidden in rows} for n, rows in terms.items()}
    # the plans' terms in order of first appearance (a plan without a pipeline has no bubble or stage terms)
    for term in dict.fromkeys(t for n in names for t, _, _ in terms[n]):
        cells = ["" if term not in by_term[n] else f"{by_term[n][term][0]:.2f}" +
                 (f" ({by_term[n][term][1]:.2f} hidden)" if by_term[n][term][1] else "") for n in names]
        lines.append(f"| {term} | " + " | ".join(cells) + " |")
    lines.append("| step | " + " | ".join(f"{plans[n].predicted.step_time_s:.2f}" for n in names) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(r.key for r in RUNS),
                        help=f"comma-separated keys (default all: {', '.join(r.key for r in RUNS)})")
    parser.add_argument("--no-search", action="store_true", help="predict the pinned configurations only")
    parser.add_argument("--shortlist", type=int, default=4,
                        help="configurations that must simulate as fitting before autopp's search stops (default 4, "
                             "the planner's; 3 times as many with several tp or ZeRO choices)")
    parser.add_argument("--breakdown", action="store_true",
                        help="after the table, where each plan's step goes (seconds per term), with autopp's own "
                             "search at the published tensor-parallel degree beside its choice")
    parser.add_argument("--precision", default=None, choices=[n for n, r in RECIPES.items() if r.dtype == "bfloat16"],
                        help="count the models in this recipe (default each run's own: fp8 for the runs that ran "
                             "FP8: torchtitan's 405B and 70B rows, Megatron-Bridge's 70B and DeepSeek-V3; bf16-pure "
                             "for NeMo AutoModel's Qwen3 row; bf16 for the others; fp8: linear and expert GEMMs at "
                             "the FP8 peak, docs/analytic.md; bf16-pure: bf16 weights, gradients and Adam state "
                             "without a master copy; profiles other than bf16 under a directory of their own)")
    parser.add_argument("--kernels", default=None, choices=KERNELS,
                        help="count the models' elementwise ops with these kernels (default each run's own: eager "
                             "for torchtitan's 8B rows without torch.compile, fused for the others; docs/analytic.md; "
                             "fused profiles under a directory of their own)")
    args = parser.parse_args()
    keys = args.runs.split(",")
    unknown = sorted(set(keys) - {r.key for r in RUNS})
    if unknown:
        parser.error(f"unknown run {unknown[0]!r}; choose from {', '.join(r.key for r in RUNS)}")
    header = ["model", "cluster", "published configuration", "published throughput (source)",
              "autopp: that configuration pinned"]
    if not args.no_search:
        header += ["autopp's own choice", "its prediction"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    chosen = [run for run in RUNS if run.key in keys]
    plans = {}
    for run in chosen:
        cells, plans[run.key] = row(run, 0 if args.no_search else args.shortlist, args.precision, args.kernels)
        print("| " + " | ".join(cells) + " |", flush=True)
    print("\nNot stated by the sources, taken as:\n")
    for run in chosen:
        print(f"- {run.model}, {run.gpus} GPUs, {run.schedule.value}: {run.assumed}")
    for run in chosen if args.breakdown else ():
        own = plans[run.key].get("own")
        if own is not None and run.layout.tp is not None and own.layout.tp != run.layout.tp:
            at_tp = at_published_tp(run, args.precision, args.kernels, args.shortlist)
            if at_tp is not None:
                plans[run.key][f"own at TP{run.layout.tp}"] = at_tp
        print(f"\n{run.key}, seconds per step:\n", *breakdown(plans[run.key]), sep="\n", flush=True)


if __name__ == "__main__":
    main()
