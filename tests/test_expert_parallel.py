"""expert_parallel.py and common/moe.py's mixture-of-experts layer: experts spread over W ranks end
with the parameters of one ddp.py process with the same --experts --top-k; the dispatch/combine
around the model's own experts module, a list (common/moe.py's) or stacked (Llama's GroupedExperts,
torchtitan's), equals the whole module (output and gradients, an expert that receives no token
included) and adds one wait for the device per layer; the save is the unsplit model's state_dict()
(the ViT's, and Llama's with its hooks and buffer); the core's averager all-reduces the dense
gradients once, at the step; the part's start during backward, on a process group of their own,
placed alike among the all-to-alls on every rank even where a parameter gets a gradient on one
rank only; the all-to-all bytes the Meter counts add up to the formula; --clip clips by the global
norm; the scripts that take an MoE block unchanged stay exact.

Launches: 3 processes of ddp.py W=1 references (sgd and adamw for E=4 K=2 in one, sgd with --clip
in one, sgd for E=8 K=1), ONE launch at W=2 running expert_parallel.py three times (--clip once)
and the 3 other scripts as cases of it (tests/script_cases.py), one at W=4, and one mp.spawn of 2
processes.
"""

import datetime
import functools
import gc
import os
from concurrent.futures import ThreadPoolExecutor

import llama_model
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

import common
from common.meter import _group_name
from common.moe import Experts
from helpers import SMALL, ddp_reference, ddp_references, fork_launch, launch_cases, max_diff, ok

CFG = SMALL + ["--experts", "4", "--top-k", "2"]  # E=4, K=2
CFG8 = SMALL + ["--experts", "8", "--top-k", "1"]  # E=8, K=1
TOL = {"sgd": 1e-6, "adamw": 5e-5}
STEPS = 3  # optimizer steps in the Meter's window


def sizes(cfg):
    args = common.parse_args(common.get_parser("t"), cfg)
    model = common.build_model(args)
    experts = sum(p.numel() for b in model.blocks for p in b.mlp.experts.parameters())
    return args, sum(p.numel() for p in model.parameters()), experts


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """ddp.py at W=1: sgd and adamw on CFG (one process), sgd on CFG8 (as "sgd8"); cached for the
    session (test_amp_checkpoint.py's MoE test shares CFG's sgd), made beside the launches by
    `runs`."""
    return {
        **ddp_references(tmp_path_factory, CFG),
        "sgd8": ddp_reference(tmp_path_factory, CFG8, "sgd"),
    }


# SGD catches a missing 1/W on the expert gradients (AdamW would all but hide it), AdamW the
# optimizer state
EQUAL = {  # test id: (world, cfg, optim) of an expert_parallel.py run
    "W2-E4-K2-sgd": (2, CFG, "sgd"),
    "W2-E4-K2-adamw": (2, CFG, "adamw"),
    "W4-E8-K1-sgd": (4, CFG8, "sgd"),
}
CLIP = "0.2"  # below every step's gradient norm on CFG (0.45 to 0.85): each step is clipped
CLIPPED = {  # test id: (world, cfg, optim) of an expert_parallel.py --clip run, in W=2's launch
    "W2-E4-K2-sgd-clip": (2, [*CFG, "--clip", CLIP], "sgd"),
}
OTHERS = {  # test id: flags of another script's run at W=2, sgd on CFG
    "zero.py": ["--stage", "3"],
    "pipeline.py": ["--schedule", "1f1b", "--microbatches", "2"],
    "fsdp.py": [],
}


def needed(request):
    """The runs this session's selected tests read (all of them in a whole run, one for the single
    test tests/test_mutants.py asks for): EQUAL and OTHERS ids."""
    names = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module:
            names.update(params[key] for key in ("case", "script") if key in params)
    return [name for name in [*EQUAL, *CLIPPED, *OTHERS] if name in names]


