"""Every ``+exp=<setting>_<norm>`` name, composed instead of copied.

``configs/exp`` keeps one file per setting (model, data, recipe: ``swin_t.yaml``,
``llama_71m.yaml``, ...) and the few real special cases (``iwslt14_un.yaml``). For each setting
file that leaves the norm open and each norm in ``configs/norm``, this Hydra plugin stores
``exp/<setting>_<norm>`` in Hydra's ConfigStore: the setting's file with ``override /norm:
<norm>``. So ``+exp=swin_t_un`` is ``+exp=swin_t norm=un``, for every registry norm and every
setting, with no file to copy; a file of that name, where one exists, is used instead.

Hydra finds it by itself (its plugins live in the ``hydra_plugins`` namespace package), so
every composition sees the names: ``scripts/train.py``, the tests, ``hydra.compose``. A name
that is none (``check_experiment``) is refused with the closest names, where Hydra's own
error would list all of them.

The graph norms (``configs/graph_norm``: torch_geometric's and GRANOLA, which only graph
models take) are stored in the ``norm`` group too, and composed with the settings whose
task is ``graph`` only: ``+exp=graph_transformer_pattern_granola``.
"""
from __future__ import annotations

import difflib
from pathlib import Path

import yaml
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.plugins.search_path_plugin import SearchPathPlugin

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
_registered: dict[Path, tuple] = {}  # the files each configs folder's names were stored from


def open_norm_settings(configs: Path = CONFIGS) -> list[str]:
    """The ``configs/exp`` files that leave the norm open (no ``override /norm``)."""
    settings = []
    for path in sorted((configs / "exp").glob("*.yaml")):
        defaults = (yaml.safe_load(path.read_text()) or {}).get("defaults") or []
        if not any(isinstance(entry, dict) and "override /norm" in entry for entry in defaults):
            settings.append(path.stem)
    return settings


def graph_settings(configs: Path = CONFIGS) -> set[str]:
    """The settings of graph models (``task: graph``), which also take the graph norms."""
    return {path.stem for path in (configs / "exp").glob("*.yaml")
            if (yaml.safe_load(path.read_text()) or {}).get("task") == "graph"}


def experiment_names(configs: Path = CONFIGS) -> dict[str, tuple[str, str]]:
    """``{<setting>_<norm>: (setting, norm)}`` for the names without a file of their own."""
    files = {path.stem for path in (configs / "exp").glob("*.yaml")}
    norms = sorted(path.stem for path in (configs / "norm").glob("*.yaml"))
    graph_norms = sorted(path.stem for path in (configs / "graph_norm").glob("*.yaml"))
    graphs = graph_settings(configs)
    return {f"{setting}_{norm}": (setting, norm) for setting in open_norm_settings(configs)
            for norm in norms + (graph_norms if setting in graphs else [])
            if f"{setting}_{norm}" not in files}


def check_experiment(name: str, configs: Path = CONFIGS) -> None:
    """Refuse an ``+exp=`` name that names no experiment, naming the closest names."""
    known = {path.stem for path in (configs / "exp").glob("*.yaml")} | set(experiment_names(configs))
    if name in known:
        return
    close = difflib.get_close_matches(name, sorted(known), n=5)
    norms = sorted(path.stem for path in (configs / "norm").glob("*.yaml"))
    raise ValueError(f"+exp={name} is no experiment. " + (
        f"Closest: {', '.join(close)}" if close else
        f"A name is <setting>_<norm>, the setting one of {', '.join(open_norm_settings(configs))} "
        f"and the norm one of {', '.join(norms)}, or a file of {configs / 'exp'}"))


def register_experiments(configs: Path = CONFIGS) -> None:
    """Store the names in Hydra's ConfigStore, anew when an experiment or norm file changed
    (Hydra asks before every composition; storing them is most of its cost)."""
    files = tuple((path.name, path.stat().st_mtime_ns) for kind in ("exp", "norm", "graph_norm")
                  for path in sorted((configs / kind).glob("*.yaml")))
    if _registered.get(configs) == files:
        return
    store = ConfigStore.instance()
    for path in sorted((configs / "graph_norm").glob("*.yaml")):
        store.store(group="norm", name=path.stem, node=yaml.safe_load(path.read_text()))
    for name, (setting, norm) in experiment_names(configs).items():
        store.store(group="exp", name=name, package="_global_",
                    node={"defaults": [setting, {"override /norm": norm}, "_self_"]})
    _registered[configs] = files


class UnnormExperiments(SearchPathPlugin):
    """Registers the composed experiment names before Hydra searches for configs."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        register_experiments()
