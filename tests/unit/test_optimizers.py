"""zeromem.optim.optimizers against DeepSpeed's formulas, written out here step by step."""
from __future__ import annotations

import math
import threading

import pytest
import schedulefree
import torch

from zeromem.config.schema import Config, ConfigError, Unsupported
from zeromem.optim.factory import check_steps_shards, normalize_param_groups
from zeromem.optim.muon import ShardedMuon, muon_groups
from zeromem.optim.optimizers import Adam, Lamb, Lion


def tensors(seed: int = 0, shapes=((3, 4), (5,), (2, 2, 2))) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def grads(params, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def lamb_reference(p, m, v, g, t, lr, b1, b2, eps, wd, max_c, min_c, bias_correction, inside):
    """One FusedLamb step on one parameter (csrc/lamb/fused_lamb_cuda_kernel.cu)."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = torch.sqrt(v + eps) if inside else torch.sqrt(v) + eps
    update = m / denom + wd * p
    w_norm, u_norm = p.norm(), update.norm()
    ratio = 1.0 if w_norm == 0 or u_norm == 0 else float(min(max(w_norm / u_norm, min_c), max_c))
    size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) if bias_correction else lr
    return p - size * ratio * update, m, v, ratio


@pytest.mark.parametrize("bias_correction, inside, wd, max_c, min_c", [
    (True, False, 0.0, 10.0, 0.01), (False, False, 0.01, 10.0, 0.01), (True, True, 0.1, 10.0, 0.01),
    (True, False, 0.0, 0.5, 0.01),  # ratio clamped at max_coeff
    (True, False, 0.0, 10.0, 5.0),  # ratio clamped at min_coeff
])
def test_lamb_is_fused_lambs_math_per_parameter(bias_correction, inside, wd, max_c, min_c):
    params = tensors()
    options = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd, max_coeff=max_c,
                   min_coeff=min_c, bias_correction=bias_correction, eps_inside_sqrt=inside)
    opt = Lamb(params, **options)
    ref = [(p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for t in range(1, 5):
        for p, g in zip(params, grads(params, t)):
            p.grad = g
        opt.step()
        expected_ratios = []
        for i, g in enumerate(grads(params, t)):
            p, m, v, ratio = lamb_reference(*ref[i], g, t, 0.05, 0.8, 0.95, 1e-6, wd, max_c, min_c,
                                            bias_correction, inside)
            ref[i] = (p, m, v)
            expected_ratios.append(ratio)
        for p, (want, _, _) in zip(params, ref):
            torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
        assert [float(r) for r in opt.last_ratios] == pytest.approx(expected_ratios, rel=1e-5)
    if max_c == 0.5:
        assert all(float(r) == 0.5 for r in opt.last_ratios)
    if min_c == 5.0:
        assert all(float(r) == 5.0 for r in opt.last_ratios)


def test_lamb_ratio_is_one_for_zero_weights():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = Lamb([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    assert float(opt.last_ratios[0]) == 1.0
    assert torch.all(p < 0)


def test_lamb_over_a_flat_shard_takes_each_parameters_own_ratio():
    """One flat tensor holding three parameters (and padding) steps like the three apart."""
    apart = tensors(1)
    flat = torch.nn.Parameter(torch.cat([p.detach().flatten() for p in apart] + [torch.zeros(3)]))
    sizes = [p.numel() for p in apart]
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)] + [torch.full((3,), 3)])
    opt_apart, opt_flat = Lamb(apart, lr=0.1, weight_decay=0.01), Lamb([flat], lr=0.1, weight_decay=0.01)
    opt_flat.split(flat, segments, 3, reduce=None)
    for t in range(3):
        gs = grads(apart, t)
        for p, g in zip(apart, gs):
            p.grad = g
        flat.grad = torch.cat([g.flatten() for g in gs] + [torch.zeros(3)])
        opt_apart.step()
        opt_flat.step()
        torch.testing.assert_close(flat.detach()[:-3], torch.cat([p.detach().flatten() for p in apart]))
        assert torch.equal(flat.detach()[-3:], torch.zeros(3))  # padding stays zero
        torch.testing.assert_close(opt_flat.last_ratios[0], torch.cat(opt_apart.last_ratios))
    # a per-tensor ratio (no split) would differ: the three ratios are not equal
    assert len({round(float(r), 4) for r in opt_apart.last_ratios}) == 3


def test_lamb_sums_a_parameters_parts_through_reduce():
    """A parameter split in two, each half stepped by its own optimizer (two "ranks", two
    threads) whose reduce sums both halves' norms: the same step as the whole parameter."""
    whole = tensors(2, ((9,),))[0]
    halves = [torch.nn.Parameter(whole.detach()[:5].clone()), torch.nn.Parameter(whole.detach()[5:].clone())]
    barrier, parts = threading.Barrier(2), [None, None]

    def reducer(rank):
        def reduce(t):  # an all-reduce over the two threads
            parts[rank] = t.clone()
            barrier.wait()
            t.copy_(parts[0] + parts[1])
            barrier.wait()
        return reduce
    opts = [Lamb([h], lr=0.1, weight_decay=0.05) for h in halves]
    for rank, (opt, h) in enumerate(zip(opts, halves)):
        opt.split(h, torch.zeros(h.numel(), dtype=torch.long), 1, reducer(rank))
    ref = Lamb([whole], lr=0.1, weight_decay=0.05)
    for t in range(3):
        g = torch.randn(9, generator=torch.Generator().manual_seed(t))
        whole.grad, halves[0].grad, halves[1].grad = g, g[:5].clone(), g[5:].clone()
        ref.step()
        threads = [threading.Thread(target=opt.step) for opt in opts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        torch.testing.assert_close(torch.cat([h.detach() for h in halves]), whole.detach())
        assert float(opts[0].last_ratios[0]) == pytest.approx(float(ref.last_ratios[0]))


def adam_reference(p, m, v, g, t, lr, b1, b2, eps, wd, adam_w_mode, bias_correction):
    """One FusedAdam step (csrc/adam/multi_tensor_adam.cu)."""
    if not adam_w_mode:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if bias_correction else (1.0, 1.0)
    update = (m / bc1) / (torch.sqrt(v / bc2) + eps)
    if adam_w_mode:
        update = update + wd * p
    return p - lr * update, m, v


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_is_fused_adams_math(adam_w_mode, bias_correction):
    params = tensors(3)
    opt = Adam(params, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
               adam_w_mode=adam_w_mode, bias_correction=bias_correction)
    ref = [(p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for t in range(1, 5):
        for p, g in zip(params, grads(params, t)):
            p.grad = g
        opt.step()
        ref = [adam_reference(*r, g, t, 0.01, 0.9, 0.99, 1e-8, 0.1, adam_w_mode, bias_correction)
               for r, g in zip(ref, grads(params, t))]
    for p, (want, _, _) in zip(params, ref):
        torch.testing.assert_close(p.detach(), want)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_corrected_adam_equals_torchs(adam_w_mode):
    torchs = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ours, theirs = step_side_by_side(
        lambda ps: Adam(ps, lr=0.01, weight_decay=0.1, adam_w_mode=adam_w_mode),
        lambda ps: torchs(ps, lr=0.01, weight_decay=0.1), steps=4)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def step_side_by_side(make, make_twin, steps: int) -> tuple[list, list]:
    """Two optimizers over equal parameters, stepped on the same gradients; the parameters."""
    params, twins = tensors(4), tensors(4)
    ours, theirs = make(params), make_twin(twins)
    for t in range(steps):
        for group in (params, twins):
            for p, g in zip(group, grads(group, t)):
                p.grad = g
        ours.step()
        theirs.step()
    return params, twins


def test_lion_is_fused_lions_math():
    params = tensors(5)
    opt = Lion(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    ref = [(p.detach().clone(), torch.zeros_like(p)) for p in params]
    for t in range(4):
        for p, g in zip(params, grads(params, t)):
            p.grad = g
        opt.step()
        new = []
        for (p, m), g in zip(ref, grads(params, t)):
            p = p * (1 - 0.01 * 0.1) - 0.01 * torch.sign(0.9 * m + 0.1 * g)
            new.append((p, 0.99 * m + 0.01 * g))
        ref = new
    for p, (want, _) in zip(params, ref):
        torch.testing.assert_close(p.detach(), want)


# ---------------------------------------------------------------- the config blocks

def optimizer_of(params: dict, kind: str = "Adam"):
    return Config.load({"optimizer": {"type": kind, "params": params}}).optimizer


def test_bias_correction_false_runs_deepspeeds_adam():
    block = optimizer_of({"lr": 1e-3, "bias_correction": False, "weight_decay": 0.01})
    assert block.torch_class is Adam and block.type == "AdamW"  # DeepSpeed's Adam decouples
    assert block.params == {"lr": 1e-3, "weight_decay": 0.01, "bias_correction": False,
                            "adam_w_mode": True}
    l2 = optimizer_of({"bias_correction": False, "adam_w_mode": False, "weight_decay": 0.01})
    assert l2.torch_class is Adam and l2.params["adam_w_mode"] is False
    corrected = optimizer_of({"lr": 1e-3, "bias_correction": True})
    assert corrected.torch_class is torch.optim.Adam and "bias_correction" not in corrected.params
    with pytest.raises(ConfigError, match="optimizer.params.bias_correction must be true or false"):
        optimizer_of({"bias_correction": "no"})


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_deepspeeds_ops_adams_are_torchs_adam_and_adamw(adam_w_mode):
    """`deepspeed.ops.adam` as scripts build it: AdamW, or Adam with L2 decay when told."""
    from zeromem.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    want_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    for make in (lambda ps: FusedAdam(ps, lr=0.01, weight_decay=0.1, adam_w_mode=adam_w_mode),
                 lambda ps: DeepSpeedCPUAdam(ps, lr=0.01, weight_decay=0.1, adamw_mode=adam_w_mode)):
        ours, theirs = step_side_by_side(make, lambda ps: want_cls(ps, lr=0.01, weight_decay=0.1),
                                         steps=3)
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(NotImplementedError, match="bias_correction"):
        FusedAdam(tensors(1), bias_correction=False)


def test_deepspeeds_own_optimizers_load_with_their_keywords():
    lamb = optimizer_of({"lr": 4e-3, "weight_decay": 0.01, "bias_correction": False,
                         "max_coeff": 0.3, "min_coeff": 0.01}, "lamb")
    assert lamb.type == "Lamb" and lamb.torch_class is Lamb
    assert optimizer_of({"lr": 1e-4}, "Lion").torch_class is Lion
    assert optimizer_of({"lr": 1e-2, "lr_decay": 0.0}, "Adagrad").torch_class is torch.optim.Adagrad
    with pytest.raises(ConfigError, match="did you mean 'max_coeff'"):
        optimizer_of({"max_coef": 1.0}, "Lamb")
    with pytest.raises(ConfigError, match="optimizer.params.min_coeff must be >= 0"):
        optimizer_of({"min_coeff": -1.0}, "Lamb")


def test_lamb_with_nvme_optimizer_offload_is_refused():
    with pytest.raises(Unsupported, match="zero_optimization.offload_optimizer.device"):
        Config.load({"optimizer": {"type": "Lamb"},
                     "zero_optimization": {"stage": 2, "offload_optimizer": {
                         "device": "nvme", "nvme_path": "/tmp"}}})
    Config.load({"optimizer": {"type": "Lamb"},  # host memory: the step sees whole shards
                 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})


def test_deepspeeds_muon_loads_with_its_keys_and_not_on_nvme():
    muon = optimizer_of({"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "muon_lr": 0.03,
                         "adam_lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-10,
                         "ns_method": "standard"}, "muon")
    assert muon.type == "Muon" and muon.torch_class is ShardedMuon
    with pytest.raises(ConfigError, match="optimizer.params.ns_method"):
        optimizer_of({"ns_method": "svd"}, "Muon")
    with pytest.raises(Unsupported, match="Muon with NVMe optimizer offload"):
        Config.load({"optimizer": {"type": "Muon"}, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})


def test_muon_takes_deepspeeds_matrices_and_keeps_a_users_tags():
    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(5, 4),
                                 "proj": torch.nn.Linear(4, 3), "lm_head": torch.nn.Linear(3, 5)})
    model["proj"].bias.use_muon = True  # the user's choice stands (a vector: refused at the step)
    groups = muon_groups(model, [{"params": list(model.parameters()), "lr": 0.5}])
    assert [(g["use_muon"], [p.shape for p in g["params"]], g["lr"]) for g in groups] == [
        (True, [(3, 4), (3,)], 0.5), (False, [(5, 4), (5, 3), (5,)], 0.5)]


def test_muon_on_a_whole_matrix_is_torchs_muon_and_adam_its_aux_adamw():
    torch.manual_seed(0)
    w, b = torch.randn(6, 4), torch.randn(6)
    mine = [w.clone().requires_grad_(), b.clone().requires_grad_()]
    theirs = [w.clone().requires_grad_(), b.clone().requires_grad_()]
    ours = ShardedMuon([{"params": [mine[0]], "use_muon": True}, {"params": [mine[1]]}],
                       lr=0.05, weight_decay=0.1, momentum=0.9)
    reference = [torch.optim.Muon([theirs[0]], lr=0.05, weight_decay=0.1, momentum=0.9,
                                  adjust_lr_fn="original"),
                 torch.optim.AdamW([theirs[1]], lr=0.05, betas=(0.9, 0.95), eps=1e-10,
                                   weight_decay=0.1)]
    for step in range(3):
        grads = torch.randn(6, 4), torch.randn(6)
        for p, g in zip(mine + theirs, grads + grads):
            p.grad = g.clone()
        ours.step()
        for optimizer in reference:
            optimizer.step()
    for a, b in zip(mine, theirs):
        assert (a - b).abs().max() < 1e-6


class Adafactor(torch.optim.Optimizer):
    """Stands for transformers' or timm's Adafactor: another package's class, the same name."""

    def __init__(self, params):
        super().__init__(params, {})


class TunedAdamW(torch.optim.AdamW):
    """A user's subclass with a step of its own, which may read more than each element."""

    def step(self, closure=None):
        return super().step(closure)


class SetAdamW(torch.optim.AdamW):
    """A subclass that only sets options (deepspeed.ops' FusedAdam is one): AdamW's step."""


@pytest.mark.parametrize("make, said", [
    (lambda ps: torch.optim.Adafactor(ps), "row and column means"),
    (lambda ps: Adafactor(ps), "row and column means"),
    (lambda ps: torch.optim.LBFGS(ps), "closure"),
    (lambda ps: torch.optim.SparseAdam(ps), "sparse gradients only"),
    (lambda ps: torch.optim.Muon([p for p in ps if p.ndim == 2]), "orthogonalises"),
])
def test_optimizers_that_need_whole_parameters_are_refused_with_the_reason(make, said):
    optimizer = make(tensors())
    with pytest.raises(NotImplementedError, match=f"{type(optimizer).__name__} cannot step") as error:
        check_steps_shards(optimizer)
    assert said in str(error.value) and "NAdam" in str(error.value)  # what to use instead


def test_an_optimizer_not_known_elementwise_is_warned_about(caplog):
    check_steps_shards(torch.optim.NAdam(tensors()))
    check_steps_shards(Lion(tensors()))
    check_steps_shards(SetAdamW(tensors()))
    check_steps_shards(schedulefree.AdamWScheduleFree(tensors()))  # known by its name
    assert not caplog.records
    check_steps_shards(TunedAdamW(tensors()))
    assert "TunedAdamW steps zeromem's flat 1-D master shards" in caplog.text


def test_a_param_group_holding_a_parameter_the_model_does_not_have_is_refused():
    """Uncertainty weighting's learned log-variance kept beside the model: it failed with a
    KeyError (an id) at stages 0-2 and was silently never stepped at stage 3."""
    model = torch.nn.Linear(3, 2)
    log_var = torch.nn.Parameter(torch.zeros(()))
    groups = [{"params": list(model.parameters())}, {"params": [log_var], "lr": 0.1}]
    with pytest.raises(ValueError, match=r"param group 1 holds a parameter of shape \[\] that is "
                                         r"not the model's.*register it on a module"):
        normalize_param_groups(model, groups)
    model.log_var = log_var  # registered: the model's own now
    assert [len(g["params"]) for g in normalize_param_groups(model, groups)] == [2, 1]


def test_named_parameters_are_taken_as_torchs_optimizers_take_them():
    """torch 2.6+ optimizers take `model.named_parameters()`, whole or in groups; the
    engine's model_parameters failed on the pairs ('tuple' has no requires_grad)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    whole = normalize_param_groups(model, model.named_parameters())
    assert [p for p in whole[0]["params"]] == list(model.parameters())
    split = normalize_param_groups(model, [{"params": model[0].named_parameters(), "lr": 0.1},
                                           {"params": model[1].weight}])
    assert [len(g["params"]) for g in split] == [2, 1] and split[0]["lr"] == 0.1
    assert not model[1].bias.requires_grad  # in no group: frozen, as before