def case_of(name, saved):
    """The [script, flags] case of run `name` (an EQUAL, CLIPPED or OTHERS id) and its world
    size."""
    if name in EQUAL or name in CLIPPED:
        world, cfg, optim = {**EQUAL, **CLIPPED}[name]
        return world, ["expert_parallel", [*cfg, "--optim", optim, "--save", saved]]
    flags = [*CFG, *OTHERS[name], "--optim", "sgd", "--save", saved]
    return 2, [name.removesuffix(".py"), flags]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Each world size's runs as the cases of ONE launch (W=2: the two expert_parallel.py runs and
    the other scripts; W=4: one), two at a time beside the ddp.py references (which `refs` then
    finds made): {id: (saved weights, RESULT)}."""
    folder = tmp_path_factory.mktemp("ep")
    names = needed(request)
    launches = {}  # world: ids of its cases, in order
    cases = {}  # id: [script, flags]
    for name in names:
        world, cases[name] = case_of(name, folder / f"{name}.pt")
        launches.setdefault(world, []).append(name)
    out = {}
    with ThreadPoolExecutor(2) as pool:  # two at a time: the launches and the references
        pending = {}
        for world, ids in launches.items():
            pending[world] = pool.submit(launch_cases, world, [cases[name] for name in ids], 400)
            if world == 2:
                pool.submit(ddp_references, tmp_path_factory, CFG)
            for name in ids:
                if name in CLIPPED:  # its ddp.py --clip reference
                    _, cfg, optim = CLIPPED[name]
                    pool.submit(ddp_references, tmp_path_factory, cfg, (optim,))
            if world == 4:
                pool.submit(ddp_reference, tmp_path_factory, CFG8, "sgd")
        for world, ids in launches.items():
            for name, (result, _) in zip(ids, pending[world].result(), strict=True):
                out[name] = (folder / f"{name}.pt", result)
    return out


@pytest.mark.parametrize("case", EQUAL)
def test_equals_one_ddp_process(case, runs, refs):
    world, cfg, optim = EQUAL[case]
    path, res = runs[case]
    ref = refs[optim if cfg is CFG else optim + "8"]
    diff = max_diff(path, ref)
    print(f"W={world} {optim}: max |Δ| vs ddp.py W=1 = {diff:.2e}")
    assert diff <= TOL[optim]
    assert res["steps"] == 6 and res["comm_steps"] == STEPS

    # memory: the dense part whole, the experts / W (read off the storages by the Meter)
    args, psi, psi_e = sizes(cfg)
    held, k = psi - psi_e + psi_e // world, 8 if optim == "adamw" else 4
    assert (res["param_bytes"], res["grad_bytes"], res["optim_bytes"]) == (
        4 * held,
        4 * held,
        k * held,
    )

    # communication: the dense gradients all-reduced per step in L + 2 buckets (head, blocks,
    # embedding); per MoE layer per step 4 token all-to-alls (dispatch and combine, forward and
    # backward) and one of the E int64 counts. A rank's own bytes depend on the routing; over all
    # ranks they add up to 4·k·(B·T)·D fp32 per layer per step.
    E, K, D, L = args.experts, args.top_k, args.dim, args.depth
    tokens = args.batch_size * (common.IMAGE // args.patch) ** 2
    assert res["comm"]["all_reduce"] == 4 * (psi - psi_e)
    assert res["comm_calls"] == {"all_reduce": STEPS * (L + 2), "all_to_all": STEPS * L * 5}
    assert sum(res["all_to_all_window"]) == STEPS * L * (4 * K * tokens * D * 4 + world * 8 * E)
    assert res["formula"]["comm"]["all_to_all"] * world == L * (
        4 * K * tokens * D * 4 + world * 8 * E
    )
    # the load: every (token, slot) of the batch reaches one expert, each step
    for row in res["tokens_per_expert"]:
        assert len(row) == E and abs(sum(row) - K * tokens) < 1e-6


@pytest.mark.parametrize("case", CLIPPED)
def test_clip_equals_one_ddp_process_clip(case, runs, refs, tmp_path_factory):
    """--clip at a limit below every step's gradient norm: the experts split over W=2 ranks end
    where ddp.py --clip ends in one process holding every expert, so the norm was the global one
    (the averaged dense gradients once, the experts' summed over the ranks). Unclipped training
    ends far from there, so the clip bit."""
    world, cfg, optim = CLIPPED[case]
    path, res = runs[case]
    clipped = ddp_references(tmp_path_factory, cfg, (optim,))[optim]
    assert max_diff(clipped, refs[optim]) > 100 * TOL[optim]
    diff = max_diff(path, clipped)
    print(f"W={world} {optim} --clip {CLIP}: max |Δ| vs ddp.py --clip W=1 = {diff:.2e}")
    assert diff <= TOL[optim]
    assert res["steps"] == 6


class HostSyncs(TorchDispatchMode):
    """Counts what would make the host wait for a GPU, seen on CPU: .tolist() and .item(), and the
    ops whose output size depends on the values (nonzero, bincount, boolean masks, ...)."""

    WAITS = {
        "_local_scalar_dense",
        "nonzero",
        "bincount",
        "masked_select",
        "_unique2",
        "unique_dim",
    }

    def __enter__(self):
        self.count = 0
        self.tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            self.count += 1
            return self.tolist(tensor)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        sized_by_values = name == "repeat_interleave" and kwargs.get("output_size") is None
        masked = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        if name in self.WAITS or sized_by_values or masked:
            self.count += 1
        return func(*args, **kwargs)


def _rows_for_experts(E, D, rank):
    """This rank's call of an experts module: N rows grouped by expert, where expert 1 gets none
    on any rank, their counts [E], and a gradient for the outputs."""
    torch.manual_seed(1 + rank)  # this rank's tokens and routing
    N = 37 + 5 * rank
    picked = torch.tensor([0, 2, 3])[torch.randint(3, (N,))].sort().values
    counts = torch.zeros(E, dtype=torch.long).scatter_add_(0, picked, torch.ones_like(picked))
    return torch.randn(N, D), counts, torch.randn(N, D)


def _check_routing_around(expert_parallel, make_experts, style, E, D):
    """The section's hooks around an experts module (made by make_experts, the same on every
    rank): the output and the rows' gradients equal the whole module's on this rank's rows, each
    expert this rank holds gets the sum over ranks of the whole module's gradient for it, the
    module itself runs on its E/W experts' rows with their counts, and the section adds one wait
    for the device to what the module waits alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, counts, out_grad = _rows_for_experts(E, D, rank)

    def run(module):
        x = rows.clone().requires_grad_()
        out = module(x, counts)
        out.backward(out_grad)
        return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}

    whole = make_experts()
    with HostSyncs() as alone:
        ref_out, ref_x, ref_g = run(whole)
    for g in ref_g.values():
        dist.all_reduce(g)  # an owner's rows come from every rank
    split = make_experts()
    layer = style(split)  # over the world
    stacked = isinstance(layer, expert_parallel.StackedExperts)
    seen = []  # the counts the module itself is called with, after the section's dispatch
    split.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    with HostSyncs() as syncs:
        out, gx, grads = run(split)
    assert syncs.count == alone.count + 1, (syncs.count, alone.count)  # the counts, once
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.allclose(gx, ref_x, atol=1e-6)
    owned = range(rank * E // world, (rank + 1) * E // world)
    all_counts = counts.clone()
    dist.all_reduce(all_counts)
    assert seen[0].tolist() == all_counts[owned.start : owned.stop].tolist()
    if stacked:
        assert sorted(grads) == sorted(ref_g)  # w1, w2, w3, each of E/W rows
    else:
        assert len(grads) == len(ref_g) // world  # the parameters of E/W experts
    for name, grad in grads.items():
        if stacked:  # this rank's rows of every stacked parameter
            want = ref_g[name][owned.start : owned.stop]
        else:  # this rank's j-th expert is expert owned[j]
            local_index, rest = name.split(".", 1)
            want = ref_g[f"{owned[int(local_index)]}.{rest}"]
        assert grad.shape == want.shape and torch.allclose(grad, want, atol=1e-5), name
    if not stacked and rank == 0:
        assert torch.count_nonzero(grads["1.fc1.weight"]) == 0  # no row: a zero gradient


def _check_full_state_dict(expert_parallel, make_model, style):
    """full_state_dict of a parallelized model is the whole model's state_dict(), hooks and
    buffers included: the same keys, shapes and values; a strict load into a fresh model accepts
    it."""
    whole = make_model().state_dict()
    model = expert_parallel.parallelize(make_model(), torch.device("cpu"), style=style)
    state = expert_parallel.full_state_dict(model)
    if dist.get_rank() != 0:
        assert state is None
        return
    assert state.keys() == whole.keys()
    for key, value in whole.items():
        assert state[key].shape == value.shape and torch.equal(state[key], value), key
    make_model().load_state_dict(state, strict=True)


def _check_refusals(expert_parallel):
    """An experts module the style cannot split is one clear error: stacked weights under the
    list's style, a list under StackedExperts, experts that do not split over the ranks."""
    llama = llama_model.model(llama_model.MOE_ARGS)
    with pytest.raises(ValueError, match="### more: stacked experts"):
        expert_parallel.parallelize(llama, torch.device("cpu"))
    vit = common.build_model(common.parse_args(common.get_parser("t"), CFG))
    with pytest.raises(ValueError, match="only parameters stacked"):
        expert_parallel.parallelize(vit, torch.device("cpu"), style=expert_parallel.StackedExperts)
    three = Experts(common.MLP(4, 8) for _ in range(3))
    with pytest.raises(ValueError, match="3 experts do not split over 2 ranks"):
        expert_parallel.ExpertParallel(three)


def _dispatch_worker(rank, world, port):
    """The routing around a list of expert modules (common/moe.py's Experts) and around stacked
    experts (tests/llama_model.py's GroupedExperts, torchtitan's); the full state_dict of the ViT
    and of the Llama MoE (its wqkv saved as wq, wk, wv by its hook, its RoPE buffer). Then a whole
    model: the core's averager at the step; the part's, its dense all-reduces started before
    backward's last all-to-all."""
    import expert_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A collective issued out of order on one rank fails in a minute, not Gloo's half hour.
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        E, D = 4, 8

        def expert_list():
            torch.manual_seed(0)  # the same experts on every rank
            return Experts(common.MLP(D, 16) for _ in range(E))

        def stacked_experts():
            torch.manual_seed(0)
            experts = llama_model.GroupedExperts(D, 16, E)
            for weight in experts.parameters():
                torch.nn.init.normal_(weight, std=0.3)
            return experts

        stacked = expert_parallel.StackedExperts
        _check_routing_around(expert_parallel, expert_list, expert_parallel.ExpertParallel, E, D)
        _check_routing_around(expert_parallel, stacked_experts, stacked, E, D)
        args = common.parse_args(common.get_parser("t"), CFG)
        vit = functools.partial(common.build_model, args)
        llama = functools.partial(llama_model.model, llama_model.MOE_ARGS)
        _check_full_state_dict(expert_parallel, vit, expert_parallel.ExpertParallel)
        _check_full_state_dict(expert_parallel, llama, stacked)
        _check_refusals(expert_parallel)
        _check_step_averager(expert_parallel)
        _check_overlap(expert_parallel)
        _check_same_order_everywhere(expert_parallel)
        _check_late_gradient_is_an_error(expert_parallel)
        _check_own_group_of_subgroups(expert_parallel)
    finally:
        # Free the models' hook cycles (they hold the group's work) while the group is up, not
        # in the interpreter's exit, where Gloo's threads can abort it (seen once: SIGABRT).
        gc.collect()
        dist.destroy_process_group()


class _Collectives(TorchDispatchMode):
    """Records the c10d ops this rank issues, in order: (op, the name of its process group)."""

    def __init__(self):
        super().__init__()
        self.order = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.order.append((func._opname, _group_name(args)))
        return func(*args, **(kwargs or {}))


def _assert_averaged(model, local):
    """Every gradient is the average over the ranks of `local` (each rank's own, by name): a dense
    one all-reduced / W, an expert's its owner's / W (the all-to-alls brought it every token)."""
    for n, p in model.named_parameters():
        want = local[n] / dist.get_world_size()
        if ".experts." not in n:
            dist.all_reduce(want)
        assert torch.allclose(p.grad, want, atol=1e-7), n


def _check_step_averager(expert_parallel):
    """The core's own averager, the one the core-alone script runs (a part replaces it): nothing
    during backward, then at the step one all-reduce of every dense gradient on the data-parallel
    group, after which every gradient is the average over ranks."""
    args = common.parse_args(common.get_parser("t"), CFG)
    model = expert_parallel.parallelize(common.build_model(args), torch.device("cpu"))
    averager = expert_parallel.StepAverager(model)
    torch.manual_seed(2 + dist.get_rank())
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    with _Collectives() as in_backward:
        loss.backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    with _Collectives() as at_step:
        averager.wait(None, (), {})
    assert all(op.startswith("alltoall") for op, _ in in_backward.order), in_backward.order
    assert at_step.order == [("allreduce_", dist.group.WORLD.group_name)], at_step.order
    _assert_averaged(model, local)


def _check_overlap(expert_parallel):
    """The dense gradients go in L + 2 all-reduces, the first ones issued during backward,
    interleaved with the MoE layers' all-to-alls, on a process group of their own (on the
    all-to-alls' NCCL communicator each would run in turn with them: no overlap); once waited for
    (the optimizer's pre-step hook; no optimizer here, it would import torch._dynamo for seconds),
    every gradient is the average over ranks."""
    args = common.parse_args(common.get_parser("t"), CFG)
    model = expert_parallel.parallelize(common.build_model(args), torch.device("cpu"))
    averager = expert_parallel.GradientAverager(model)
    torch.manual_seed(2 + dist.get_rank())
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    with _Collectives() as seen:
        loss.backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters()}
        averager.wait(None, (), {})
    ops = [op for op, _ in seen.order]
    all_reduces = [i for i, op in enumerate(ops) if op == "allreduce_"]
    all_to_alls = [i for i, op in enumerate(ops) if op.startswith("alltoall")]
    assert len(all_reduces) == args.depth + 2, seen.order
    assert all_reduces[0] < all_to_alls[-1], seen.order  # the first starts before backward ends
    reduce_groups = {seen.order[i][1] for i in all_reduces}
    all_to_all_groups = {seen.order[i][1] for i in all_to_alls}
    assert reduce_groups == {averager.group.group_name}, seen.order
    assert all_to_all_groups == {dist.group.WORLD.group_name}, seen.order
    assert reduce_groups.isdisjoint(all_to_all_groups), seen.order  # not one communicator
    _assert_averaged(model, local)


