"""Copy cases for pipeline.py's 1F1B, and pipeline_schedules.py's zb-h1 and interleaved
schedules: two stages, the embedding on rank 0 and the head on rank 1, which holds its own copy of
the tied wte.weight (1f1b, zb-h1: one block a stage; interleaved: two chunks of one block a stage,
so a CausalLM of 4 blocks, against a one-process reference of its own). Every rank feeds the same
batch (the tokens are the first stage's inputs and the last stage's targets). causal_lm.train's
ACCUMULATE backward passes a step, each on a micro-batch of MICRO_BATCH sequences with its loss
/ ACCUMULATE, are the schedule's m = ACCUMULATE micro-batches, each one's loss / m; or, in the
`calls` case, ACCUMULATE train_steps of one micro-batch before the optimizer's step. bf16: the
CausalLM converted with .to(torch.bfloat16), 1F1B and zb-h1, against one process in bf16.

On a process group (`group_cases`, tests/copy_cases.py --groups): the same two stages on each of
the pairs {0, 2} and {1, 3} of a world of four, side by side, 1F1B with SGD and AdamW and zb-h1
with SGD; each pipeline's tied wte.weight is summed in an embedding group of its own.

nanoGPT (tests/nanogpt_model.py, `nanogpt_cases`): the model as it is, its parts named in a
pipeline.Parts (GPT_PARTS), its loss, its configure_optimizers run on the stage, its (x, y)
micro-batches as the schedule's, and the section's clip_grad_norm_ over the stages where nanoGPT
clips: 1F1B with SGD and AdamW, zb-h1 with SGD. Run by tests/copy_cases.py.

Llama 3 (tests/llama_model.py) and HF GPT-2 with eager attention (tests/hf_gpt2_model.py),
`llama_cases`: each model as it is, trained by its recipe through 1F1B on two stages (SGD, AdamW),
its blocks called with what its forward gives them (Llama's freqs_cis and positions, GPT-2's 4-D
causal mask and position_ids, by keyword), the save loaded strictly into a fresh model."""

import hf_gpt2_model
import llama_model
import nanogpt_model
import torch
import torch.distributed as dist
import torch.nn.functional as F
from causal_lm import (
    ACCUMULATE,
    CONTEXT,
    OPTIMS,
    CausalLM,
    lm_loss,
    make_optimizer,
    param_groups,
    reference,
    task,
)

import pipeline
import pipeline_schedules

CPU = torch.device("cpu")


def stage_param_groups(stage, optim):
    """causal_lm's groups over the stage's parameters. The last stage's copy of wte.weight sits in
    lm_head, a Linear, which the weight-decay split decays: it goes where wte.weight is, no decay
    (the Model contract's change for a weight-decay split)."""
    groups = param_groups(stage, optim)
    if optim == "sgd" or not stage.is_last:
        return groups
    decay, no_decay = groups
    copies = set(stage.tied)
    decay["params"] = [param for param in decay["params"] if param not in copies]
    no_decay["params"] = no_decay["params"] + stage.tied
    return groups


def train(technique, schedule, stage, optimizer, batches, micro_batches):
    """Each step's ACCUMULATE micro-batches through the pipeline: `micro_batches` of them a
    train_step, in ACCUMULATE / micro_batches train_steps, each loss divided by their count too, so
    that the step sees the mean gradient of the step's sequences."""
    calls = ACCUMULATE // micro_batches

    def loss_fn(logits, tokens):
        return lm_loss(logits, tokens) / calls

    for step_batch in batches:
        for tokens in step_batch.chunk(calls):
            technique.train_step(stage, tokens, tokens, schedule, micro_batches, loss_fn=loss_fn)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def eval_loss(technique, stage, tokens):
    """The held-out loss, on every rank: infer's logits are on the last stage, the others add 0."""
    loss = torch.zeros(())
    logits = technique.infer(stage, tokens)
    if logits is not None:
        loss += lm_loss(logits, tokens)
    dist.all_reduce(loss)
    return loss.item()


def held_by_rank(stage):
    """What each rank's stage holds, gathered on every rank: {what: [per rank]}. The technique ran:
    the blocks cut over the ranks, the position embedding on the first stage only, a tied copy on
    each end."""
    blocks = len(list(stage.get_submodule(stage.block_list).children()))
    wpe = any("wpe." in key for key in stage.state_dict())
    held = dict(blocks=blocks, wpe=wpe, copies=len(stage.tied))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, held)
    return {key: [rank_held[key] for rank_held in gathered] for key in held}


