"""Every check a composed recipe must pass before anything launches, in one place.

The rules mirror what Megatron-LM asserts later (after minutes of start-up on a full cluster), plus our own
(mandatory fields, network settings). All problems are reported at once; each line says what to change.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from omegaconf import DictConfig, OmegaConf

from uccl_ep_train.launchers.recipes import RecipeError, env_file_path, parse_env_file

# What to tell a user who left a mandatory (???) field unset.
_MISSING_HINTS = {
    "cluster.account": "your Slurm account, e.g. cluster.account=my_project (cluster.account=null if your Slurm "
                       "has no accounts)",
    "cluster.container.image": "the training image, e.g. cluster.container.image=/fsx/images/uccl.sqsh (pyxis) or "
                               "a registry name (docker); cluster.container.runtime=none uses the host Python",
    "data.path": "the indexed dataset prefix made by Megatron's preprocess_data.py, e.g. "
                 "data.path=/data/dsv3_text_document (or data=mock for random tokens)",
}

NETWORKS = ("none", "efa", "broadcom_thor2", "amd_pollara")
# Flow-control caps the Broadcom and AMD NICs need (writes, bytes in flight per proxy thread).
NIC_CAPS = {"broadcom_thor2": (1, 3 << 19), "amd_pollara": (1, 4 << 20)}
_LAYOUT_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


@dataclass(frozen=True)
class Topology:
    """Sizes derived from a valid recipe."""

    nodes: int
    gpus_per_node: int
    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    vpp: int | None


def validate(cfg: DictConfig, environ: Mapping[str, str] | None = None) -> Topology:
    """Check the recipe; return the derived sizes or raise RecipeError listing every problem and its fix."""
    problems: list[str] = []
    missing = sorted(OmegaConf.missing_keys(cfg))
    for key in missing:
        problems.append(f"{key} is not set: give {_MISSING_HINTS.get(key, f'{key}=<value>')}")
    if missing:  # the other checks would trip over ??? values
        raise RecipeError(_format(problems))

    par, model, train, cluster = cfg.parallelism, cfg.model, cfg.training, cfg.cluster
    sizes = {k: par[k] for k in ("nodes", "gpus_per_node", "tp", "pp", "cp", "ep", "etp")}
    for key, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            problems.append(f"parallelism.{key}={value} must be a positive integer")
    if problems:
        raise RecipeError(_format(problems))
    nodes, gpn, tp, pp, cp, ep, etp = (sizes[k] for k in ("nodes", "gpus_per_node", "tp", "pp", "cp", "ep", "etp"))

    # --- world size = TP * PP * CP * DP
    world = nodes * gpn
    model_parallel = tp * pp * cp
    dp = world // model_parallel if world % model_parallel == 0 else 0
    if not dp:
        problems.append(
            f"world size {world} (parallelism.nodes={nodes} x parallelism.gpus_per_node={gpn}) is not divisible by "
            f"TP*PP*CP = {tp}*{pp}*{cp} = {model_parallel}: world size must equal TP*PP*CP*DP; change the node/GPU "
            f"count or the model-parallel sizes")
    if cluster.gpus_per_node is not None and gpn > cluster.gpus_per_node:
        problems.append(f"parallelism.gpus_per_node={gpn} exceeds the {cluster.gpus_per_node} GPUs of a "
                        f"{cluster.name} node: lower it (and raise parallelism.nodes)")

    # --- expert parallelism (Megatron: world % (ETP*EP*PP) == 0, i.e. EP*ETP divides TP*CP*DP)
    if dp and (tp * cp * dp) % (ep * etp):
        problems.append(
            f"EP*ETP = {ep}*{etp} = {ep * etp} must divide TP*CP*DP = {tp}*{cp}*{dp} = {tp * cp * dp} (Megatron "
            f"builds expert groups from the same GPUs): lower parallelism.ep or parallelism.etp, or add GPUs")
    experts = model.moe.num_experts
    if experts and experts % ep:
        problems.append(f"model.moe.num_experts={experts} is not divisible by parallelism.ep={ep}: choose an EP "
                        f"that divides {experts}")
    if ep > 1 and tp > 1 and not par.sequence_parallel:
        problems.append("parallelism.sequence_parallel=false with TP>1 and EP>1: Megatron's MoE layers need "
                        "sequence parallelism then; set parallelism.sequence_parallel=true")
    if model.num_attention_heads % tp:
        problems.append(f"model.num_attention_heads={model.num_attention_heads} is not divisible by "
                        f"parallelism.tp={tp}")
    problems += _routing_problems(model)

    # --- batch: global = micro * DP * accumulation steps
    if dp and train.global_batch_size % (train.micro_batch_size * dp):
        problems.append(
            f"training.global_batch_size={train.global_batch_size} is not divisible by training.micro_batch_size "
            f"* DP = {train.micro_batch_size}*{dp} = {train.micro_batch_size * dp}: use a multiple of "
            f"{train.micro_batch_size * dp}")

    # --- pipeline: every layer placed exactly once
    vpp, layout_problems = _pipeline_problems(par, model)
    problems += layout_problems
    problems += _layer_freq_problems(model)

    # --- data
    if cfg.data.kind not in ("mock", "indexed"):
        problems.append(f"data.kind={cfg.data.kind!r}: use data=mock or data=indexed")

    # --- dispatcher and network environment
    problems += _dispatcher_problems(cfg, nodes)
    problems += _network_problems(cfg, environ)

    if cluster.launcher not in ("local", "slurm"):
        problems.append(f"cluster.launcher={cluster.launcher!r}: use local or slurm")
    if cluster.launcher == "local" and nodes > 1:
        problems.append(f"cluster={cluster.name} runs on this host only but parallelism.nodes={nodes}: pick a Slurm "
                        f"cluster (cluster=p5en_efa ...) or a single-node parallelism recipe")
    if cluster.container.runtime not in ("none", "pyxis", "docker"):
        problems.append(f"cluster.container.runtime={cluster.container.runtime!r}: use none, pyxis or docker")
    if problems:
        raise RecipeError(_format(problems))
    return Topology(nodes, gpn, world, tp, pp, cp, dp, ep, etp, vpp)


def _format(problems: list[str]) -> str:
    if len(problems) == 1:
        return f"invalid recipe: {problems[0]}"
    return "invalid recipe:\n" + "\n".join(f"  - {p}" for p in problems)


def _routing_problems(model) -> list[str]:
    moe, out = model.moe, []
    if not moe.num_experts:
        return out
    if not 1 <= moe.router_topk <= moe.num_experts:
        out.append(f"model.moe.router_topk={moe.router_topk} must be between 1 and num_experts={moe.num_experts}")
    groups, group_topk = moe.router_num_groups, moe.router_group_topk
    if groups:
        if moe.num_experts % groups:
            out.append(f"model.moe.num_experts={moe.num_experts} is not divisible by router_num_groups={groups}")
        elif not group_topk or group_topk > groups:
            out.append(f"model.moe.router_group_topk={group_topk} must be between 1 and router_num_groups={groups}")
        elif moe.router_topk > group_topk * (moe.num_experts // groups):
            out.append(f"model.moe.router_topk={moe.router_topk} exceeds the experts of {group_topk} groups "
                       f"({group_topk * (moe.num_experts // groups)}): raise router_group_topk")
    return out


def _pipeline_problems(par, model) -> tuple[int | None, list[str]]:
    pp, layers, out = par.pp, model.num_layers, []
    mtp = model.mtp.num_layers or 0
    if par.layout:
        stages = parse_layout(par.layout)
        if stages is None:
            return None, [f"parallelism.layout={par.layout!r} is not a Megatron pipeline layout (stages split by '|', "
                          f"E=embedding, t=decoder layer, m=MTP layer, L=loss, (..)*n and x*n repeat)"]
        flat = [c for stage in stages for c in stage]
        if len(stages) % pp:
            out.append(f"parallelism.layout has {len(stages)} stages, not a multiple of parallelism.pp={pp}")
        if flat.count("t") != layers:
            out.append(f"parallelism.layout places {flat.count('t')} decoder layers ('t') but model.num_layers="
                       f"{layers}: the layout must cover every layer exactly once")
        if flat.count("m") != mtp:
            out.append(f"parallelism.layout places {flat.count('m')} MTP layers ('m') but model.mtp.num_layers={mtp}")
        if not flat or flat[0] != "E" or flat[-1] != "L" or flat.count("E") != 1 or flat.count("L") != 1:
            out.append("parallelism.layout must start with the embedding 'E' and end with the loss 'L', once each")
        if par.vpp is not None:
            out.append("give parallelism.layout or parallelism.vpp, not both (the layout fixes the virtual stages)")
        vpp = len(stages) // pp if len(stages) % pp == 0 and len(stages) > pp else None
    elif par.vpp:
        vpp = par.vpp
        if layers % (pp * vpp):
            out.append(f"model.num_layers={layers} is not divisible by PP*VPP = {pp}*{vpp}: layers would be left "
                       f"unplaced; change parallelism.pp/vpp or give parallelism.layout")
    else:
        vpp = None
        if layers % pp:
            out.append(f"model.num_layers={layers} is not divisible by parallelism.pp={pp}: give parallelism.layout "
                       f"(e.g. \"Et|(tt|)*30,mL\") to place the layers unevenly")
    if vpp and pp < 2:
        out.append(f"virtual pipeline stages need parallelism.pp >= 2 (got {pp})")
    return vpp, out


def parse_layout(layout: str) -> list[list[str]] | None:
    """Megatron's pipeline layout grammar: '|' splits stages; (..)*n and x*n repeat; ',' is cosmetic."""
    text = layout.replace(",", "").replace(" ", "")
    previous = None
    while previous != text:
        previous = text
        text = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = [list(stage) for stage in text.split("|")]
    if any(c not in _LAYOUT_CHARS for stage in stages for c in stage):
        return None
    return stages


