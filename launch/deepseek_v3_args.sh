# shellcheck shell=bash
# DeepSeek-V3's architecture as Megatron flags, shared by the ready sbatch scripts. Generated from (and checked
# against, in tests/launchers) recipes/model/deepseek_v3.yaml: change the recipe, then this file.
# shellcheck disable=SC2034  # MODEL_ARGS is used by the scripts that source this file
MODEL_ARGS=(
  --num-layers 61
  --hidden-size 7168
  --ffn-hidden-size 18432
  --num-attention-heads 128
  --kv-channels 128
  --normalization RMSNorm
  --norm-epsilon 1e-06
  --swiglu
  --disable-bias-linear
  --untie-embeddings-and-output-weights
  --init-method-std 0.006
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --position-embedding-type rope
  --rotary-base 10000
  --max-position-embeddings 163840
  --make-vocab-size-divisible-by 128
  --multi-latent-attention
  --q-lora-rank 1536
  --kv-lora-rank 512
  --qk-head-dim 128
  --qk-pos-emb-head-dim 64
  --v-head-dim 128
  --qk-layernorm
  --rope-type yarn
  --rotary-scaling-factor 40
  --mscale 1.0
  --mscale-all-dim 1.0
  --num-experts 256
  --moe-layer-freq '([0]*3+[1]*58)'
  --moe-ffn-hidden-size 2048
  --moe-shared-expert-intermediate-size 2048
  --moe-router-topk 8
  --moe-router-num-groups 8
  --moe-router-group-topk 4
  --moe-router-score-function sigmoid
  --moe-router-enable-expert-bias
  --moe-router-bias-update-rate 0.001
  --moe-router-topk-scaling-factor 2.5
  --moe-router-dtype fp32
  --moe-router-load-balancing-type seq_aux_loss
  --moe-aux-loss-coeff 0.0001
  --moe-grouped-gemm
  --mtp-num-layers 1
  --mtp-loss-scaling-factor 0.1
)