def received_dtypes(stage):
    """Record the dtype of every floating-point input the stage runs on (a received activation:
    the first stage's tokens are integers) into the returned set."""
    seen = set()

    def record(module, args):
        if args[0].is_floating_point():
            seen.add(str(args[0].dtype))

    stage.register_forward_pre_hook(record)
    return seen


def split(model, schedule, group=None):
    """(the technique that runs `schedule`, this rank's stage of the CausalLM `model` over the
    pipeline on `group`, the world when None)."""
    shape = (CONTEXT, model.embed.wte.embedding_dim)
    if schedule == "1f1b":
        return pipeline, pipeline.parallelize(model, CPU, activation_shape=shape, group=group)
    chunks = 2 if schedule == "interleaved" else 1
    stage = pipeline_schedules.parallelize(model, CPU, chunks, activation_shape=shape, group=group)
    return pipeline_schedules, stage


def run_pipeline(optim, batches, micro_batches, schedule="1f1b", depth=2, dtype=None):
    model = CausalLM(depth=depth)
    if dtype is not None:
        model = model.to(dtype)  # the boundary's dtype too: pipeline's default activation_dtype
    technique, stage = split(model, schedule)
    seen = received_dtypes(stage)
    optimizer = make_optimizer(stage_param_groups(stage, optim), optim)
    train(technique, schedule, stage, optimizer, batches, micro_batches)
    state = technique.full_state_dict(stage)
    # the technique ran: what each rank's stage holds, and the dtypes its stages received
    proof = held_by_rank(stage)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(seen))
    proof["received"] = gathered
    # copy_cases evaluates with model(tokens), which a stage cannot run: the case brings its own,
    # on the held-out sequences copy_cases uses
    _, test_tokens = task()
    proof["eval_loss"] = eval_loss(technique, stage, test_tokens)
    if state is not None:  # rank 0, which writes the results
        # the tie, as a pipeline keeps it: the last stage's copy equal to the first stage's weight
        proof["tied"] = torch.equal(state["embed.wte.weight"], state["head.lm_head.weight"])
    return stage, state, proof


def cases(batches, rank, world, folder):
    """Yield (case name, its reference, the stage, the full state_dict, the proof), as
    copy_zero.cases does. The bf16 cases are copy_pipeline_bf16's, in a launch of their own."""
    for optim in OPTIMS:
        yield f"pipeline-{optim}", optim, *run_pipeline(optim, batches, ACCUMULATE)
    yield "pipeline-calls-sgd", "sgd", *run_pipeline("sgd", batches, 1)
    yield (
        "pipeline_schedules-zb-h1-adamw",
        "adamw",
        *run_pipeline("adamw", batches, ACCUMULATE, "zb-h1"),
    )
    # interleaved: 2 chunks a stage, a block each, so 4 blocks, and a reference of 4 blocks
    _, test_tokens = task()
    reference_loss = None
    if rank == 0:
        state, results = reference("sgd", batches, test_tokens, CausalLM(depth=4))
        torch.save(state, folder / "reference-depth4-sgd.pt")
        reference_loss = results["eval_loss"]
    stage, state, proof = run_pipeline("sgd", batches, ACCUMULATE, "interleaved", depth=4)
    proof["reference_eval_loss"] = reference_loss
    yield "pipeline_schedules-interleaved-sgd", "depth4-sgd", stage, state, proof


# On a process group: case -> (schedule, optimizer). 1F1B with both optimizers (AdamW: the tied
# copy in its no-decay group), and zb-h1, whose loop of its own sends on the group too.
GROUP_RUNS = {
    "group-pipeline-1f1b-sgd": ("1f1b", "sgd"),
    "group-pipeline-1f1b-adamw": ("1f1b", "adamw"),
    "group-pipeline_schedules-zb-h1-sgd": ("zb-h1", "sgd"),
}
GROUP_CASES = list(GROUP_RUNS)


def group_cases(batches, group, folder):
    """Yield (case name, its reference "sgd" or "adamw", the stage, the full state_dict on the
    group's first rank (None on the other), {}), the pipeline's two stages on `group`'s ranks,
    each fed the whole batch."""
    for case, (schedule, optim) in GROUP_RUNS.items():
        technique, stage = split(CausalLM(), schedule, group)
        optimizer = make_optimizer(stage_param_groups(stage, optim), optim)
        train(technique, schedule, stage, optimizer, batches, ACCUMULATE)
        yield case, optim, stage, technique.full_state_dict(stage), {}


