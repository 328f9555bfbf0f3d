"""Keys and version of the per-rank optimizer-state record that deepspeed_bnb writes into ZeRO checkpoints.

The record replaces DeepSpeed's `base_optimizer_state` entry (rigid and elastic alike). Element and block state is
saved untrimmed for the whole partition; whole state (quantization maps) is saved as is, never trimmed or
concatenated; the layout travels with it, so the file describes itself.
"""

FORMAT_VERSION = 3
"""Bumped on any change a reader must know about. Readers refuse versions they do not know.
1: the record; a manifest of file sizes and SHA-256 (manifest version 1).
2: the same record; the manifest (version 2) also holds per-tensor CRC-32s and is required; every file is read, and
   checked at save to be readable, by the safe loader (safe_load.py).
3: the record names its master weights (MASTER_MODE_KEY): the master-weight entries hold bf16 tensors for "bf16",
   fp32 ones otherwise ("bf16+8" saves its bf16 weights and error terms joined, the exact fp32 values they stand
   for). Formats 1 and 2 are "fp32"."""
READABLE_FORMATS = (1, 2, 3)

FORMAT_KEY = "deepspeed_bnb_format"  # int: FORMAT_VERSION of the writer
OPTIMIZER_CLASS_KEY = "optimizer_class"  # "module.Class" of the bnb optimizer that produced the state
OPTIMIZER_NAME_KEY = "optimizer_name"  # bnb's update-rule name ("adam", "lion", ...)
DP_RANK_KEY = "dp_rank"  # data-parallel rank that wrote the record
MODEL_PARALLEL_KEY = "model_parallel"  # model_parallel.ModelParallelPlace.to_dict(): the rank's tensor-parallel rank
# and pipeline stage, each parameter's tensor-parallel split; absent in records written before it was recorded
PIPELINE_LAYERS_KEY = "pipeline_layers"  # pipelines: layer file index (str) -> the layer's module name
# (ModelParallelPlace.layers); absent in other records and in records written before it was recorded
MASTER_MODE_KEY = "master_weights"  # "fp32", "bf16" or "bf16+8" (optim/master_weights.py); absent before format 3
GROUPS_KEY = "groups"  # list, one entry per param group:
HYPERPARAMS_KEY = "hyperparams"  # the param group's settings (lr, betas, ...) without its params
LAYOUT_KEY = "layout"  # GroupLayout.to_dict(): parameter numels in flat order, dp, block size
PARAM_NAMES_KEY = "param_names"  # model parameter names in flat order
EIGHT_BIT_KEY = "eight_bit"  # per parameter in flat order: True for 8-bit state, False for fp32 state
KEY_CLASSES_KEY = "key_classes"  # flat-state key -> StateClass value ("element", "block", "whole", "scalar")
STATE_KEY = "state"  # flat-state key -> tensor (untrimmed partition arrays, whole tensors) or scalar
BASE_OPTIMIZER_STATE_KEY = "base_optimizer_state"  # DeepSpeed's entry (checkpoint.constants.BASE_OPTIMIZER_STATE)
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"  # DeepSpeed's ZeRO-1/2 entry (checkpoint.constants, 0.19.7
# on): per group, zeros after each parameter in flat order; written on every release (zero_to_fp32 skips them)
MASTER_WEIGHTS_KEY = "single_partition_of_fp32_groups"  # DeepSpeed's per-rank master weights (unpadded tail; bf16
# tensors where the record's MASTER_MODE_KEY is "bf16", fp32 otherwise)
# ZeRO-3 records only (stage 1/2 records have neither; readers then use LAYOUT_KEY and MASTER_WEIGHTS_KEY):
MASTER_ENTRY_KEY = "master_entry"  # record: ZeRO state-dict entry with this rank's fp32 master weights, all groups
MASTER_LAYOUT_KEY = "master_layout"  # group: layout of its fp32 master weights in that entry (stock ZeRO-3 slices)
# Expert groups only (DeepSpeed MoE; a reader that ignores it fails on the layout's DP size where experts are spread
# over ranks, and reads an ep_size of 1 correctly):
EXPERTS_KEY = "experts"  # group: experts.ExpertPlacement.to_dict(); its param names are then global expert names
ZERO_STAGE_KEY = "zero_stage"  # DeepSpeed's ZeRO state-dict entry: the stage that wrote it
FP32_FLAT_GROUPS_KEY = "fp32_flat_groups"  # DeepSpeed's ZeRO-3 entry: per sub-group, this rank's fp32 slices

# File names inside a tag directory (DeepSpeed's; `*_OF`: per model-parallel rank, the others that of rank 0)
MODEL_STATES_OF = "mp_rank_{:02d}_model_states.pt"  # ZeRO-1/2: one model-states file per model-parallel rank
STAGE3_MODEL_STATES_OF = "zero_pp_rank_{}_mp_rank_{:02d}_model_states.pt"  # ZeRO-3: one per DP rank (empty module
# weights) and model-parallel rank
MODEL_STATES = MODEL_STATES_OF.format(0)
STAGE3_MODEL_STATES = "zero_pp_rank_{}_mp_rank_00_model_states.pt"  # per DP rank
RANK_FILE = "{}zero_pp_rank_{}_mp_rank_{:02d}_optim_states.pt"  # per DP rank: prefix ("" or "bf16_"), DP rank,
# model-parallel rank
