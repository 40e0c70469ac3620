"""A composed, validated recipe -> the Megatron-LM command line and the environment of every rank.

Pure: no file system, no process, no clock. The launchers (local.py, slurm.py) wrap the result in torchrun.
Flag names are megatron-core's (megatron/training/arguments.py); tests parse the output with Megatron's own parser.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from uccl_ep_train.launchers.validation import Topology

# Megatron needs one CUDA hardware queue so TP/SP communication kernels keep their order with compute.
BASE_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@dataclass(frozen=True)
class Invocation:
    """What every rank runs: ``python -m <module> <argv>`` under ``env``."""

    module: str
    argv: list[str]
    # Variables to set on top of the cluster's env file (which the launchers source or embed themselves).
    env: dict[str, str] = field(default_factory=dict)


def _flag(out: list[str], name: str, value) -> None:
    """Append ``--name value``; booleans become bare flags (True) or nothing (False); None is skipped."""
    if value is None or value is False:
        return
    out.append(f"--{name}")
    if value is not True:
        out.append(str(value))


def model_args(model: DictConfig) -> list[str]:
    """The architecture flags (the part launch/*.sbatch hard-codes for users without the Python launcher)."""
    a: list[str] = []
    _flag(a, "num-layers", model.num_layers)
    _flag(a, "hidden-size", model.hidden_size)
    _flag(a, "ffn-hidden-size", model.ffn_hidden_size)
    _flag(a, "num-attention-heads", model.num_attention_heads)
    _flag(a, "kv-channels", model.kv_channels)
    _flag(a, "normalization", model.normalization)
    _flag(a, "norm-epsilon", model.norm_epsilon)
    _flag(a, "swiglu", model.swiglu)
    _flag(a, "disable-bias-linear", model.disable_bias_linear)
    _flag(a, "untie-embeddings-and-output-weights", model.untie_embeddings_and_output_weights)
    _flag(a, "init-method-std", model.init_method_std)
    _flag(a, "attention-dropout", 0.0)
    _flag(a, "hidden-dropout", 0.0)
    _flag(a, "position-embedding-type", "rope")
    _flag(a, "rotary-base", model.rope.rotary_base)
    _flag(a, "max-position-embeddings", model.max_position_embeddings)
    _flag(a, "make-vocab-size-divisible-by", model.make_vocab_size_divisible_by)
    if model.mla.enabled:
        _flag(a, "multi-latent-attention", True)
        _flag(a, "q-lora-rank", model.mla.q_lora_rank)
        _flag(a, "kv-lora-rank", model.mla.kv_lora_rank)
        _flag(a, "qk-head-dim", model.mla.qk_head_dim)
        _flag(a, "qk-pos-emb-head-dim", model.mla.qk_pos_emb_head_dim)
        _flag(a, "v-head-dim", model.mla.v_head_dim)
        _flag(a, "qk-layernorm", model.mla.qk_layernorm)
        _flag(a, "rope-type", model.rope.type)
        _flag(a, "rotary-scaling-factor", model.rope.rotary_scaling_factor)
        _flag(a, "mscale", model.rope.mscale)
        _flag(a, "mscale-all-dim", model.rope.mscale_all_dim)
        # Megatron's fused RoPE (on by default) works with MLA only for YaRN: TransformerConfig refuses the rest.
        _flag(a, "no-rope-fusion", model.rope.type != "yarn")
    moe = model.moe
    if moe.num_experts:
        _flag(a, "num-experts", moe.num_experts)
        _flag(a, "moe-layer-freq", moe.layer_freq)
        _flag(a, "moe-ffn-hidden-size", moe.ffn_hidden_size)
        _flag(a, "moe-shared-expert-intermediate-size", moe.shared_expert_intermediate_size)
        _flag(a, "moe-router-topk", moe.router_topk)
        _flag(a, "moe-router-num-groups", moe.router_num_groups)
        _flag(a, "moe-router-group-topk", moe.router_group_topk)
        _flag(a, "moe-router-score-function", moe.router_score_function)
        _flag(a, "moe-router-enable-expert-bias", moe.router_enable_expert_bias)
        if moe.router_enable_expert_bias:
            _flag(a, "moe-router-bias-update-rate", moe.router_bias_update_rate)
        _flag(a, "moe-router-topk-scaling-factor", moe.router_topk_scaling_factor)
        _flag(a, "moe-router-dtype", moe.router_dtype)
        _flag(a, "moe-router-load-balancing-type", moe.router_load_balancing_type)
        _flag(a, "moe-aux-loss-coeff", moe.aux_loss_coeff)
        _flag(a, "moe-grouped-gemm", moe.grouped_gemm)
    if model.mtp.num_layers:
        _flag(a, "mtp-num-layers", model.mtp.num_layers)
        _flag(a, "mtp-loss-scaling-factor", model.mtp.loss_scaling_factor)
    return a


def parallel_args(cfg: DictConfig, topo: Topology) -> list[str]:
    par, a = cfg.parallelism, []
    _flag(a, "tensor-model-parallel-size", topo.tp)
    _flag(a, "pipeline-model-parallel-size", topo.pp)
    _flag(a, "context-parallel-size", topo.cp)
    _flag(a, "expert-model-parallel-size", topo.ep)
    _flag(a, "expert-tensor-parallel-size", topo.etp)
    _flag(a, "sequence-parallel", bool(par.sequence_parallel) and topo.tp > 1)
    if par.layout:
        _flag(a, "pipeline-model-parallel-layout", par.layout)
    elif topo.vpp:
        _flag(a, "num-virtual-stages-per-pipeline-rank", topo.vpp)
    _flag(a, "use-distributed-optimizer", par.use_distributed_optimizer)
    _flag(a, "overlap-grad-reduce", par.overlap_grad_reduce)
    _flag(a, "overlap-param-gather", par.overlap_param_gather and par.use_distributed_optimizer
          and par.overlap_grad_reduce)
    if par.recompute:
        _flag(a, "recompute-granularity", par.recompute)
        if par.recompute == "full":
            _flag(a, "recompute-method", "uniform")
            _flag(a, "recompute-num-layers", 1)
    return a


def dispatcher_args(cfg: DictConfig) -> list[str]:
    disp, a = cfg.dispatcher, []
    _flag(a, "moe-token-dispatcher-type", disp.megatron_type)
    if disp.megatron_type == "flex":
        _flag(a, "moe-flex-dispatcher-backend", disp.flex_backend)
    a += [str(x) for x in disp.extra_args]
    return a


def training_args(cfg: DictConfig, run_dir: Path, resume: bool) -> list[str]:
    t, a = cfg.training, []
    _flag(a, "seed", t.seed)
    _flag(a, "bf16", t.bf16)
    _flag(a, "transformer-impl", t.transformer_impl)
    _flag(a, "attention-backend", t.attention_backend)
    _flag(a, "seq-length", t.seq_length)
    _flag(a, "micro-batch-size", t.micro_batch_size)
    _flag(a, "global-batch-size", t.global_batch_size)
    _flag(a, "train-iters", t.train_iters)
    _flag(a, "distributed-timeout-minutes", t.distributed_timeout_minutes)
    o = t.optimizer
    _flag(a, "optimizer", o.name)
    _flag(a, "lr", o.lr)
    _flag(a, "min-lr", o.min_lr)
    _flag(a, "weight-decay", o.weight_decay)
    _flag(a, "adam-beta1", o.adam_beta1)
    _flag(a, "adam-beta2", o.adam_beta2)
    _flag(a, "adam-eps", o.adam_eps)
    _flag(a, "clip-grad", o.clip_grad)
    s = t.schedule
    _flag(a, "lr-decay-style", s.lr_decay_style)
    _flag(a, "lr-warmup-iters", s.lr_warmup_iters)
    _flag(a, "lr-decay-iters", s.lr_decay_iters if s.lr_decay_iters is not None else t.train_iters)
    ckpt = Path(run_dir) / "checkpoints"
    if t.checkpoint.enabled:
        _flag(a, "save", ckpt)
        _flag(a, "save-interval", t.checkpoint.save_interval)
        _flag(a, "ckpt-format", t.checkpoint.format)
    if resume:
        _flag(a, "load", ckpt)
        _flag(a, "exit-on-missing-checkpoint", True)
    # Throughput: Megatron prints TFLOP/s/GPU per logged iteration with --log-throughput; tokens/s follow from
    # the iteration time and batch it prints beside (launchers/throughput.py summarises both).
    _flag(a, "log-interval", t.logging.log_interval)
    _flag(a, "log-throughput", True)
    _flag(a, "timing-log-level", t.logging.timing_log_level)
    if t.logging.tensorboard:
        _flag(a, "tensorboard-dir", Path(run_dir) / "tensorboard")
        _flag(a, "log-timers-to-tensorboard", True)
    _flag(a, "eval-interval", t.eval.interval)
    _flag(a, "eval-iters", t.eval.iters)
    return a


def data_args(cfg: DictConfig) -> list[str]:
    d, a = cfg.data, []
    if d.kind == "mock":
        _flag(a, "mock-data", True)
    else:
        a += ["--data-path", *str(d.path).split()]
        _flag(a, "split", d.split)
    _flag(a, "tokenizer-type", d.tokenizer_type)
    _flag(a, "tokenizer-model", d.tokenizer_model)
    if d.tokenizer_type == "NullTokenizer":
        _flag(a, "vocab-size", cfg.model.vocab_size)
    _flag(a, "num-workers", d.num_workers)
    return a


def run_environment(cfg: DictConfig) -> dict[str, str]:
    """Variables every rank gets on top of the cluster env file: Megatron's, the dispatcher's UCCL_* settings,
    cluster.env, then run.env (later wins)."""
    env = dict(BASE_ENV)
    for source in (cfg.dispatcher.settings, cfg.cluster.env, cfg.run.env):
        env.update({str(k): str(v) for k, v in (source or {}).items()})
    return env


def build(cfg: DictConfig, topo: Topology, run_dir: str | Path, resume: bool = False) -> Invocation:
    """The full training invocation for ``cfg`` writing into ``run_dir``."""
    argv = (model_args(cfg.model) + parallel_args(cfg, topo) + dispatcher_args(cfg)
            + training_args(cfg, Path(run_dir), resume) + data_args(cfg)
            + [str(x) for x in cfg.training.extra_args] + [str(x) for x in cfg.run.extra_args])
    return Invocation(module=cfg.run.entry_module, argv=argv, env=run_environment(cfg))
