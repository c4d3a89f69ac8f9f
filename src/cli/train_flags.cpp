#include "cli/train_flags.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/check.h"
#include "cli/checkpoint_args.h"
#include "cli/config_file.h"
#include "cli/data_flags.h"
#include "cli/flag_ranges.h"
#include "cli/megatron_argv.h"
#include "train/trainer.h"

namespace moecore::cli {

TrainFlags::TrainFlags() {
  // ModelConfig and TrainConfig default to a small model for the tests that build them
  // directly; the command line starts from Megatron's defaults (None: 0 or NaN here).
  ModelConfig& m = model;
  m.vocab_size = 0;
  m.hidden = 0;
  m.num_layers = 0;
  m.num_heads = 0;
  m.num_query_groups = 1;
  m.kv_channels = 0;
  m.ffn_hidden = 0;
  m.seq_length = 0;
  m.max_position_embeddings = 0;
  m.rotary_base = 10000;
  m.norm_eps = 1e-5;
  m.init_std = 0.02;
  m.hidden_dropout = 0.1;
  m.attention_dropout = 0.1;
  m.num_experts = 0;
  m.moe.ffn_hidden = 0;
  m.moe.shared_ffn_hidden = 0;
  m.moe.router = RouterConfig{};
  m.moe.router.topk = 2;
  m.moe.router.aux_loss_coeff = 0.0;
  TrainConfig& t = train;
  t.micro_batch = 0;
  t.global_batch = 0;  // None: micro-batch size x data-parallel size
  t.train_iters = 0;
  t.log_interval = 100;
  t.seed = 1234;
  t.lr = optim::LrSchedule{};
  t.lr.max_lr = NAN;
  t.lr.min_lr = 0;
  t.lr.warmup_steps = 0;
  t.adam = optim::AdamWConfig{};
}

int64_t padded_vocab_size(int64_t vocab, int64_t divisible_by) {
  MOE_CHECK(divisible_by >= 1, "[flags] --make-vocab-size-divisible-by={} must be >= 1",
            divisible_by);
  return (vocab + divisible_by - 1) / divisible_by * divisible_by;
}

void add_train_flags(CLI::App& app, TrainFlags& f) {
  ModelConfig& m = f.model;
  TrainConfig& t = f.train;
  // parse_train_args leaves one occurrence per dest (argparse: the last one wins); a caller
  // parsing with CLI11 directly gets the same for a repeated flag.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--config", f.config_file,
                 "TOML file of flags (keys = flag names); the command line overrides it");

  const char* kModel = "Model";
  app.add_option("--num-layers", m.num_layers, "Number of transformer layers")->group(kModel);
  app.add_option("--hidden-size", m.hidden, "Hidden size")->group(kModel);
  app.add_option("--ffn-hidden-size", m.ffn_hidden, "Dense MLP width")->group(kModel);
  app.add_option("--num-attention-heads", m.num_heads, "Query heads")->group(kModel);
  app.add_flag("--group-query-attention", f.group_query_attention, "Use --num-query-groups")
      ->group(kModel);
  app.add_option("--num-query-groups", m.num_query_groups, "KV heads with --group-query-attention")
      ->group(kModel);
  app.add_option("--kv-channels", m.kv_channels, "Head dim (default hidden / heads)")->group(kModel);
  app.add_option("--seq-length", m.seq_length, "Sequence length")->group(kModel);
  app.add_option("--max-position-embeddings", m.max_position_embeddings,
                 "RoPE table length (default seq-length)")
      ->group(kModel);
  app.add_option("--rotary-base", m.rotary_base, "RoPE theta")->group(kModel);
  app.add_option("--position-embedding-type", f.position_embedding_type,
                 "learned_absolute (a learned [max positions, hidden] table added to the word "
                 "embedding), rope, or none")
      ->check(CLI::IsMember({"learned_absolute", "rope", "none"}))
      ->group(kModel);
  app.add_option("--normalization", f.normalization, "LayerNorm (weight and bias) or RMSNorm")
      ->check(CLI::IsMember({"LayerNorm", "RMSNorm"}))
      ->group(kModel);
  app.add_flag("--apply-layernorm-1p", f.apply_layernorm_1p,
               "LayerNorm's weight stored as gamma - 1 (initialised to 0)")
      ->group(kModel);
  app.add_option("--norm-epsilon", m.norm_eps, "LayerNorm / RMSNorm epsilon")->group(kModel);
  app.add_option("--hidden-dropout", m.hidden_dropout,
                 "Dropout on the embeddings and on the attention and MLP outputs (training only; "
                 "the same mask in every parallel layout)")
      ->group(kModel);
  app.add_option("--attention-dropout", m.attention_dropout,
                 "Dropout on the attention probabilities (training only)")
      ->group(kModel);
  app.add_option("--vocab-size", f.vocab_size, "Vocabulary of the synthetic language (default 256) and of NullTokenizer")
      ->group(kModel);
  app.add_option("--make-vocab-size-divisible-by", f.make_vocab_size_divisible_by,
                 "Pad the embedding and output head to a multiple of this times "
                 "--tensor-model-parallel-size rows; unlike Megatron the padding rows are not "
                 "part of the model (no logit in the softmax, no gradient): every TP trains the "
                 "same model")
      ->group(kModel);
  app.add_option("--init-method-std", m.init_std, "Init std (output layers: / sqrt(2 L))")
      ->group(kModel);
  app.add_flag("--untie-embeddings-and-output-weights", f.untie_embeddings,
               "Separate output head (default: tied to the embedding)")
      ->group(kModel);
  app.add_flag("--add-qkv-bias", m.add_qkv_bias, "Bias on the QKV projection")->group(kModel);
  app.add_flag("--add-attention-output-bias", m.add_attention_output_bias,
               "Bias on the attention output projection (linear_proj.bias), as HuggingFace "
               "configs with attention_bias have")
      ->group(kModel);
  app.add_flag("--qk-layernorm", m.qk_layernorm, "RMSNorm of q and k over the head dim")
      ->group(kModel);
  app.add_flag("--multi-latent-attention", m.multi_latent_attention,
               "Multi-latent attention (DeepSeek-V2/V3's MLA) instead of the QKV self-attention")
      ->group(kModel);
  app.add_option("--q-lora-rank", m.mla.q_lora_rank,
                 "MLA: rank of the query's down projection (omitted: a direct q projection)")
      ->group(kModel);
  app.add_option("--kv-lora-rank", m.mla.kv_lora_rank,
                 "MLA: rank of the keys' and values' shared latent")
      ->group(kModel);
  app.add_option("--qk-head-dim", m.mla.qk_head_dim, "MLA: the un-rotated part of a q / k head")
      ->group(kModel);
  app.add_option("--qk-pos-emb-head-dim", m.mla.qk_pos_emb_head_dim,
                 "MLA: the rotated part of a q / k head (k's shared by every head)")
      ->group(kModel);
  app.add_option("--v-head-dim", m.mla.v_head_dim, "MLA: a value head's width")->group(kModel);
  app.add_option("--rope-type", f.rope_type,
                 "MLA's rotary: rope, or yarn (the default with --multi-latent-attention)")
      ->check(CLI::IsMember({"rope", "yarn"}))
      ->group(kModel);
  app.add_option("--rotary-scaling-factor", m.mla.yarn.scaling_factor,
                 "MLA's YaRN: the context extension factor")
      ->group(kModel);
  app.add_option("--mscale", m.mla.yarn.mscale,
                 "MLA's YaRN: cos and sin times mscale's factor over mscale-all-dim's")
      ->group(kModel);
  app.add_option("--mscale-all-dim", m.mla.yarn.mscale_all_dim,
                 "MLA's YaRN: its factor squared scales the softmax")
      ->group(kModel);
  app.add_option("--yarn-original-max-position-embeddings",
                 f.yarn_original_max_position_embeddings,
                 "MLA's YaRN: the context the model was trained on (omitted: 4096, Megatron's MLA "
                 "value)")
      ->group(kModel);
  app.add_option("--yarn-beta-fast", f.yarn_beta_fast,
                 "MLA's YaRN: rotations below which pairs are interpolated (omitted: 32)")
      ->group(kModel);
  app.add_option("--yarn-beta-slow", f.yarn_beta_slow,
                 "MLA's YaRN: rotations above which pairs keep their frequency (omitted: 1)")
      ->group(kModel);
  app.add_option("--mtp-num-layers", m.mtp_num_layers,
                 "Multi-token prediction depths (DeepSeek-V3's MTP; omitted: none): depth k "
                 "predicts the token k + 1 ahead from the previous depth's output and the next "
                 "token's embedding, with the shared embedding and output head")
      ->group(kModel);
  app.add_option("--mtp-loss-scaling-factor", m.mtp_loss_scaling_factor,
                 "The MTP depths' mean cross entropy, averaged over the depths, joins the loss's "
                 "gradient times this factor")
      ->group(kModel);
  app.add_flag("--swiglu", f.swiglu, "SwiGLU MLPs (default: the GeLU MLP)")->group(kModel);
  app.add_flag("--openai-gelu", f.openai_gelu, "GeLU in its tanh form (GPT-2's gelu_new)")
      ->group(kModel);
  app.add_flag("--squared-relu", f.squared_relu, "Squared ReLU MLPs")->group(kModel);
  app.add_flag("--disable-bias-linear", f.disable_bias_linear,
               "No biases in linear layers (default: QKV, output projection, fc1, fc2 and the "
               "experts' fc1 / fc2 have them)")
      ->group(kModel);