# The model as nanoGPT has it (tests/nanogpt_model.py), trained by its own recipe: (x, y) batches,
# ignore_index=-1, configure_optimizers' groups, clipping. The stages run the model's own modules
# under their own names; what GPT.forward does around its blocks is written out here, as a user
# would write it, and the model class is not touched.

NANOGPT_CASES = ["pipeline-sgd", "pipeline-adamw", "pipeline_schedules-zb-h1-sgd"]


def gpt_embed(gpt, idx):
    """GPT.forward up to the blocks: token and position embeddings, dropout."""
    pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
    return gpt.transformer.drop(gpt.transformer.wte(idx) + gpt.transformer.wpe(pos))


def gpt_head(gpt, x):
    """GPT.forward after the blocks: the final norm and the (tied) head, at every position."""
    return gpt.lm_head(gpt.transformer.ln_f(x))


GPT_PARTS = pipeline.Parts(
    blocks="transformer.h",
    first=("transformer.wte", "transformer.wpe", "transformer.drop"),
    embed=gpt_embed,
    last=("transformer.ln_f", "lm_head"),
    head=gpt_head,
)


def gpt_loss(logits, targets):
    """GPT.forward's loss: cross-entropy over every position, targets of -1 ignored."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def make_stage_optimizer(stage, optim):
    """nanogpt_model.make_optimizer on a stage. configure_optimizers reads only the parameters'
    names and shapes, which the stage keeps, so it runs on the stage as it is: the last stage's
    copy of wte.weight (2-D, as lm_head.weight) decays, as the tied weight does in one process."""
    if optim == "sgd":
        return torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    return nanogpt_model.GPT.configure_optimizers(stage, 0.1, 1e-2, (0.9, 0.95), "cpu")


def train_gpt(technique, schedule, stage, optimizer, step_batches):
    """nanogpt_model.train through the pipeline: a step's ACCUMULATE (x, y) micro-batches are the
    schedule's m micro-batches (each loss / m, as the recipe's / ACCUMULATE), every stage feeds the
    same x and y (the first stage reads x, the last y), then the clip over the stages. Returns
    (the micro-batches' losses, from the last stage, on every rank; the norms the clip returned)."""
    losses = []
    norms = []

    def loss_fn(logits, targets):
        loss = gpt_loss(logits, targets)
        losses.append(loss.item())
        return loss

    for micro_batches in step_batches:
        x = torch.cat([x for x, _ in micro_batches])
        y = torch.cat([y for _, y in micro_batches])
        technique.train_step(stage, x, y, schedule, len(micro_batches), loss_fn=loss_fn)
        norms.append(float(technique.clip_grad_norm_(stage, nanogpt_model.CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    last_stage_losses = [None]
    if stage.is_last:
        last_stage_losses = [losses]
    dist.broadcast_object_list(last_stage_losses, src=dist.get_world_size() - 1)
    return last_stage_losses[0], norms


def run_nanogpt_pipeline(optim, schedule="1f1b"):
    gpt = nanogpt_model.model()
    config = nanogpt_model.CONFIG
    shape = (config.block_size, config.n_embd)
    if schedule == "1f1b":
        technique = pipeline
        stage = pipeline.parallelize(gpt, CPU, activation_shape=shape, parts=GPT_PARTS)
    else:
        technique = pipeline_schedules
        stage = pipeline_schedules.parallelize(gpt, CPU, 1, shape, parts=GPT_PARTS)
    optimizer = make_stage_optimizer(stage, optim)
    losses, norms = train_gpt(technique, schedule, stage, optimizer, nanogpt_model.batches())
    state = technique.full_state_dict(stage)
    proof = held_by_rank(stage)
    proof.update(losses=losses, norms=norms, eval_loss=None)
    if state is not None:  # rank 0, which writes the results
        # the tie, as a pipeline keeps it: the last stage's copy equal to the first stage's weight
        proof["tied"] = torch.equal(state["transformer.wte.weight"], state["lm_head.weight"])
        # a stage cannot run the whole forward: one process evaluates the saved state, which
        # loads into the model class as it is (its keys are the model's)
        evaluated = nanogpt_model.model()
        evaluated.load_state_dict(state)
        proof["eval_loss"] = nanogpt_model.evaluation_loss(evaluated)
    return stage, state, proof


def nanogpt_cases(rank, world, folder):
    """Yield (case name, its reference, the stage, the full state_dict, the proof), as
    copy_zero.nanogpt_cases does."""
    for optim in OPTIMS:
        yield f"pipeline-{optim}", optim, *run_nanogpt_pipeline(optim)
    yield "pipeline_schedules-zb-h1-sgd", "sgd", *run_nanogpt_pipeline("sgd", "zb-h1")


# Llama 3 as torchtitan has it (tests/llama_model.py) and HF's GPT2LMHeadModel with eager attention
# (tests/hf_gpt2_model.py), each trained by its own recipe: blocks that take more than x. The
# stages call them as the model's forward does, with what it prepares once before its blocks,
# written out here from the model's forward (Parts' block_arguments and call_block): Llama's RoPE
# table freqs_cis (a buffer of the model, which every stage holds) and its positions; GPT-2's 4-D
# causal mask, without which eager attention attends both ways with no error, and its position_ids,
# both passed by keyword to blocks that return a tuple. The model classes are not touched.

LLAMA_CASES = [
    "llama-pipeline-sgd",
    "llama-pipeline-adamw",
    "gpt2-pipeline-eager-sgd",
    "gpt2-pipeline-eager-adamw",
]


def llama_embed(stage, tokens):
    """Transformer.forward up to its layers: the token embedding (RoPE acts inside attention)."""
    return stage.tok_embeddings(tokens)


def llama_block_arguments(stage, tokens, h):
    """What Transformer.forward gives every layer besides h: freqs_cis and the positions (None:
    0..T-1, as the forward's default)."""
    positions = None
    return stage.freqs_cis, positions


def llama_call_block(layer, h, arguments):
    """Transformer.forward's line: h = layer(h, self.freqs_cis, positions)."""
    freqs_cis, positions = arguments
    return layer(h, freqs_cis, positions)


def llama_head(stage, h):
    """Transformer.forward after its layers: the final norm and the (untied) output head."""
    return stage.output(stage.norm(h))


LLAMA_PARTS = pipeline.Parts(
    blocks="layers",
    first=("tok_embeddings",),
    embed=llama_embed,
    last=("norm", "output"),
    head=llama_head,
    block_arguments=llama_block_arguments,
    call_block=llama_call_block,
)


def gpt2_parts(config):
    """GPT2Model.forward's parts: `config` is the model's (create_causal_mask reads it)."""

    def embed(stage, input_ids):
        """Up to the blocks: token and position embeddings, dropout."""
        position_ids = torch.arange(input_ids.shape[-1]).unsqueeze(0)
        transformer = stage.transformer
        return transformer.drop(transformer.wte(input_ids) + transformer.wpe(position_ids))

    def block_arguments(stage, input_ids, hidden_states):
        """What the forward gives every block: the causal mask it builds once, on the hidden
        states entering the blocks (their dtype and shape), and the position_ids."""
        causal_mask = hf_gpt2_model.create_causal_mask(config, hidden_states)
        position_ids = torch.arange(input_ids.shape[-1]).unsqueeze(0)
        return dict(attention_mask=causal_mask, position_ids=position_ids)

    def call_block(block, hidden_states, arguments):
        """The forward's line: outputs = block(hidden_states, attention_mask=..., ...); [0]."""
        return block(hidden_states, **arguments)[0]

    def head(stage, hidden_states):
        """After the blocks: GPT2Model's ln_f, then GPT2LMHeadModel's (tied) lm_head."""
        return stage.lm_head(stage.transformer.ln_f(hidden_states))

    return pipeline.Parts(
        blocks="transformer.h",
        first=("transformer.wte", "transformer.wpe", "transformer.drop"),
        embed=embed,
        last=("transformer.ln_f", "lm_head"),
        head=head,
        block_arguments=block_arguments,
        call_block=call_block,
    )


def block_calls(stage):
    """What each of the stage's blocks is called with in training, seen from outside by a forward
    pre-hook: per block, the shapes of its arguments after x (positional, then by keyword, None
    for None) and, for a 4-D mask, whether it is causal (0 on and below the diagonal, the dtype's
    minimum above it). Filled in as the blocks run: read it after training."""
    seen = {}

    def record(name):
        def hook(module, args, kwargs):
            if not module.training:
                return
            given = [*args[1:], *kwargs.values()]
            shapes = [None if value is None else list(value.shape) for value in given]
            mask = kwargs.get("attention_mask")
            causal = None
            if mask is not None:
                above = torch.ones(mask.shape[-2:], dtype=torch.bool).triu(1)
                minimum = torch.finfo(mask.dtype).min
                causal = bool(
                    (mask[..., above] == minimum).all() and (mask[..., ~above] == 0).all()
                )
            seen[name] = dict(arguments=shapes, keywords=sorted(kwargs), causal=causal)

        return hook

    for name in stage.block_names:
        block = stage.get_submodule(name)
        block.register_forward_pre_hook(record(name), with_kwargs=True)
    return seen


def llama_loss_fn(recipe, step_batch, outputs):
    """The recipe's loss over the step's global count of targets, times m: train_step divides each
    micro-batch's loss by m, for a loss that is a micro-batch's mean, and this one is already a
    share of the step's. The last stage appends each micro-batch's loss to `outputs`."""
    micro_batches = len(step_batch)
    if recipe is llama_model:
        num_items = llama_model.global_targets(step_batch)
    else:
        num_items = hf_gpt2_model.num_items_in_batch(step_batch)

    def loss_fn(logits, labels):
        if recipe is llama_model:
            loss = llama_model.loss(logits, labels, num_items)
        else:
            loss = hf_gpt2_model.causal_lm_loss(logits, labels, num_items)
        outputs.append(loss.item())
        return loss * micro_batches

    return loss_fn


def train_recipe(recipe, stage, optimizer):
    """The recipe's loop through the pipeline: a step's ACCUMULATE (inputs, labels) micro-batches
    are 1F1B's m, every stage fed the same step (the first reads the inputs, the last the labels),
    then the section's clip over the stages where the recipe clips. Returns (each step's loss, as
    the recipe sums it, on every rank; the norms the clip returned)."""
    losses = []
    norms = []
    for step_batch in recipe.batches():
        inputs = torch.cat([inputs for inputs, _ in step_batch])
        labels = torch.cat([labels for _, labels in step_batch])
        micro_losses = []
        loss_fn = llama_loss_fn(recipe, step_batch, micro_losses)
        pipeline.train_step(stage, inputs, labels, "1f1b", len(step_batch), loss_fn=loss_fn)
        losses.append(sum(micro_losses))
        norms.append(float(pipeline.clip_grad_norm_(stage, recipe.CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    last_stage_losses = [losses if stage.is_last else None]
    dist.broadcast_object_list(last_stage_losses, src=dist.get_world_size() - 1)
    return last_stage_losses[0], norms


def run_llama_pipeline(family, optim):
    """Two stages of Llama ("llama") or of HF GPT-2 with eager attention ("gpt2"), one block each,
    trained by the model's recipe. Returns (the stage, the full state_dict on rank 0, the proof:
    losses, norms, the held-out loss of the saved state loaded strictly into a fresh model, what
    each rank's blocks were called with)."""
    if family == "llama":
        recipe = llama_model
        model = llama_model.model()
        parts = LLAMA_PARTS
        shape = (llama_model.ARGS.max_seq_len, llama_model.ARGS.dim)
    else:
        recipe = hf_gpt2_model
        config = hf_gpt2_model.CONFIGS["eager-"]
        model = hf_gpt2_model.model(config)
        parts = gpt2_parts(config)
        shape = (config.n_positions, config.n_embd)
    stage = pipeline.parallelize(model, CPU, activation_shape=shape, parts=parts)
    seen = block_calls(stage)
    optimizer = recipe.make_optimizer(stage, optim)
    losses, norms = train_recipe(recipe, stage, optimizer)
    state = pipeline.full_state_dict(stage)
    by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, seen)
    proof = dict(losses=losses, norms=norms, eval_loss=None, block_calls=by_rank)
    if state is not None:  # rank 0, which writes the results
        # a stage cannot run the whole forward: one process evaluates the saved state, loaded
        # strictly (the model's own keys: Llama's wq/wk/wv from its hook, its freqs_cis buffer)
        evaluated = recipe.model(model.args if family == "llama" else config)
        evaluated.load_state_dict(state)
        proof["eval_loss"] = recipe.evaluation_loss(evaluated)
        if family == "gpt2":
            proof["tied"] = torch.equal(state["transformer.wte.weight"], state["lm_head.weight"])
    return stage, state, proof


def llama_cases(rank, world, folder):
    """Yield (case name, its reference, the stage, the full state_dict, the proof), as
    copy_zero.llama_cases does: Llama and HF GPT-2 (eager), 1F1B, SGD and AdamW."""
    runs = [(family, optim) for family in ("llama", "gpt2") for optim in OPTIMS]
    for case, (family, optim) in zip(LLAMA_CASES, runs, strict=True):
        reference_name = f"llama-{optim}" if family == "llama" else f"gpt2-eager-{optim}"
        yield case, reference_name, *run_llama_pipeline(family, optim)
