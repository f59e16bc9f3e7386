"""``optimizer=<name>`` (configs/optimizer, plugins/optim.py): AdamP and SGDP as the release
(clovaai/AdamP, the PyPI package ``adamp``) computes them, each task's default the optimizer
its recipe trained with, and what a task cannot take refused by name."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import adamp
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

import unnorm
from plugins.fairseq import launcher
from plugins.optim import create_optimizer
from plugins.runlog import config_differences, with_optimizer

ROOT = Path(__file__).resolve().parents[1]
RELEASE = {"adamp": adamp.AdamP, "sgdp": adamp.SGDP}


def config(*overrides):
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


class _Env:  # the launcher's fairseq environment, for building a command only
    def module(self, name):
        return ["python", "-m", name]


def standardized_net() -> nn.Module:
    """Conv and linear layers under Weight Standardization, whose weights are scale-invariant
    (the case AdamP's projection is for), a plain head, a norm."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                        nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 4))
    assert unnorm.standardize_weights(net, include=["0", "3", "6"]) == 3
    return net


def ten_steps(net: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    for _ in range(10):
        images, labels = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(images), labels).backward()
        optimizer.step()
    return {name: param.detach().clone() for name, param in net.named_parameters()}


#: the release's defaults (adamp 0.3.0's signatures), SGDP's momentum as its README runs it
RELEASE_SETTINGS = {"adamp": dict(betas=(0.9, 0.999), eps=1e-8, delta=0.1, wd_ratio=0.1, nesterov=False),
                    "sgdp": dict(momentum=0.9, eps=1e-8, delta=0.1, wd_ratio=0.1, nesterov=False)}


@pytest.mark.parametrize("name", ["adamp", "sgdp"])
def test_adamp_and_sgdp_are_the_releases_at_its_settings_on_standardised_layers(name):
    """optimizer=adamp|sgdp (timm's classes, built by timm's factory from the yaml) equals the
    release's package over 10 steps with delta, wd_ratio and nesterov explicit, on a model
    whose standardised weights the projection acts on (without it, delta 0, they differ);
    timm's factory defaults for the name (wd_ratio 0.01, nesterov) differ too."""
    from timm.optim import create_optimizer_v2

    lr, decay = 0.01, 0.05

    def run(build):
        net = standardized_net()
        return ten_steps(net, build(net.parameters()))

    ours = run(lambda params: create_optimizer(params, config(f"optimizer={name}").optimizer,
                                               lr=lr, weight_decay=decay))
    release = run(lambda params: RELEASE[name](params, lr=lr, weight_decay=decay,
                                               **RELEASE_SETTINGS[name]))
    for key, weight in release.items():
        torch.testing.assert_close(ours[key], weight, rtol=0, atol=0, msg=key)
    unprojected = run(lambda params: RELEASE[name](params, lr=lr, weight_decay=decay,
                                                   **{**RELEASE_SETTINGS[name], "delta": 0.0}))
    timm_defaults = run(lambda params: create_optimizer_v2(params, opt=name, lr=lr, weight_decay=decay))
    for other in (unprojected, timm_defaults):
        assert not torch.equal(other["0.weight"], release["0.weight"])


def test_each_tasks_default_is_the_optimizer_its_recipe_trained_with(tmp_path):
    """The optimizers the recipes state (the papers'): AdamW (0.9, 0.999) for ImageNet
    classification, detection and the LM; SGD with classical momentum 0.9 for CIFAR
    fine-tuning; fairseq's adam (decoupled decay) at (0.9, 0.98) for translation."""
    param = [nn.Parameter(torch.ones(2, 2))]
    for exp in ("swin_t_un", "t2t_vit_14_ln", "mask_rcnn_swin_t_un", "faster_rcnn_swin_t_ln", "llama_71m_ln"):
        optimizer = create_optimizer(param, config(f"+exp={exp}").optimizer, lr=1.0, weight_decay=0.0)
        assert type(optimizer) is torch.optim.AdamW, exp
        assert optimizer.defaults["betas"] == (0.9, 0.999) and optimizer.defaults["eps"] == 1e-8, exp
    for exp in ("swin_t_cifar10_un", "t2t_vit_14_cifar100_ln"):
        optimizer = create_optimizer(param, config(f"+exp={exp}").optimizer, lr=1.0, weight_decay=0.0)
        assert type(optimizer) is torch.optim.SGD, exp
        assert optimizer.defaults["momentum"] == 0.9 and optimizer.defaults["nesterov"] is False, exp
    for exp in ("iwslt14_un", "wmt14_ln"):
        command = " ".join(launcher.train_command(config(f"+exp={exp}"), _Env(), tmp_path, tmp_path))
        assert "--optimizer adam --adam-betas (0.9,0.98) --adam-eps 1e-08" in command, exp


@pytest.mark.parametrize("trainer, exp", [("plugins.timm.trainer", "swin_t_cifar10_un"),
                                          ("plugins.lm.trainer", "llama_71m_ln")])
def test_the_trainers_build_the_optimizer_the_run_names(trainer, exp):
    """Classification's and the LM's own ``_optimizer`` (the LM once hard-coded AdamW) build
    the release's SGDP with the yaml's options when the run names ``optimizer=sgdp``."""
    import importlib
    from types import SimpleNamespace

    import timm

    cfg = config(f"+exp={exp}", "optimizer=sgdp", "optimizer.wd_ratio=0.3")
    run = SimpleNamespace(cfg=cfg, model=timm.create_model("test_vit", num_classes=4))
    optimizer = importlib.import_module(trainer)._optimizer(run)
    assert type(optimizer) is adamp.SGDP
    assert all(group["wd_ratio"] == 0.3 and group["momentum"] == 0.9 and group["delta"] == 0.1
               and group["nesterov"] is False for group in optimizer.param_groups)


@pytest.mark.parametrize("overrides, fix", [
    (["optimizer.name=lamb"], r"optimizer.name='lamb': choose optimizer=adamw\|sgd\|adamp\|sgdp"),
    (["+optimizer.momentum=0.9"],
     r"optimizer=adamw takes betas, eps; it does not take momentum \(drop it: ~optimizer.momentum\)"),
    (["~optimizer.wd_ratio", "optimizer=adamp"], r"set wd_ratio \(configs/optimizer/adamp.yaml\)"),
])
def test_an_optimizer_option_that_would_not_be_honoured_is_refused(overrides, fix):
    with pytest.raises(ValueError, match=fix):
        create_optimizer([nn.Parameter(torch.ones(2))], config(*overrides).optimizer, lr=1.0,
                         weight_decay=0.0)


@pytest.mark.parametrize("overrides, fix", [
    (["optimizer=sgd", "optimizer.nesterov=true"],
     "optimizer=sgd with nesterov=True: fairseq's sgd has no nesterov; set optimizer.nesterov=false"),
    (["+recipe.train.optimizer=adam"], r"drop recipe.train.optimizer and set optimizer=\.\.\."),
    (["+recipe.train.momentum=0.9"], r"drop recipe.train.momentum"),
])
def test_translation_refuses_what_fairseq_would_not_take(overrides, fix, tmp_path):
    with pytest.raises(ValueError, match=fix):
        launcher.train_command(config("+exp=iwslt14_un", *overrides), _Env(), tmp_path, tmp_path)


@pytest.mark.parametrize("name", ["adamp", "sgdp", "sgd"])
def test_translation_builds_the_releases_optimizer_from_the_launchers_flags(name, tmp_path):
    """The launcher's command parsed by fairseq (its environment, the user dir) builds the
    release's AdamP/SGDP (fairseq's SGD) with every option of the yaml."""
    cfg = config("+exp=iwslt14_un", f"optimizer={name}", "optimizer.momentum=0.8" if "sgd" in name
                 else "optimizer.wd_ratio=0.2")
    command = launcher.train_command(cfg, _Env(), tmp_path, tmp_path)
    args = command[3:]  # past python -m plugins.fairseq.train
    code = ("import json, sys, torch\n"
            "from fairseq import options\n"
            "from fairseq.dataclass.utils import convert_namespace_to_omegaconf\n"
            "from fairseq.optim import build_optimizer\n"
            "args = options.parse_args_and_arch(options.get_training_parser(), sys.argv[1:])\n"
            "opt = build_optimizer(convert_namespace_to_omegaconf(args).optimizer,"
            " [torch.nn.Parameter(torch.ones(2, 2))])._optimizer\n"
            "print(json.dumps({'class': type(opt).__module__ + '.' + type(opt).__name__,"
            " 'defaults': opt.defaults}))\n")
    env = Path(os.environ.get("UNNORM_FAIRSEQ_ENV") or ROOT / ".venv-fairseq")
    if not (env / "bin" / "python").exists():
        pytest.skip(f"no fairseq environment at {env} (`make fairseq-env`)")
    result = subprocess.run([str(env / "bin" / "python"), "-c", code, *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    built = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {key: value for key, value in OmegaConf.to_container(cfg.optimizer).items() if key != "name"}
    if name == "sgd":
        assert built["class"] == "torch.optim.sgd.SGD" and built["defaults"]["nesterov"] is False
        expected.pop("nesterov")
    else:
        assert built["class"] == f"adamp.{name}.{name.upper() if name == 'sgdp' else 'AdamP'}"
    assert {key: built["defaults"][key] for key in expected} == expected
    assert built["defaults"]["weight_decay"] == cfg.recipe.train.weight_decay


def test_a_record_from_before_optimizer_continues_as_the_same_settings():
    """A stored config.yaml spelling the optimizer in its recipe (``recipe.opt``, fairseq's
    ``recipe.train.optimizer``, the LM's ``recipe.betas``) reads as today's default for its
    experiment: resuming it with that default finds no optimizer difference."""
    for exp, recipe in [("swin_t_un", {"opt": "adamw", "momentum": 0.9}),
                        ("swin_t_cifar10_un", {"opt": "momentum", "momentum": 0.9}),
                        ("iwslt14_un", {"train": {"optimizer": "adam", "adam_betas": "(0.9,0.98)"}}),
                        ("llama_71m_ln", {"betas": [0.9, 0.999]})]:
        new = yaml.safe_load(OmegaConf.to_yaml(config(f"+exp={exp}")))
        stored = {key: value for key, value in new.items() if key != "optimizer"}
        stored["recipe"] = {**stored["recipe"], **recipe}
        if "train" in recipe:
            stored["recipe"]["train"] = {**new["recipe"]["train"], **recipe["train"]}
        assert config_differences(with_optimizer(stored), new) == [], exp
        assert config_differences(with_optimizer(stored), {**new, "optimizer": {"name": "adamp"}}), exp