  const char* kMoe = "Mixture of experts";
  app.add_option("--num-experts", m.num_experts, "Routed experts (0: dense)")->group(kMoe);
  app.add_option("--moe-ffn-hidden-size", m.moe.ffn_hidden, "Expert width")->group(kMoe);
  add_router_flags(app, m.moe, f.router);
  app.add_option("--moe-shared-expert-intermediate-size", m.moe.shared_ffn_hidden,
                 "Shared expert width (0: none)")
      ->group(kMoe);
  app.add_flag("--moe-shared-expert-gate", m.moe.shared_expert_gate,
               "Scale the shared expert's output by sigmoid(x . w_g) per token (gate_weight [1, "
               "hidden])")
      ->group(kMoe);
  app.add_flag("--moe-shared-expert-overlap", m.moe.shared_expert_overlap,
               "Compute the shared expert while the alltoall dispatcher's all-to-alls are in "
               "flight (fc1 during the dispatch's, fc2 during the combine's; fc2's backward "
               "during the combine backward's, fc1's during the dispatch backward's); bitwise "
               "the same results. Needs --moe-token-dispatcher-type alltoall; no effect without "
               "a shared expert or at EP 1")
      ->group(kMoe);
  app.add_option("--moe-layer-freq", f.moe_layer_freq, "N, or a list like ([0]*1+[1]*3)")
      ->group(kMoe);

  const char* kTrain = "Training";
  app.add_option("--micro-batch-size", t.micro_batch, "Sequences per micro-batch")->group(kTrain);
  app.add_option("--global-batch-size", t.global_batch, "Sequences per iteration")->group(kTrain);
  app.add_option("--train-iters", t.train_iters, "Iterations")->group(kTrain);
  app.add_option("--seed", t.seed, "Seed for init and data")->group(kTrain);
  app.add_option("--clip-grad", t.adam.clip_grad, "Global grad-norm clip (0: off)")->group(kTrain);
  app.add_flag("--bf16", f.bf16,
               "bf16 mixed precision (Megatron's bf16 parameters): layers read the weights' bf16 "
               "values, GEMMs take bf16 inputs; fp32 master weights (sharded with "
               "--use-distributed-optimizer), grads and Adam state")
      ->group(kTrain);
  app.add_flag("--fp32-residual-connection", m.fp32_residual_connection,
               "With --bf16: keep the residual stream (the embedding's output, each residual "
               "add's, the norms' saved inputs) in fp32 instead of bf16")
      ->group(kTrain);
  app.add_option("--recompute-granularity", f.recompute_granularity,
                 "Activation recomputation: full (whole layers) | selective (--recompute-modules)")
      ->check(CLI::IsMember({"full", "selective"}))
      ->group(kTrain);
  app.add_flag("--recompute-activations", f.recompute_activations,
               "Sets --recompute-granularity selective")
      ->group(kTrain);
  app.add_flag("--moe-layer-recompute", f.moe_layer_recompute,
               "Deprecated: --recompute-granularity selective with the moe module")
      ->group(kTrain);
  app.add_flag("--checkpoint-activations", f.checkpoint_activations,
               "Deprecated: use --recompute-activations")
      ->group(kTrain);
  app.add_option("--batch-size", f.batch_size, "Deprecated: use --micro-batch-size")
      ->group(kTrain);
  app.add_option("--model-parallel-size", f.model_parallel_size,
                 "Deprecated: use --tensor-model-parallel-size")
      ->group(kTrain);
  app.add_option("--recompute-method", f.recompute_method,
                 "Full recomputation: uniform (chunks of --recompute-num-layers, chunk inputs "
                 "kept) | block (the first --recompute-num-layers layers)")
      ->check(CLI::IsMember({"uniform", "block"}))
      ->group(kTrain);
  app.add_option("--recompute-num-layers", m.recompute.num_layers,
                 "Full recomputation: layers per chunk (uniform) or layers recomputed (block)")
      ->group(kTrain);
  app.add_option("--recompute-modules", m.recompute.module_names,
                 "Selective recomputation: any of core_attn (default), layernorm, moe_act, moe, "
                 "shared_experts, mlp, mla_up_proj")
      ->group(kTrain);

