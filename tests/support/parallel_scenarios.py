"""Pipeline- and tensor-parallel scenarios (run by distributed_scenarios.py at 2 and 4 ranks): checkpoints saved with a
model-parallel size of 2 at data-parallel size D load at D' with the same model-parallel layout.

Kinds: `pp2_stage1`, a DeepSpeed PipelineModule of the toy's layers in 2 stages under ZeRO-1 (pipelines take ZeRO-1
only); `tp2_stage2`, a tiny Llama split by AutoTP (`tensor_parallel.autotp_size: 2`) under ZeRO-2, loaded under ZeRO-1
at DP 2. Each is saved after 3 steps at DP = world / 2 and loaded by an engine built with another seed and a 50x
larger lr; the checks are the elastic matrix's: state and master weights of every (model-parallel rank, parameter)
byte-identical, the module's weights the master weights, the saved lr restored, 10 more steps tracking the run that
never stopped, and loading without optimizer state diverging.
"""

import os

import bitsandbytes as bnb
import deepspeed
import torch
from deepspeed import comm as dist
from packaging.version import Version
from torch import nn

from support.distributed_scenarios import LOADER_LR, global_state, identical, weights_follow_master
from deepspeed_bnb.runtime.zero.compat import checkpoint_mp_rank
from support.toy import GLOBAL_BATCH, MIN_8BIT_SIZE, VOCAB, ds_config, freeze, global_batch, loss_fn

MODEL_PARALLEL = 2  # pipeline stages / tensor-parallel ranks of every kind
PARALLEL_KINDS = {"pp2_stage1": dict(pipeline=True, stage=1), "tp2_stage2": dict(pipeline=False, stage=2)}
if Version(Version(deepspeed.__version__).base_version) < Version("0.18.0"):
    # DeepSpeed before 0.18.0 broadcasts AutoTP's inputs to `current_device()`, an int the CPU accelerator's torch
    # cannot name ("Invalid device string: '0'"; any optimizer, stock DeepSpeed alike): no AutoTP on CPU ranks there
    del PARALLEL_KINDS["tp2_stage2"]
LOADER_STAGES = {"tp2_stage2": {2: 1}}  # kind -> {data-parallel size: the loader's ZeRO stage} (else the saved one)
MICRO_STEPS = 2  # pipelines split each rank's batch into micro-batches


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 40)

    def forward(self, tokens):
        return self.emb(tokens)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc, self.out = nn.Linear(40, width), nn.Linear(width, 40)
        self.register_buffer("shift", torch.randn(40) * 0.1)  # a persistent buffer of the seed's, in the forward

    def forward(self, h):
        return h + self.out(torch.tanh(self.fc(h))) + self.shift


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(40, VOCAB)

    def forward(self, h):
        return self.head(h)


def pipeline_loss(logits, targets):
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