def _check_same_order_everywhere(expert_parallel):
    """A dense parameter with a gradient on rank 0 only (rank 1's head leaves its bias out, as a
    branch some ranks skip would): every rank still issues the same collectives in the same order,
    the all-reduces placed alike among the all-to-alls (NCCL's rule, across communicators too), and
    the bias ends with rank 0's gradient / W."""
    rank, world = dist.get_rank(), dist.get_world_size()
    args = common.parse_args(common.get_parser("t"), CFG)
    model = expert_parallel.parallelize(common.build_model(args), torch.device("cpu"))
    averager = expert_parallel.GradientAverager(model)
    fc = model.head.fc
    if rank == 1:
        fc.forward = lambda h: torch.nn.functional.linear(h, fc.weight)
    torch.manual_seed(2 + rank)
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    with _Collectives() as seen:
        loss.backward()
        got_one = fc.bias.grad is not None
        bias = fc.bias.grad.clone() if got_one else torch.zeros_like(fc.bias)
        averager.wait(None, (), {})
    assert got_one == (rank == 0)
    orders = [None] * world
    dist.all_gather_object(orders, seen.order)
    assert all(order == orders[0] for order in orders), orders
    dist.all_reduce(bias)
    assert torch.count_nonzero(bias) > 0 and torch.allclose(fc.bias.grad, bias / world, atol=1e-7)