  const char* kLr = "Learning rate";
  app.add_option("--lr", t.lr.max_lr, "Peak learning rate")->group(kLr);
  app.add_option("--min-lr", t.lr.min_lr, "Final learning rate")->group(kLr);
  app.add_option("--lr-warmup-iters", t.lr.warmup_steps, "Linear warmup iterations")->group(kLr);
  app.add_option("--lr-warmup-fraction", f.lr_warmup_fraction,
                 "Warmup as a fraction of --lr-decay-iters")
      ->group(kLr);
  app.add_option("--lr-warmup-init", t.lr.warmup_init, "Learning rate at the start of warmup")
      ->group(kLr);
  app.add_option("--lr-decay-iters", t.lr.decay_steps, "Decay iterations (default train-iters)")
      ->group(kLr);
  app.add_option("--lr-decay-style", f.lr_decay_style, "constant | linear | cosine | WSD")
      ->check(CLI::IsMember({"constant", "linear", "cosine", "WSD"}))
      ->group(kLr);
  app.add_option("--lr-wsd-decay-iters", t.lr.wsd_decay_steps, "WSD: iterations of the decay")
      ->group(kLr);
  app.add_option("--lr-wsd-decay-style", f.lr_wsd_decay_style,
                 "WSD: linear | cosine | exponential | minus_sqrt")
      ->check(CLI::IsMember({"linear", "cosine", "exponential", "minus_sqrt"}))
      ->group(kLr);

  const char* kReg = "Regularization";
  app.add_option("--weight-decay", t.adam.weight_decay, "Decoupled weight decay")->group(kReg);
  app.add_option("--adam-beta1", t.adam.beta1, "Adam beta1")->group(kReg);
  app.add_option("--adam-beta2", t.adam.beta2, "Adam beta2")->group(kReg);
  app.add_option("--adam-eps", t.adam.eps, "Adam epsilon")->group(kReg);

  add_data_flags(app, t);  // groups "Data" and "Validation"
  add_checkpoint_flags(app, t.ckpt, f.ckpt);  // groups "Checkpointing" and "Training"