# What each kind does not train, of the seed's values like the rest: a whole pipeline layer and a piece of another on
# the other stage; under AutoTP a row-parallel weight (split along dim 1), a column-parallel one (dim 0) and one every
# tensor-parallel rank holds whole. A load that left any at the loader's own values (or a buffer) would not track
# the run that never stopped.
FROZEN = {True: ("0.emb.weight", "3.head.bias"),
          False: ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight", "model.norm.weight")}


def with_frozen_and_buffer(model, pipeline):
    """`model` with FROZEN[pipeline] frozen; the tiny Llama also gets a persistent buffer added after its final norm
    (the pipeline's blocks have theirs)."""
    freeze(model, FROZEN[pipeline])
    if not pipeline:
        norm = model.model.norm
        norm.register_buffer("shift", torch.randn(norm.weight.shape[0]) * 0.1)
        norm.register_forward_hook(lambda module, inputs, output: output + module.shift)
    return model


def trained_parameters(model):
    return [param for param in model.parameters() if param.requires_grad]


def build(world, pipeline, stage, seed=0, lr=1e-3, universal=False):
    from deepspeed.pipe import LayerSpec, PipelineModule
    torch.manual_seed(seed)
    dp = world // MODEL_PARALLEL
    if pipeline:
        model = PipelineModule([LayerSpec(Embed), LayerSpec(Block, 301), LayerSpec(Block, 37), LayerSpec(Head)],
                               num_stages=MODEL_PARALLEL, loss_fn=pipeline_loss, partition_method="uniform")
        config = ds_config(dp, stage=stage, micro_steps=MICRO_STEPS)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=32))
        config = {**ds_config(dp, stage=stage), "tensor_parallel": {"autotp_size": MODEL_PARALLEL}}
    if universal:  # load_checkpoint reads universal checkpoints
        config["checkpoint"] = {"load_universal": True}
    model = with_frozen_and_buffer(model, pipeline)
    optimizer = bnb.optim.AdamW8bit([{"params": trained_parameters(model), "lr": lr}], min_8bit_size=MIN_8BIT_SIZE)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def run_steps(engine, steps, pipeline):
    """The toy's global batches, split over the data-parallel ranks; the mean loss of each step."""
    group = engine.optimizer.dp_process_group
    dp, d = dist.get_world_size(group=group), dist.get_rank(group=group)
    losses = []
    for step in steps:
        tokens, targets = global_batch(step)
        per = GLOBAL_BATCH // dp
        tokens, targets = tokens[d * per:(d + 1) * per], targets[d * per:(d + 1) * per]
        if pipeline:  # the last stage's loss, averaged over the data-parallel ranks, on every rank
            micro = per // MICRO_STEPS
            batches = iter([(tokens[i * micro:(i + 1) * micro], targets[i * micro:(i + 1) * micro])
                            for i in range(MICRO_STEPS)])
            losses.append(float(engine.train_batch(data_iter=batches)))
            continue
        loss = loss_fn(lambda t: engine(input_ids=t).logits, tokens, targets)
        engine.backward(loss)
        engine.step()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def folder_of(out, kind, dp):
    """Where the run of `kind` saved at data-parallel size `dp` (WHOLE: the run of model-parallel size 1)."""
    return os.path.join(out, "parallel", kind, WHOLE if dp == WHOLE else f"dp{dp}")


def saved_runs(world, rank, out, builder, dp):
    """Each kind's model built by `builder` on `world` ranks: 3 steps, saved into folder_of(out, kind, dp) with the
    state it saved beside it, then 10 more steps (the losses a resumed run must track)."""
    results = {}
    for kind, cfg in PARALLEL_KINDS.items():
        folder = folder_of(out, kind, dp)
        engine = builder(world, **cfg)
        run_steps(engine, range(3), cfg["pipeline"])
        engine.save_checkpoint(folder, tag="t")
        reference = global_state(engine, world)
        if rank == 0:
            torch.save(reference, os.path.join(folder, "reference_state.pt"))
        results[kind] = {"continued": run_steps(engine, range(3, 13), cfg["pipeline"])}
    return results