def _check_late_gradient_is_an_error(expert_parallel):
    """Units given out of forward order (the blocks swapped): block 0's bucket starts where
    backward reaches block 1's MoE layer, before block 0's gradients exist; the gradient that
    comes after its bucket's all-reduce started is an error, not a wrong average."""
    args = common.parse_args(common.get_parser("t"), CFG)
    model = expert_parallel.parallelize(common.build_model(args), torch.device("cpu"))
    swapped = [model.embed, model.blocks[1], model.blocks[0], model.head]
    expert_parallel.GradientAverager(model, units=swapped)
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    try:
        loss.backward()
    except RuntimeError as error:
        assert "came after its bucket's all-reduce started" in str(error), error
    else:
        raise AssertionError("a gradient came after its bucket's all-reduce, unnoticed")


def _check_own_group_of_subgroups(expert_parallel):
    """Data groups smaller than the world (here one rank each): every rank makes every group's
    copy (new_group's rule, or the next collective hangs) and keeps its own."""
    rank = dist.get_rank()
    data_groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    group = expert_parallel.own_group(data_groups[rank])
    assert dist.get_process_group_ranks(group) == [rank]
    value = torch.tensor([1.0 + rank])
    dist.all_reduce(value, group=group)
    assert value.item() == 1.0 + rank
    dist.barrier()  # the world's communicator still in step