def parse_layer_freq(freq) -> list[int] | None:
    """model.moe.layer_freq as a per-layer 0/1 list: an int N (every N-th layer) or '([0]*3+[1]*58)'."""
    if isinstance(freq, int):
        return None
    text = str(freq).strip()
    if not re.fullmatch(r"[\[\]0-9*+(), ]+", text):
        raise ValueError(f"{text!r} is neither an integer nor a list expression like ([0]*3+[1]*58)")
    value = eval(text, {"__builtins__": {}}, {})  # noqa: S307 - digits, brackets, * and + only (checked above)
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise ValueError(f"{text!r} must evaluate to a list of 0/1")
    return value


def _layer_freq_problems(model) -> list[str]:
    if not model.moe.num_experts:
        return []
    try:
        pattern = parse_layer_freq(model.moe.layer_freq)
    except ValueError as exc:
        return [f"model.moe.layer_freq: {exc}"]
    if pattern is not None and len(pattern) != model.num_layers:
        return [f"model.moe.layer_freq has {len(pattern)} entries but model.num_layers={model.num_layers}: one 0/1 "
                f"per layer, e.g. \"([0]*3+[1]*{model.num_layers - 3})\""]
    return []


def _dispatcher_problems(cfg, nodes: int) -> list[str]:
    disp, out = cfg.dispatcher, []
    if disp.megatron_type not in ("uccl", "alltoall", "allgather", "flex"):
        out.append(f"dispatcher.megatron_type={disp.megatron_type!r}: use dispatcher=uccl, alltoall or flex_deepep")
    if disp.megatron_type == "flex" and cfg.cluster.network in ("efa", "broadcom_thor2", "amd_pollara") and nodes > 1:
        out.append(f"dispatcher={disp.name} (DeepEP) needs NVSHMEM/IBGDA NICs and cannot cross nodes on "
                   f"{cfg.cluster.network}: use dispatcher=uccl or dispatcher=alltoall on cluster={cfg.cluster.name}")
    return out