def scenario_parallel_save(world, rank, out):
    return saved_runs(world, rank, out, build, world // MODEL_PARALLEL)


def scenario_parallel_load(world, rank, out, sources):
    """Loads the checkpoints of the model-parallel runs at `sources`, the world sizes that saved them."""
    results = {}
    for kind, cfg in PARALLEL_KINDS.items():
        cfg = {**cfg, "stage": LOADER_STAGES.get(kind, {}).get(world // MODEL_PARALLEL, cfg["stage"])}
        for saved_world in sources:
            folder = folder_of(out, kind, saved_world // MODEL_PARALLEL)
            engine = build(world, seed=1, lr=LOADER_LR, **cfg)
            engine.load_checkpoint(folder, tag="t")
            loaded = global_state(engine, world)
            same = identical(loaded, torch.load(os.path.join(folder, "reference_state.pt"), weights_only=False))
            follows = weights_follow_master(engine, loaded, prefix=f"mp{checkpoint_mp_rank(engine)}/")
            lr = [g["lr"] for g in engine.optimizer.param_groups]
            continued = run_steps(engine, range(3, 13), cfg["pipeline"])
            control = build(world, seed=1, lr=LOADER_LR, **cfg)
            control.load_checkpoint(folder, tag="t", load_optimizer_states=False)
            results[f"{kind}_from{saved_world // MODEL_PARALLEL}"] = {
                "state_identical": same, "weights_follow_master": follows, "lr": lr,
                "continued": continued, "state_dropped": run_steps(control, range(3, 13), cfg["pipeline"]),
                "stage": engine.zero_optimization_stage()}
    return results


# ---- a change of the model-parallel layout: the 8-bit universal checkpoint of each run, loaded at size 1 -----------

def universal_of(out, kind, dp):
    return os.path.join(folder_of(out, kind, dp), "universal")


WHOLE = "whole"  # the source name of the runs of model-parallel size 1 (scenario_parallel_whole_save)


def export_universal(out, dps):
    """`deepspeed-bnb export --universal` of every model-parallel checkpoint saved at data-parallel sizes `dps` (and of
    the runs of model-parallel size 1 where they saved), in the test process between launches; the report of each
    written beside it."""
    from deepspeed_bnb.checkpoint.tools.export import export
    for kind in PARALLEL_KINDS:
        for dp in [*dps, WHOLE]:
            if dp == WHOLE and not os.path.isdir(folder_of(out, kind, dp)):
                continue
            written = export(folder_of(out, kind, dp), universal_of(out, kind, dp), universal=True, progress=False)
            torch.save({"joined": written.get("joined", "")}, os.path.join(universal_of(out, kind, dp), "report.pt"))


def build_whole(world, pipeline, stage, seed=0, lr=1e-3):
    """build()'s models at model-parallel size 1 (one pipeline stage, no AutoTP) on `world` data-parallel ranks,
    reading universal checkpoints."""
    from deepspeed.pipe import LayerSpec, PipelineModule
    torch.manual_seed(seed)
    if pipeline:
        model = PipelineModule([LayerSpec(Embed), LayerSpec(Block, 301), LayerSpec(Block, 37), LayerSpec(Head)],
                               num_stages=1, loss_fn=pipeline_loss, partition_method="uniform")
        config = ds_config(world, stage=stage, micro_steps=MICRO_STEPS)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=32))
        config = ds_config(world, stage=stage)
    config["checkpoint"] = {"load_universal": True}
    model = with_frozen_and_buffer(model, pipeline)
    optimizer = bnb.optim.AdamW8bit([{"params": trained_parameters(model), "lr": lr}], min_8bit_size=MIN_8BIT_SIZE)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def saved_shapes(folder, ranks=MODEL_PARALLEL):
    """name -> shape per model-parallel rank (of `ranks`), from DeepSpeed's own model-states files of the tag (not our
    records)."""
    shapes = {}
    for mp in range(ranks):
        states = torch.load(os.path.join(folder, "t", f"mp_rank_{mp:02d}_model_states.pt"), weights_only=False)
        for group in states["param_shapes"]:
            for name, shape in group.items():
                shapes.setdefault(name, {})[mp] = tuple(shape)
    return shapes


def trained(loaded):
    """global_state's entries of trained parameters (a frozen one's holds only its weights, under its bare name)."""
    return {key: state for key, state in loaded.items() if "master" in state}


def compare_with_slices(loaded, reference, shapes, full_shapes):
    """How each loaded parameter relates to the model-parallel ranks' saved state (reference, "mp<r>/<name>"): the
    pieces along the dimension where the ranks' shapes differ from the whole one (every rank's own parameters for
    pipeline stages; rank 0's where every tensor-parallel rank holds it whole) joined in rank order. Returns lists
    of names: master weights not the joined ones, 8-bit state not moved bit for bit where every piece is whole
    blocks, and the largest requantization error elsewhere in quantization steps (values against the joined
    pieces' dequantized fp32 values)."""
    from deepspeed_bnb.checkpoint.tools.convert import step_ratio
    from deepspeed_bnb.ops.reference import dequantize_blockwise
    out = {"master_differs": [], "codes_differ": [], "moved": [], "requantized": [], "largest_steps": 0.0}
    for name, state in trained(loaded).items():
        ranks = sorted(shapes[name])
        pieces = [reference[f"mp{mp}/{name}"] for mp in ranks]
        whole = full_shapes[name]
        dims = [d for d in range(len(whole)) if shapes[name][ranks[0]][d] != whole[d]]
        if not dims:  # a pipeline stage's own parameter, or one every tensor-parallel rank holds whole
            pieces, dim = pieces[:1], 0
            ranks = ranks[:1]
        else:
            dim = dims[0]

        def joined(key):
            return torch.cat([p[key].reshape(shapes[name][mp]) for p, mp in zip(pieces, ranks)], dim).reshape(-1)

        if not torch.equal(state["master"], joined("master")):
            out["master_differs"].append(name)
        for key in [k for k in state if k.startswith("state")]:
            suffix = key[len("state"):]
            eight_bit = state[key].dtype == torch.uint8
            source_8bit = pieces[0][key].dtype == torch.uint8
            whole_blocks = dim == 0 and all(torch.Size(shapes[name][mp]).numel() % 256 == 0 for mp in ranks)
            if eight_bit and source_8bit and (whole_blocks or len(pieces) == 1):
                same = torch.equal(state[key], joined(key)) and torch.equal(
                    state["absmax" + suffix], torch.cat([p["absmax" + suffix] for p in pieces]))
                (out["moved"] if same else out["codes_differ"]).append(name)
                continue
            if source_8bit:
                values = torch.cat([dequantize_blockwise(p[key], p["absmax" + suffix], p["qmap" + suffix])
                                    .reshape(shapes[name][mp]) for p, mp in zip(pieces, ranks)], dim).reshape(-1)
            else:
                values = joined(key).float()
            if eight_bit:
                ratio = step_ratio(values, state[key], state["absmax" + suffix], state["qmap" + suffix])
                out["largest_steps"] = max(out["largest_steps"], ratio)
                out["requantized"].append(name)
            elif not torch.equal(state[key].float(), values):
                out["codes_differ"].append(name)
    return out


def scenario_parallel_universal(world, rank, out, sources):
    """Loads the 8-bit universal checkpoints of the model-parallel runs saved at world sizes `sources` (tensor-parallel
    2 or 2 pipeline stages, data-parallel N / 2) into engines of model-parallel size 1 and data-parallel size
    `world`."""
    results = {}
    for kind, cfg in PARALLEL_KINDS.items():
        for saved_world in sources:
            folder = folder_of(out, kind, saved_world // MODEL_PARALLEL)
            universal = universal_of(out, kind, saved_world // MODEL_PARALLEL)
            engine = build_whole(world, seed=1, lr=LOADER_LR, **cfg)
            engine.load_checkpoint(universal)
            loaded = global_state(engine, world)
            full_shapes = {name: tuple(p.shape) for name, p in engine.module.named_parameters()}
            reference = torch.load(os.path.join(folder, "reference_state.pt"), weights_only=False)
            relation = compare_with_slices(loaded, reference, saved_shapes(folder), full_shapes)
            follows = weights_follow_master(engine, loaded)
            lr = [g["lr"] for g in engine.optimizer.param_groups]
            continued = run_steps(engine, range(3, 13), cfg["pipeline"])
            control = build_whole(world, seed=1, lr=LOADER_LR, **cfg)
            control.load_checkpoint(universal, load_optimizer_states=False)
            results[f"{kind}_from{saved_world // MODEL_PARALLEL}"] = {
                **relation, "weights_follow_master": follows, "lr": lr, "continued": continued,
                "state_dropped": run_steps(control, range(3, 13), cfg["pipeline"]),
                "report": torch.load(os.path.join(universal, "report.pt"))["joined"]}
    return results


def whole_shapes(pipeline):
    """name -> shape of every parameter of the model unsplit (a fresh instance, no engine)."""
    if pipeline:
        return None  # stages hold whole parameters
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def slice_geometry(name, rank, shapes, whole):
    """(local shape, whole shape, the dimension the rank's slice is cut along or None, where the slice starts along
    it, elements per index of it, whether the slice is whole quantization blocks of the flat whole tensor) of
    parameter `name` on model-parallel rank `rank`: the dimension is where DeepSpeed's shape of the rank's parameter
    (`shapes`: name -> rank -> shape) differs from the whole one (`whole`: name -> shape; None: stages, nothing cut)."""
    local = shapes[name][rank]
    full = local if whole is None else whole[name]
    dims = [d for d in range(len(full)) if full[d] != local[d]]
    if not dims:
        return local, full, None, 0, 1, True
    dim = dims[0]
    start = sum(shapes[name][r][dim] for r in range(rank))
    inner = torch.Size(full[dim + 1:]).numel()
    intact = dim == 0 and torch.Size(local).numel() % 256 == 0 and start * inner % 256 == 0
    return local, full, dim, start, inner, intact


def compare_with_saved(loaded, reference, shapes, whole, universal):
    """How each (model-parallel rank, parameter) loaded from a universal checkpoint relates to what that rank saved
    (the same layout) and to the universal checkpoint's whole state: master weights the saved ones; 8-bit codes and
    absmax the saved ones where the slice is whole quantization blocks along dim 0 or the parameter is not sliced (a
    pipeline stage's, or one held whole); elsewhere the universal checkpoint's values of that slice requantized, within
    half a quantization step."""
    from deepspeed_bnb.checkpoint.tools.convert import step_ratio
    from deepspeed_bnb.ops.reference import dequantize_blockwise
    out = {"master_differs": [], "codes_differ": [], "moved": [], "requantized": [], "largest_steps": 0.0}
    for key, state in trained(loaded).items():
        mp, name = key.split("/", 1)
        rank, saved = int(mp[2:]), reference[key]
        local, full, dim, start, _, intact = slice_geometry(name, rank, shapes, whole)
        if not torch.equal(state["master"], saved["master"]):
            out["master_differs"].append(key)
        for k in [k for k in state if k.startswith("state")]:
            suffix = k[len("state"):]
            if state[k].dtype != torch.uint8 or intact:
                same = torch.equal(state[k], saved[k]) and (state[k].dtype != torch.uint8 or torch.equal(
                    state["absmax" + suffix], saved["absmax" + suffix]))
                (out["moved"] if same else out["codes_differ"]).append(key)
                continue
            source = universal[name]
            values = dequantize_blockwise(source[k], source["absmax" + suffix], source["qmap" + suffix])
            values = values.reshape(full).narrow(dim, start, local[dim]).reshape(-1)
            ratio = step_ratio(values, state[k], state["absmax" + suffix], state["qmap" + suffix])
            out["largest_steps"] = max(out["largest_steps"], ratio)
            out["requantized"].append(key)
    return out


def universal_states(path):
    """name -> the 8-bit universal checkpoint's state of every parameter (as written: whole)."""
    from deepspeed_bnb.checkpoint.tools.universal import UniversalCheckpoint
    checkpoint = UniversalCheckpoint(path)
    return {name: state for g, shapes in enumerate(checkpoint.param_shapes())
            for name, state in zip(shapes, checkpoint.param_states(g))}


def scenario_parallel_whole_save(world, rank, out):
    """Each kind's model at model-parallel size 1 (one stage, no AutoTP) on `world` ranks: saved_runs."""
    return saved_runs(world, rank, out, build_whole, WHOLE)


def compare_with_whole(loaded, whole_reference, shapes, whole):
    """How each (model-parallel rank, parameter) loaded from the universal checkpoint of a run of model-parallel size 1
    relates to that run's saved state (whole_reference, by name), sliced here along the dimension where the rank's
    shape (DeepSpeed's own param_shapes of the model-parallel runs) differs from the whole one: master weights the
    slice; 8-bit codes and absmax the slice's where it is whole quantization blocks along dim 0 (or not sliced); fp32
    state the slice's values; elsewhere the slice's values requantized within half a quantization step."""
    from deepspeed_bnb.checkpoint.tools.convert import step_ratio
    from deepspeed_bnb.ops.reference import dequantize_blockwise
    out = {"master_differs": [], "codes_differ": [], "moved": [], "requantized": [], "largest_steps": 0.0}
    for key, state in trained(loaded).items():
        mp, name = key.split("/", 1)
        rank, saved = int(mp[2:]), whole_reference[name]
        local, full, dim, start, inner, intact = slice_geometry(name, rank, shapes, whole)

        def sliced(values):  # the rank's slice of a whole flat tensor
            return values if dim is None else values.reshape(full).narrow(dim, start, local[dim]).reshape(-1)

        if not torch.equal(state["master"], sliced(saved["master"])):
            out["master_differs"].append(key)
        for k in [k for k in state if k.startswith("state")]:
            suffix = k[len("state"):]
            source_8bit = saved[k].dtype == torch.uint8
            values = dequantize_blockwise(saved[k], saved["absmax" + suffix], saved["qmap" + suffix]) \
                if source_8bit else saved[k].float()
            if state[k].dtype != torch.uint8:  # fp32 state: the slice's values
                (out["moved"] if torch.equal(state[k].float(), sliced(values)) else out["codes_differ"]).append(key)
            elif source_8bit and intact:
                first = start * inner // 256
                absmax = state["absmax" + suffix]
                same = torch.equal(state[k], sliced(saved[k])) and torch.equal(
                    absmax, saved["absmax" + suffix].narrow(-1, first, absmax.numel()))
                (out["moved"] if same else out["codes_differ"]).append(key)
            else:
                ratio = step_ratio(sliced(values), state[k], state["absmax" + suffix], state["qmap" + suffix])
                out["largest_steps"] = max(out["largest_steps"], ratio)
                out["requantized"].append(key)
    return out


def scenario_parallel_universal_split(world, rank, out, sources):
    """The 8-bit universal checkpoints of whole models loaded into engines of the runs' own model-parallel layout
    (tensor-parallel 2, or 2 pipeline stages) at data-parallel size world / 2, the universal checkpoint cut per
    model-parallel rank at load: those joined from the runs saved at world sizes `sources`, and (model-parallel
    1 -> 2) the one of the same model trained at model-parallel size 1, where it was saved."""
    results = {}
    for kind, cfg in PARALLEL_KINDS.items():
        saved = [saved_world // MODEL_PARALLEL for saved_world in sources]
        for dp in saved + ([WHOLE] if os.path.isdir(universal_of(out, kind, WHOLE)) else []):
            folder, universal = folder_of(out, kind, dp), universal_of(out, kind, dp)
            engine = build(world, seed=1, lr=LOADER_LR, universal=True, **cfg)
            engine.load_checkpoint(universal)
            loaded = global_state(engine, world)
            reference = torch.load(os.path.join(folder, "reference_state.pt"), weights_only=False)
            if dp == WHOLE:  # sliced from the whole model's state here, along DeepSpeed's shapes of the 2-rank runs
                relation = compare_with_whole(loaded, reference, saved_shapes(folder_of(out, kind, 1)),
                                              whole_shapes(cfg["pipeline"]))
            else:
                relation = compare_with_saved(loaded, reference, saved_shapes(folder), whole_shapes(cfg["pipeline"]),
                                              universal_states(universal))
            follows = weights_follow_master(engine, loaded, prefix=f"mp{checkpoint_mp_rank(engine)}/")
            lr = [g["lr"] for g in engine.optimizer.param_groups]
            continued = run_steps(engine, range(3, 13), cfg["pipeline"])
            control = build(world, seed=1, lr=LOADER_LR, universal=True, **cfg)
            control.load_checkpoint(universal, load_optimizer_states=False)
            results[f"{kind}_from{dp}"] = {
                **relation, "weights_follow_master": follows, "lr": lr, "continued": continued,
                "state_dropped": run_steps(control, range(3, 13), cfg["pipeline"])}
    return results