def test_dispatch_combine_equals_loop_over_experts():
    mp.spawn(_dispatch_worker, args=(2, common.free_port()), nprocs=2)


def test_runs_as_the_script():
    """`python expert_parallel.py --experts 4` (the script as __main__, where the other tests import
    it): the ViT's MoE blocks are the classes parallelize looks for, so the experts are split."""
    result = ok(fork_launch("expert_parallel.py", 2, *CFG, "--max-steps", "1"))
    assert result["steps"] == 1 and result["comm_calls"]["all_to_all"] > 0


@pytest.mark.parametrize("script", OTHERS)
def test_other_scripts_stay_exact_on_moe(script, runs, refs):
    """The load-balancing gradient is added inside the MoE layer (scaled for pipeline.py's
    micro-batches): these scripts take the MoE model unchanged and stay exact (SGD).
    amp_checkpoint.py's accumulation is the next test's, in this process."""
    path, _ = runs[script]
    assert max_diff(path, refs["sgd"]) <= TOL["sgd"]


def test_aux_gradient_scaled_for_micro_batches():
    """amp_checkpoint.py --grad-accum 2 (and pipeline.py --microbatches 2) run two halves, each
    loss / 2: the model built for them must give the whole batch's gradients; one built for single
    forwards must not."""
    args = common.parse_args(common.get_parser("t"), CFG + ["--aux-loss", "0.1"])
    torch.manual_seed(0)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))

    def grads(model, parts):
        for xm, ym in zip(x.chunk(parts), y.chunk(parts), strict=True):
            (torch.nn.functional.cross_entropy(model(xm), ym) / parts).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    whole = grads(common.build_model(args), 1)
    halves = grads(common.build_model(args, forwards_per_step=2), 2)
    assert max((whole[n] - halves[n]).abs().max().item() for n in whole) < 1e-7
    unscaled = grads(common.build_model(args), 2)
    assert (
        whole["blocks.0.mlp.router.weight"] - unscaled["blocks.0.mlp.router.weight"]
    ).abs().max() > 1e-4