def cluster_environment(cfg, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The cluster's variables: its env file (as sourced into ``environ``) then cluster.env."""
    out: dict[str, str] = {}
    path = env_file_path(cfg.cluster.env_file)
    if path is not None:
        out.update(parse_env_file(path, environ))
    out.update({str(k): str(v) for k, v in (cfg.cluster.env or {}).items()})
    return out


def _network_problems(cfg, environ) -> list[str]:
    network, out = cfg.cluster.network, []
    if network not in NETWORKS:
        return [f"cluster.network={network!r}: use one of {', '.join(NETWORKS)}"]
    try:
        env = cluster_environment(cfg, environ)
    except RecipeError as exc:
        return [str(exc)]
    env.update({str(k): str(v) for k, v in (cfg.dispatcher.settings or {}).items()})
    env.update({str(k): str(v) for k, v in (cfg.run.env or {}).items()})
    efa = sorted(k for k, v in env.items() if k.startswith("FI_EFA") or (k == "FI_PROVIDER" and v == "efa")
                 or (k == "NCCL_NET_PLUGIN" and "ofi" in v))
    roce = sorted(k for k, v in env.items() if k.startswith(("HSA_", "RCCL_")) or k.endswith("_IB_GID_INDEX")
                  or (k.endswith("_IB_HCA") and re.search(r"bnxt|ionic", v)))
    if efa and roce:
        out.append(f"EFA settings ({', '.join(efa)}) and Broadcom/AMD RoCE settings ({', '.join(roce)}) are mixed: "
                   f"a cluster has one kind of NIC; remove the others from cluster.env / run.env / the env file")
    elif network == "efa" and roce:
        out.append(f"cluster.network=efa but Broadcom/AMD RoCE settings are present ({', '.join(roce)}): remove them")
    elif network in NIC_CAPS and efa:
        out.append(f"cluster.network={network} but EFA settings are present ({', '.join(efa)}): remove them")
    if network in NIC_CAPS:
        max_writes, max_bytes = NIC_CAPS[network]
        writes = int(env.get("UCCL_IB_MAX_INFLIGHT_NORMAL", "8"))
        nbytes = int(env.get("UCCL_IB_MAX_INFLIGHT_BYTES", str(2 << 20)))
        if writes > max_writes or nbytes > max_bytes:
            out.append(f"{network} NICs report transport retry errors above {max_writes} write / {max_bytes} bytes in "
                       f"flight per proxy thread, but UCCL_IB_MAX_INFLIGHT_NORMAL={writes}, "
                       f"UCCL_IB_MAX_INFLIGHT_BYTES={nbytes}: lower them (see launch/env/{cfg.cluster.env_file})")
    # The UCCL_* values themselves: the same parser the library uses at run time.
    from uccl_ep_train.settings import SettingsError, load_settings

    try:
        load_settings({k: v for k, v in env.items() if k.startswith("UCCL_")})
    except SettingsError as exc:
        out.append(str(exc))
    return out