  const char* kLog = "Logging";
  app.add_option("--log-interval", t.log_interval, "Iterations between log lines")->group(kLog);
  app.add_option("--metrics-file", t.metrics_file, "JSON lines, one object per log line")
      ->group(kLog);
  app.add_option("--device", t.device,
                 "Backend of every op of the step: cpu, or cuda (needs the CUDA build; its "
                 "kernels are tested through the grid emulator and have not yet run on a real "
                 "GPU: docs/gpu.md)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->group(kTrain);
  app.add_option("--fp32-matmul-precision", t.fp32_matmul_precision,
                 "f32 GEMMs' arithmetic, PyTorch's torch.set_float32_matmul_precision names: "
                 "highest (the default: full f32 products) or high (on --device cuda, TF32 "
                 "tensor cores: inputs rounded to 10 mantissa bits, f32 sums; on the CPU a "
                 "no-op with a notice)")
      ->check(CLI::IsMember({"highest", "high"}))
      ->group(kTrain);
  app.add_flag("--sync-audit", t.sync_audit,
               "Stop with the call sites if a step allocates or waits for the host outside its "
               "documented sync points (docs/design.md)")
      ->group(kTrain);
  app.add_option("--cuda-graph-impl", t.cuda_graph_impl,
                 "full_iteration: on --device cuda, the forward and backward of every "
                 "micro-batch captured as one CUDA graph after the warm-up steps and replayed "
                 "(the optimizer step outside); what cannot be captured is refused by name "
                 "(docs/gpu.md, \"CUDA graphs\"); no effect on --device cpu. none: no graph. "
                 "Megatron's per-layer local and transformer_engine are refused")
      ->check(CLI::IsMember({"none", "local", "transformer_engine", "full_iteration"}))
      ->group(kTrain);
  app.add_option("--cuda-graph-warmup-steps", t.cuda_graph_warmup_steps,
                 "Eager steps (counted in this process) before the step that captures the graph; "
                 "at least 1 (the first step chooses the GEMM algorithms and makes the "
                 "libraries' workspaces, which a capture cannot)")
      ->group(kTrain);
  app.add_option("--cuda-graph-modules", f.cuda_graph_modules,
                 "Megatron's per-layer graph scopes (empty with full_iteration); the deprecated "
                 "values full_iteration (= --cuda-graph-impl full_iteration) and full (= empty) "
                 "are migrated as Megatron's validate_args does")
      ->group(kTrain);
  app.add_option("--cuda-graph-scope", f.cuda_graph_scope,
                 "Deprecated spelling of --cuda-graph-modules (Megatron migrates it)")
      ->group(kTrain);
  app.add_flag("--enable-cuda-graph", f.enable_cuda_graph,
               "Deprecated: Megatron's --cuda-graph-impl local (with --cuda-graph-scope "
               "full_iteration: --cuda-graph-impl full_iteration)")
      ->group(kTrain);
  app.add_flag("--external-cuda-graph", f.external_cuda_graph,
               "Deprecated: Megatron's --cuda-graph-impl transformer_engine (refused)")
      ->group(kTrain);
  app.add_option("--peak-tflops", f.peak_tflops,
                 "Peak for MFU in TFLOP/s per rank (default: measured fp32 GEMM at start-up); MFU "
                 "divides the job's rate by ranks x peak")
      ->group(kLog);

  const char* kGuard = "Numeric guards";
  app.add_flag("--check-for-nan-in-loss-and-grad", f.check_for_nan,
               "Stop (exit code 17) when a rank's loss or gradient is NaN or Inf, before the "
               "update (the default)")
      ->group(kGuard);
  app.add_flag("--no-check-for-nan-in-loss-and-grad", f.no_check_for_nan,
               "Do not check each rank's losses and gradient buckets for NaN / Inf")
      ->group(kGuard);
  app.add_flag("--check-for-spiky-loss", t.guard.check_spiky_loss,
               "Flag a micro-batch loss >= 10x the largest of the first --spike-check-samples "
               "(stop with exit code 18, or skip the step with --skip-spiky-steps)")
      ->group(kGuard);
  app.add_flag("--check-for-large-grads", t.guard.check_large_grads,
               "Flag a gradient bucket norm >= 10x the largest of the first "
               "--spike-check-samples (stop with exit code 18, or skip with --skip-spiky-steps)")
      ->group(kGuard);
  app.add_flag("--skip-spiky-steps", t.guard.skip_spiky_steps,
               "Skip a flagged step instead of stopping: its batch is consumed, nothing is "
               "updated (moecore's)")
      ->group(kGuard);
  app.add_option("--spike-check-samples", t.guard.samples,
                 "Values that set the reference maximum of the spike checks (Megatron: 100)")
      ->group(kGuard);
  app.add_option("--iterations-to-skip", t.iterations_to_skip,
                 "1-based iterations whose batch is consumed without a step")
      ->group(kTrain);

  parallel::add_parallel_flags(app, f.parallel);  // group "Distributed"
  app.add_flag("--overlap-grad-reduce", t.ddp.overlap,
               "Start each gradient bucket's all-reduce during the backward, as soon as its "
               "gradients are final")
      ->group("Distributed");
  app.add_flag("--use-distributed-optimizer", t.ddp.distributed_optimizer,
               "Shard the Adam moments over the data-parallel ranks (ZeRO-1: dense over dp x cp, "
               "expert over expt_dp): gradients reduce-scattered, each rank updates its shard, "
               "the weights all-gathered")
      ->group("Distributed");
  app.add_flag("--overlap-param-gather", t.ddp.overlap_param_gather,
               "With --use-distributed-optimizer and --overlap-grad-reduce: start the weights' "
               "all-gathers after the optimizer step without waiting, and wait for each bucket's "
               "just before the next forward first reads it")
      ->group("Distributed");
  app.add_option("--ddp-bucket-size", t.ddp.bucket_size,
                 "Elements per data-parallel gradient bucket (default: one bucket per layer)")
      ->group("Distributed");

  app.add_flag("--fp32", f.fp32,
               "fp32 training, the default spelled out (moecore's flag; Megatron has none): "
               "refused with --bf16");
  // Switches show their state as their default (CLI11 captures none for flags).
  const RouterConfig& rc = m.moe.router;
  const std::vector<std::pair<const char*, const bool*>> switches = {
      {"--group-query-attention", &f.group_query_attention},
      {"--untie-embeddings-and-output-weights", &f.untie_embeddings},
      {"--add-qkv-bias", &m.add_qkv_bias}, {"--qk-layernorm", &m.qk_layernorm},
      {"--multi-latent-attention", &m.multi_latent_attention},
      {"--add-attention-output-bias", &m.add_attention_output_bias},
      {"--swiglu", &f.swiglu}, {"--disable-bias-linear", &f.disable_bias_linear},
      {"--openai-gelu", &f.openai_gelu}, {"--squared-relu", &f.squared_relu},
      {"--apply-layernorm-1p", &f.apply_layernorm_1p},
      {"--eod-mask-loss", &t.data.eod_mask_loss},
      {"--bf16", &f.bf16}, {"--recompute-activations", &f.recompute_activations},
      {"--fp32-residual-connection", &m.fp32_residual_connection},
      {"--moe-layer-recompute", &f.moe_layer_recompute},
      {"--checkpoint-activations", &f.checkpoint_activations},
      {"--overlap-grad-reduce", &t.ddp.overlap}, {"--fp32", &f.fp32},
      {"--enable-cuda-graph", &f.enable_cuda_graph},
      {"--external-cuda-graph", &f.external_cuda_graph},
      {"--use-distributed-optimizer", &t.ddp.distributed_optimizer},
      {"--overlap-param-gather", &t.ddp.overlap_param_gather},
      {"--check-for-nan-in-loss-and-grad", &t.guard.check_nan},
      {"--no-check-for-nan-in-loss-and-grad", &f.no_check_for_nan},
      {"--check-for-spiky-loss", &t.guard.check_spiky_loss},
      {"--check-for-large-grads", &t.guard.check_large_grads},
      {"--skip-spiky-steps", &t.guard.skip_spiky_steps},
      {"--moe-router-pre-softmax", &rc.pre_softmax},
      {"--moe-router-enable-expert-bias", &rc.enable_expert_bias},
      {"--moe-pad-expert-input-to-capacity", &rc.pad_to_capacity},
      {"--moe-aux-loss-megatron-map", &rc.megatron_aux_map},
      {"--moe-shared-expert-gate", &m.moe.shared_expert_gate},
      {"--moe-shared-expert-overlap", &m.moe.shared_expert_overlap},
      {"--sequence-parallel", &f.parallel.sequence_parallel},
      {"--use-tp-pp-dp-mapping", &f.parallel.use_tp_pp_dp_mapping},
      {"--account-for-embedding-in-pipeline-split", &f.parallel.account_for_embedding},
      {"--account-for-loss-in-pipeline-split", &f.parallel.account_for_loss},
      {"--mock-data", &t.data.mock_data}};
  for (const auto& [name, value] : switches) {
    app.get_option(name)->default_str(*value ? "true" : "false");
  }
  // --help groups the flags as arguments.py does; Megatron's defaults are shown.
  for (CLI::Option* o : app.get_options()) {
    const MegatronFlag* mf = megatron_arguments().find("--" + o->get_lnames().front());
    if (mf == nullptr) {
      if (o->get_group() != "") o->group("moecore");
      continue;
    }
    o->group(mf->group);
    if (!mf->default_value.is_null() && o->get_items_expected_max() > 0 &&
        o->get_default_str().empty()) {
      o->capture_default_str();
    }
  }
}

// What the layers compute: activation, biases, normalization, positions, dropout (Megatron's
// core_transformer_config_from_args and its validate_args checks).
static void finalize_model_function_flags(TrainFlags& f) {
  ModelConfig& m = f.model;
  MOE_CHECK(!(f.squared_relu && f.swiglu),
            "[flags] --squared-relu and --swiglu are both given: choose one activation");
  MOE_CHECK(!(f.openai_gelu && (f.swiglu || f.squared_relu)),
            "[flags] --openai-gelu is a GeLU: it cannot be combined with {}: choose one "
            "activation",
            f.swiglu ? "--swiglu" : "--squared-relu");
  m.activation = f.swiglu         ? ops::Activation::SwiGLU
                 : f.squared_relu ? ops::Activation::SquaredReLU
                 : f.openai_gelu  ? ops::Activation::GeLUTanh
                                  : ops::Activation::GeLU;
  // --add-bias-linear (Megatron's default): QKV, output projection, fc1, fc2, experts.
  const bool bias = !f.disable_bias_linear;
  m.add_qkv_bias = m.add_qkv_bias || bias;
  m.add_attention_output_bias = m.add_attention_output_bias || bias;
  m.add_mlp_bias = bias;
  m.normalization =
      f.normalization == "RMSNorm" ? Normalization::RMSNorm : Normalization::LayerNorm;
  MOE_CHECK(!f.apply_layernorm_1p || m.normalization == Normalization::LayerNorm,
            "[flags] --apply-layernorm-1p is LayerNorm's: remove it or use --normalization "
            "LayerNorm");
  m.layernorm_1p = f.apply_layernorm_1p;
  m.position_embedding = f.position_embedding_type == "rope"   ? PositionEmbedding::Rope
                         : f.position_embedding_type == "none" ? PositionEmbedding::None
                                                               : PositionEmbedding::LearnedAbsolute;
  // --rope-type None: MLA takes yarn (Megatron's help); the QKV attention does not read it.
  m.mla.rope_type = f.rope_type == "rope" ? ops::RopeType::Rope : ops::RopeType::Yarn;
  if (f.yarn_original_max_position_embeddings != 0)
    m.mla.yarn.original_max_position_embeddings = f.yarn_original_max_position_embeddings;
  if (!std::isnan(f.yarn_beta_fast)) m.mla.yarn.beta_fast = f.yarn_beta_fast;
  if (!std::isnan(f.yarn_beta_slow)) m.mla.yarn.beta_slow = f.yarn_beta_slow;
}

// Megatron's OptimizerParamScheduler: the warmup ends before the decay does, and WSD's anneal
// lies inside the decay. The schedule checks this too (optim/lr_schedule.cpp); here the message
// can say which flag to change, and that --lr-decay-iters defaults to --train-iters, which is
// what a shortened run of a config with warmup meets (configs/tiny.toml warms up for 20).
static void check_lr_iterations(const TrainConfig& t, bool decay_given) {
  const optim::LrSchedule& lr = t.lr;
  const std::string decay =
      decay_given ? fmt::format("--lr-decay-iters={}", lr.decay_steps)
                  : fmt::format("--lr-decay-iters={} (not given: --train-iters)", lr.decay_steps);
  MOE_CHECK(lr.style == optim::LrDecayStyle::Constant || lr.decay_steps == 0 ||
                lr.warmup_steps < lr.decay_steps,
            "[flags] {} must exceed --lr-warmup-iters={}: give --lr-warmup-iters below {} (0 for "
            "no warmup), or --lr-decay-iters above {}",
            decay, lr.warmup_steps, lr.decay_steps, lr.warmup_steps);
  MOE_CHECK(lr.style != optim::LrDecayStyle::WSD ||
                (lr.wsd_decay_steps > 0 && lr.wsd_decay_steps <= lr.decay_steps),
            "[flags] --lr-decay-style WSD anneals over --lr-wsd-decay-iters={}, which must be in "
            "1..{} ({}): give --lr-wsd-decay-iters N with 0 < N <= {}",
            lr.wsd_decay_steps, lr.decay_steps, decay, lr.decay_steps);
}

// Megatron's CUDA graph flags as validate_args migrates them (the deprecated spellings first),
// then what moecore implements: --cuda-graph-impl none or full_iteration.
static void finalize_cuda_graph_flags(TrainFlags& f) {
  TrainConfig& t = f.train;
  std::string source = "--cuda-graph-impl " + t.cuda_graph_impl;  // what set the impl
  // --enable-cuda-graph / --external-cuda-graph: Megatron asserts the impl was left at none.
  if (f.enable_cuda_graph || f.external_cuda_graph) {
    const char* flag = f.enable_cuda_graph ? "--enable-cuda-graph" : "--external-cuda-graph";
    MOE_CHECK(t.cuda_graph_impl == "none",
              "[flags] {} (deprecated) and --cuda-graph-impl {} are both given: Megatron refuses "
              "the pair; give --cuda-graph-impl alone",
              flag, t.cuda_graph_impl);
    MOE_CHECK(!(f.enable_cuda_graph && f.external_cuda_graph),
              "[flags] --enable-cuda-graph and --external-cuda-graph are both given: give "
              "--cuda-graph-impl alone");
    t.cuda_graph_impl = f.enable_cuda_graph ? "local" : "transformer_engine";
    source = fmt::format("{} (deprecated: Megatron reads it as --cuda-graph-impl {})", flag,
                         t.cuda_graph_impl);
  }
  // --cuda-graph-scope is --cuda-graph-modules' old name.
  std::vector<std::string> given = f.cuda_graph_modules;
  if (!f.cuda_graph_scope.empty()) {
    MOE_CHECK(f.cuda_graph_modules.empty(),
              "[flags] --cuda-graph-scope (deprecated) and --cuda-graph-modules are both given: "
              "give --cuda-graph-modules alone");
    given = f.cuda_graph_scope;
  }
  std::vector<std::string> modules;  // comma lists split, as Megatron's parser does
  for (const std::string& g : given) {
    size_t start = 0;
    for (size_t comma; (comma = g.find(',', start)) != std::string::npos; start = comma + 1) {
      if (comma > start) modules.push_back(g.substr(start, comma - start));
    }
    if (start < g.size()) modules.push_back(g.substr(start));
  }
  if (std::find(modules.begin(), modules.end(), "full") != modules.end()) {
    MOE_CHECK(modules.size() == 1,
              "[flags] --cuda-graph-modules full cannot be used with other values (it is the "
              "deprecated spelling of the whole layer: no value)");
    modules.clear();
  }
  const bool iteration =
      std::find(modules.begin(), modules.end(), "full_iteration") != modules.end();
  const bool inference =
      std::find(modules.begin(), modules.end(), "full_iteration_inference") != modules.end();
  MOE_CHECK(!(iteration && inference),
            "[flags] --cuda-graph-modules cannot hold both deprecated values full_iteration and "
            "full_iteration_inference");
  std::erase(modules, std::string("full_iteration"));
  std::erase(modules, std::string("full_iteration_inference"));
  if (iteration) {
    // Megatron: the deprecated scope full_iteration sets --cuda-graph-impl full_iteration.
    MOE_CHECK(t.cuda_graph_impl == "none" || t.cuda_graph_impl == "local" ||
                  t.cuda_graph_impl == "full_iteration",
              "[flags] --cuda-graph-modules full_iteration cannot be combined with {}", source);
    t.cuda_graph_impl = "full_iteration";
    source = "--cuda-graph-modules full_iteration (deprecated: Megatron reads it as "
             "--cuda-graph-impl full_iteration)";
  }
  if (inference) {
    MOE_CHECK(t.cuda_graph_impl == "none" || t.cuda_graph_impl == "local",
              "[flags] --cuda-graph-modules full_iteration_inference cannot be combined with {}",
              source);
    f.notices.push_back(
        "[flags] --cuda-graph-modules full_iteration_inference: an inference graph scope "
        "(Megatron's --inference-cuda-graph-scope block); training takes no effect from it");
  }
  if (t.cuda_graph_impl == "local" || t.cuda_graph_impl == "transformer_engine") {
    MOE_FAIL(
        "[flags] {}: per-layer CUDA graphs (Megatron's {} implementation) are not implemented; "
        "moecore captures a whole step's forward and backward as one graph: use "
        "--cuda-graph-impl full_iteration (or --enable-cuda-graph --cuda-graph-scope "
        "full_iteration), or none",
        source, t.cuda_graph_impl == "local" ? "MCore" : "Transformer Engine");
  }
  if (t.cuda_graph_impl == "full_iteration") {
    MOE_CHECK(modules.empty(),
              "[flags] --cuda-graph-modules {} with --cuda-graph-impl full_iteration: Megatron "
              "requires it empty (the whole forward-backward is one graph)",
              fmt::join(modules, " "));
    MOE_CHECK(t.cuda_graph_warmup_steps >= 1,
              "[flags] --cuda-graph-warmup-steps {}: at least 1 eager step must come before the "
              "capture (it chooses the GEMM algorithms and makes the libraries' workspaces, "
              "which a capture cannot do)",
              t.cuda_graph_warmup_steps);
  } else if (!modules.empty()) {
    f.notices.push_back(fmt::format(
        "[flags] --cuda-graph-modules {}: no effect without --cuda-graph-impl (as in Megatron)",
        fmt::join(modules, " ")));
  }
}

void finalize_train_flags(TrainFlags& f) {
  ModelConfig& m = f.model;
  TrainConfig& t = f.train;
  // Megatron's deprecated spellings stop as they do in Megatron.
  MOE_CHECK(!f.checkpoint_activations,
            "[flags] --checkpoint-activations is no longer valid, use --recompute-activations, "
            "or, for more control, --recompute-granularity and --recompute-method");
  MOE_CHECK(f.batch_size == 0,
            "[flags] --batch-size argument is no longer valid, use --micro-batch-size instead");
  MOE_CHECK(f.model_parallel_size == 0,
            "[flags] --model-parallel-size is no longer valid, use --tensor-model-parallel-size "
            "instead");
  // Megatron's required arguments.
  auto required = [](int64_t v, const char* flag) {
    MOE_CHECK(v != 0, "[flags] {} is required (Megatron has no default for it): give {} N", flag,
              flag);
  };
  MOE_CHECK(!(f.check_for_nan && f.no_check_for_nan),
            "[flags] --check-for-nan-in-loss-and-grad and --no-check-for-nan-in-loss-and-grad "
            "are both given: choose one");
  t.guard.check_nan = !f.no_check_for_nan;
  required(m.num_layers, "--num-layers");
  required(m.hidden, "--hidden-size");
  required(m.num_heads, "--num-attention-heads");
  required(m.max_position_embeddings, "--max-position-embeddings");
  required(m.seq_length, "--seq-length");
  required(t.micro_batch, "--micro-batch-size");
  MOE_CHECK(t.train_iters != 0,
            "[flags] --train-iters is required (sample-based training, --train-samples, is not "
            "implemented yet): give --train-iters N");
  MOE_CHECK(!is_none(t.lr.max_lr),
            "[flags] --lr is required (Megatron has no default learning rate): give --lr VALUE");
  MOE_CHECK(t.lr.min_lr <= t.lr.max_lr,
            "[flags] --min-lr={} must be <= --lr={}: lower --min-lr to at most {} or raise --lr "
            "to at least {}",
            t.lr.min_lr, t.lr.max_lr, t.lr.max_lr, t.lr.min_lr);
  MOE_CHECK(m.max_position_embeddings >= m.seq_length,
            "[flags] --max-position-embeddings={} must be >= --seq-length={}: raise "
            "--max-position-embeddings to {} or lower --seq-length to {}",
            m.max_position_embeddings, m.seq_length, m.seq_length, m.max_position_embeddings);
  if (!f.group_query_attention) m.num_query_groups = m.num_heads;
  // Megatron: without --ffn-hidden-size, 4 h (SwiGLU: 2/3 of that, rounded down to 64).
  if (m.ffn_hidden == 0) m.ffn_hidden = f.swiglu ? (4 * m.hidden * 2 / 3) / 64 * 64 : 4 * m.hidden;
  finalize_model_function_flags(f);
  if (m.num_experts > 0 && m.moe.ffn_hidden == 0) m.moe.ffn_hidden = m.ffn_hidden;
  m.tie_embeddings = !f.untie_embeddings;
  // --fp32 states the default; with --bf16 the run would silently train in bf16.
  MOE_CHECK(!(f.fp32 && f.bf16),
            "[flags] --fp32 and --bf16 are both given: --fp32 asks for fp32 training, --bf16 for "
            "bf16 mixed precision; remove one of them (from the command line or the --config "
            "file that holds it)");
  m.bf16 = f.bf16;
  // Megatron: --recompute-activations sets the granularity; --moe-layer-recompute adds "moe".
  if (f.recompute_activations) f.recompute_granularity = "selective";
  if (f.moe_layer_recompute) {
    MOE_CHECK(f.recompute_granularity != "full",
              "[flags] Do not set --moe-layer-recompute with full recompute granularity");
    f.recompute_granularity = "selective";
    auto& mods = m.recompute.module_names;
    if (std::find(mods.begin(), mods.end(), "moe") == mods.end()) mods.push_back("moe");
  }
  m.recompute.granularity = f.recompute_granularity == "full"        ? RecomputeGranularity::Full
                            : f.recompute_granularity == "selective" ? RecomputeGranularity::Selective
                                                                      : RecomputeGranularity::None;
  m.recompute.method = f.recompute_method == "uniform" ? RecomputeMethod::Uniform
                       : f.recompute_method == "block" ? RecomputeMethod::Block
                                                       : RecomputeMethod::None;
  // The tokenizer fixes the vocabulary of real data; the synthetic language takes --vocab-size.
  const int64_t vocab = finalize_data_flags(t, f.vocab_size);
  MOE_CHECK(vocab >= 2, "[flags] --vocab-size={} must be >= 2", vocab);
  // Megatron pads to a multiple of --make-vocab-size-divisible-by x TP: the embedding and the
  // output head are split over the vocabulary in equal slices. The padding rows are not part of
  // the model here (ModelConfig::padded_vocab_size): every TP size trains the same model.
  m.vocab_size = vocab;
  m.padded_vocab_size = padded_vocab_size(vocab, f.make_vocab_size_divisible_by * f.parallel.tp);
  t.data.synthetic_vocab = vocab;
  m.moe.router.num_experts = m.num_experts;
  finalize_router_flags(m.moe, f.router);
  m.moe_layer_pattern = m.num_experts > 0 ? parse_moe_layer_freq(f.moe_layer_freq, m.num_layers)
                                          : std::vector<int>{};
  // Where --moe-shared-expert-overlap cannot take effect, Megatron accepts it (and refuses it
  // only with the allgather dispatcher: MoeConfig::validate): say so.
  if (m.moe.shared_expert_overlap && (m.num_experts == 0 || m.moe.shared_ffn_hidden == 0)) {
    f.notices.push_back(
        "[flags] --moe-shared-expert-overlap: no shared expert (--moe-shared-expert-"
        "intermediate-size not given), so nothing to overlap: no effect");
  } else if (m.moe.shared_expert_overlap && f.parallel.ep == 1) {
    f.notices.push_back(
        "[flags] --moe-shared-expert-overlap: at --expert-model-parallel-size 1 no tokens "
        "travel between EP ranks, so there is no all-to-all to hide the shared expert behind: "
        "no effect");
  }
  t.lr.style = optim::parse_lr_decay_style(f.lr_decay_style);
  t.lr.wsd_style = optim::parse_wsd_decay_style(f.lr_wsd_decay_style);
  const bool decay_given = t.lr.decay_steps != 0;
  if (t.lr.decay_steps == 0) t.lr.decay_steps = t.train_iters;
  if (!is_none(f.lr_warmup_fraction)) {
    MOE_CHECK(t.lr.warmup_steps == 0,
              "[flags] can only specify one of --lr-warmup-fraction and --lr-warmup-iters");
    MOE_CHECK(f.lr_warmup_fraction >= 0 && f.lr_warmup_fraction < 1,
              "[flags] --lr-warmup-fraction={} must be in [0, 1)", f.lr_warmup_fraction);
    t.lr.warmup_steps = static_cast<int64_t>(f.lr_warmup_fraction * t.lr.decay_steps);
  }
  check_lr_iterations(t, decay_given);
  t.peak_gflops = f.peak_tflops * 1e3;
  finalize_checkpoint_flags(t.ckpt, f.ckpt);
  finalize_cuda_graph_flags(f);
  // Megatron disables sequence parallelism without tensor parallelism (same numerics).
  if (f.parallel.tp == 1 && f.parallel.sequence_parallel) {
    f.parallel.sequence_parallel = false;
    f.notices.push_back(
        "[flags] --sequence-parallel: disabling sequence parallelism because tensor model "
        "parallelism is disabled (as Megatron does)");
  }
  m.validate();
  TrainConfig checked = t;  // None: the micro-batch size x data-parallel size (the trainer)
  if (checked.global_batch == 0) checked.global_batch = checked.micro_batch;
  checked.validate();
  // The layout itself (world size, EP | experts, ...) is checked once the ranks are running.
  train::check_parallel_support(f.parallel, m);
}

namespace {

// moecore's own flags, with their arity, for the argparse layer.
std::vector<OwnFlag> own_flags(const CLI::App& app) {
  std::vector<OwnFlag> out;
  for (const CLI::Option* o : app.get_options()) {
    if (o->get_lnames().empty()) continue;
    const std::string name = "--" + o->get_lnames().front();
    if (megatron_arguments().find(name) != nullptr) continue;
    OwnFlag f{name, o->get_items_expected_min(), o->get_items_expected_max()};
    if (f.max_values > 1000) f.max_values = -1;
    out.push_back(f);
  }
  return out;
}

// Binding is a property of the flag set, not of one parse: a throwaway app answers it.
const CLI::App& reference_app() {
  static TrainFlags flags;
  static const std::unique_ptr<CLI::App> app = [] {
    auto a = std::make_unique<CLI::App>("moecore train: Megatron-LM's flags, Megatron's defaults");
    add_train_flags(*a, flags);
    return a;
  }();
  return *app;
}

}  // namespace

bool train_binds(const MegatronFlag& f) {
  for (const std::string& n : f.names) {
    for (const CLI::Option* o : reference_app().get_options()) {
      if (o->check_lname(n.substr(2))) return true;
    }
  }
  return false;
}

// A bound flag given one of Megatron's choices that moecore's option does not take (e.g.
// --lr-decay-style inverse-square-root): "not implemented yet", naming the choices it takes.
// (The value is a Megatron choice: parse_megatron_argv checked that.)
static void check_implemented_choices(CLI::App& app, const ParsedArgs& given) {
  for (const GivenFlag& g : given.flags) {
    if (g.megatron == nullptr || g.megatron->choices.empty() || !train_binds(*g.megatron)) continue;
    CLI::Option* o = app.get_option_no_throw(g.megatron->name());
    if (o == nullptr) continue;
    CLI::Validator* v = nullptr;
    try {
      v = o->get_validator(0);
    } catch (const CLI::OptionNotFound&) {
      continue;  // no validator: every Megatron choice is taken
    }
    auto takes = [&](std::string value) { return (*v)(value).empty(); };
    for (const std::string& value : g.values) {
      if (takes(value)) continue;
      std::vector<std::string> implemented;
      for (const std::string& c : g.megatron->choices) {
        if (takes(c)) implemented.push_back(c);
      }
      MOE_FAIL("[flags] {} {}: Megatron's choice is not implemented yet; moecore implements {}",
               g.name, value, fmt::join(implemented, ", "));
    }
  }
}

const std::vector<std::string>& no_step_placeholder_args() {
  static const std::vector<std::string> args = {"--micro-batch-size=1", "--train-iters=1",
                                                "--lr=0"};
  return args;
}

TrainFlags parse_train_args(const std::vector<std::string>& raw) {
  std::vector<std::string> with_cmd = {"train"};
  with_cmd.insert(with_cmd.end(), raw.begin(), raw.end());
  std::vector<std::string> args = expand_config_files(with_cmd);
  args.erase(args.begin());
  TrainFlags f;
  CLI::App app("moecore train");
  add_train_flags(app, f);
  ParsedArgs given = parse_megatron_argv(args, own_flags(app), moecore_extra_choices());
  if (given.help) throw CLI::CallForHelp();
  std::string from_checkpoint;
  if (given.find_dest("use_checkpoint_args") != nullptr) {
    // The checkpoint's model flags first, so the command line's own win (parse keeps the last).
    const GivenFlag* load = given.find_dest("load");
    const GivenFlag* step = given.find_dest("ckpt_step");
    // parse_megatron_argv has checked that the value is an int.
    const int64_t ckpt_step =
        step != nullptr && !step->values.empty() ? std::stoll(step->values[0]) : -1;
    const std::vector<std::string> saved = checkpoint_model_args(
        load != nullptr && !load->values.empty() ? load->values[0] : "", ckpt_step, own_flags(app));
    args.insert(args.begin(), saved.begin(), saved.end());
    given = parse_megatron_argv(args, own_flags(app), moecore_extra_choices());
    from_checkpoint = fmt::format(
        "[checkpoint] --use-checkpoint-args: {} flag(s) from the "
        "checkpoint ({}); the command line's win",
        saved.size(), fmt::join(saved, " "));
  }
  check_flag_ranges(given);
  f.notices = check_megatron_flags(given, train_binds);
  if (!from_checkpoint.empty()) f.notices.push_back(from_checkpoint);
  check_implemented_choices(app, given);
  // A Megatron alias (--persistent-save-interval for --save-interval) reaches CLI11 under the
  // spelling moecore binds: CLI11 knows one name per option.
  for (GivenFlag& g : given.flags) {
    if (g.megatron == nullptr || app.get_option_no_throw(g.name) != nullptr) continue;
    for (const std::string& n : g.megatron->names) {
      if (app.get_option_no_throw(n) != nullptr) {
        g.name = n;
        break;
      }
    }
  }
  std::vector<std::string> cli_args = given.args_for([](const GivenFlag& g) {
    return g.megatron == nullptr || train_binds(*g.megatron);
  });
  const std::vector<std::string> run_args = given.args_for([](const GivenFlag&) { return true; });
  std::reverse(cli_args.begin(), cli_args.end());  // CLI11 takes the arguments reversed
  app.parse(cli_args);
  f.train.ckpt.run_args = run_args;
  std::vector<std::string> notices = std::move(f.notices);
  finalize_train_flags(f);
  notices.insert(notices.end(), f.notices.begin(), f.notices.end());
  f.notices = std::move(notices);
  return f;
}

std::string train_help() {
  std::string help = reference_app().help();
  help += fmt::format(
      "\nEvery other flag of Megatron-LM's arguments.py (commit {}) parses too: accepted without "
      "effect (with a notice) or refused as not implemented yet; docs/flags.md lists them.\n",
      megatron_arguments().commit.substr(0, 12));
  return help;
}

std::string train_flags_markdown() {
  return megatron_flags_markdown(train_binds, [](const MegatronFlag& f) -> std::string {
    for (const CLI::Option* o : reference_app().get_options()) {
      for (const std::string& n : f.names) {
        if (o->check_lname(n.substr(2))) return o->get_description();
      }
    }
    return "";
  });
}

parallel::ModelDims model_dims(const ModelConfig& m) {
  parallel::ModelDims d;
  d.num_layers = m.num_layers;
  // A layout string's m's are checked against it.
  d.mtp_num_layers = m.mtp_num_layers;
  d.num_experts = m.num_experts;
  d.num_attention_heads = m.num_heads;
  // MLA has no query groups (ModelConfig::multi_latent_attention): only its heads split over TP.
  if (!m.multi_latent_attention) d.num_query_groups = m.num_query_groups;
  d.ffn_hidden = m.ffn_hidden;
  if (m.num_experts > 0) d.moe_ffn_hidden = m.moe.ffn_hidden;
  d.seq_length = m.seq_length;
  if (m.num_experts > 0) d.shared_ffn_hidden = m.moe.shared_ffn_hidden;
  d.vocab_size = m.padded_vocab();  // what TP splits
  return d;
}

}  // namespace moecore::cli