def test_aux_loss_is_a_per_image_mean():
    """What the layer adds in backward is the gradient of coef · mean over images of sum_i f_i P_i,
    f from the counts of the image's tokens: computed here by hand, for a batch and for its halves
    (the mean of halves)."""
    args = common.parse_args(common.get_parser("t"), CFG + ["--aux-loss", "0.5"])
    torch.manual_seed(0)
    moe = common.build_model(args).blocks[0].mlp
    x = torch.randn(6, 16, args.dim)

    def router_grad(batch, scale=1.0):
        moe.zero_grad()
        (moe(batch) * 0).sum().backward()  # only the aux term's gradient reaches the router
        return moe.router.weight.grad.clone() * scale

    E, K, T = args.experts, args.top_k, 16
    logits = moe.router(x.reshape(-1, args.dim)).view(6, T, E)
    f = torch.nn.functional.one_hot(logits.topk(K, -1).indices, E).sum((1, 2)) * (E / (K * T))
    aux = 0.5 * (f * logits.softmax(-1).mean(1)).sum(-1).mean()
    want = torch.autograd.grad(aux, moe.router.weight)[0]
    assert torch.allclose(router_grad(x), want, atol=1e-7)
    assert torch.allclose((router_grad(x[:3]) + router_grad(x[3:])) / 2, want, atol=1e-7)
