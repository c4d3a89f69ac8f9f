#include "train/train_flags.h"

#include "core/check.h"
#include "train/data_flags.h"
#include "train/trainer.h"

namespace moecore::train {

TrainFlags default_train_flags() {
  TrainFlags f;
  ModelConfig& m = f.model;
  f.vocab_size = 256;
  m.hidden = 64;
  m.num_layers = 2;
  m.num_heads = 4;
  m.num_query_groups = 4;  // MHA unless --group-query-attention, as in Megatron
  m.ffn_hidden = 256;
  m.seq_length = 64;
  m.norm_eps = 1e-5;
  m.init_std = 0.02;
  m.num_experts = 8;
  m.moe.ffn_hidden = 64;
  m.moe.shared_ffn_hidden = 0;
  m.moe.router.topk = 2;
  m.moe.router.aux_loss_coeff = 0.01;
  TrainConfig& t = f.train;
  t.micro_batch = 8;
  t.global_batch = 16;
  t.train_iters = 300;
  t.log_interval = 25;
  t.lr.max_lr = 3e-3;
  t.lr.min_lr = 3e-4;
  t.lr.warmup_steps = 20;
  t.adam.weight_decay = 0.01;
  t.adam.beta2 = 0.95;
  return f;
}

int64_t padded_vocab_size(int64_t vocab, int64_t divisible_by) {
  MOE_CHECK(divisible_by >= 1, "[flags] --make-vocab-size-divisible-by={} must be >= 1",
            divisible_by);
  return (vocab + divisible_by - 1) / divisible_by * divisible_by;
}

void add_train_flags(CLI::App& app, TrainFlags& f) {
  ModelConfig& m = f.model;
  TrainConfig& t = f.train;
  // A flag given twice (config file, then command line) takes the last value.
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
  app.add_option("--norm-epsilon", m.norm_eps, "RMSNorm epsilon")->group(kModel);
  app.add_option("--vocab-size", f.vocab_size, "Vocabulary of the synthetic language and of NullTokenizer")
      ->group(kModel);
  app.add_option("--make-vocab-size-divisible-by", f.make_vocab_size_divisible_by,
                 "Pad the vocabulary to a multiple of this")
      ->group(kModel);
  app.add_option("--init-method-std", m.init_std, "Init std (output layers: / sqrt(2 L))")
      ->group(kModel);
  app.add_flag("--untie-embeddings-and-output-weights", f.untie_embeddings,
               "Separate output head (default: tied to the embedding)")
      ->group(kModel);
  app.add_flag("--add-qkv-bias", m.add_qkv_bias, "Bias on the QKV projection")->group(kModel);
  app.add_flag("--qk-layernorm", m.qk_layernorm, "RMSNorm of q and k over the head dim")
      ->group(kModel);
  app.add_flag("--swiglu", f.swiglu, "SwiGLU MLPs (the only MLP moecore implements)")
      ->group(kModel);
  app.add_flag("--disable-bias-linear", f.disable_bias_linear,
               "No biases in linear layers (moecore has none)")
      ->group(kModel);

  const char* kMoe = "Mixture of experts";
  app.add_option("--num-experts", m.num_experts, "Routed experts (0: dense)")->group(kMoe);
  app.add_option("--moe-ffn-hidden-size", m.moe.ffn_hidden, "Expert width")->group(kMoe);
  add_router_flags(app, m.moe, f.router);
  app.add_option("--moe-shared-expert-intermediate-size", m.moe.shared_ffn_hidden,
                 "Shared expert width (0: none)")
      ->group(kMoe);
  app.add_option("--moe-layer-freq", f.moe_layer_freq, "N, or a list like ([0]*1+[1]*3)")
      ->group(kMoe);

  const char* kTrain = "Training";
  app.add_option("--micro-batch-size", t.micro_batch, "Sequences per micro-batch")->group(kTrain);
  app.add_option("--global-batch-size", t.global_batch, "Sequences per iteration")->group(kTrain);
  app.add_option("--train-iters", t.train_iters, "Iterations")->group(kTrain);
  app.add_option("--seed", t.seed, "Seed for init and data")->group(kTrain);
  app.add_option("--clip-grad", t.adam.clip_grad, "Global grad-norm clip (0: off)")->group(kTrain);
  app.add_flag("--fp32", f.fp32, "fp32 training (the default)")->group(kTrain);
  app.add_flag("--bf16", f.bf16,
               "bf16 mixed precision: bf16 GEMM inputs, fp32 master weights, grads and state")
      ->group(kTrain);
  app.add_option("--recompute-granularity", f.recompute_granularity,
                 "Activation recomputation: full (whole layers) | selective (--recompute-modules)")
      ->check(CLI::IsMember({"full", "selective"}))
      ->group(kTrain);
  app.add_flag("--recompute-activations", f.recompute_activations,
               "Same as --recompute-granularity selective")
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
                 "shared_experts, mlp")
      ->group(kTrain);

  const char* kLr = "Learning rate";
  app.add_option("--lr", t.lr.max_lr, "Peak learning rate")->group(kLr);
  app.add_option("--min-lr", t.lr.min_lr, "Final learning rate")->group(kLr);
  f.lr_warmup_iters_opt =
      app.add_option("--lr-warmup-iters", t.lr.warmup_steps, "Linear warmup iterations")
          ->group(kLr);
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

  const char* kLog = "Logging";
  app.add_option("--log-interval", t.log_interval, "Iterations between log lines")->group(kLog);
  app.add_option("--metrics-file", t.metrics_file, "JSON lines, one object per log line")
      ->group(kLog);
  app.add_option("--peak-tflops", f.peak_tflops,
                 "Peak for MFU in TFLOP/s (default: measured fp32 GEMM at start-up)")
      ->group(kLog);

  parallel::add_parallel_flags(app, f.parallel);  // group "Distributed"
  app.add_flag("--overlap-grad-reduce", t.ddp.overlap,
               "Start each gradient bucket's all-reduce during the backward, as soon as its "
               "gradients are final")
      ->group("Distributed");
  app.add_option("--ddp-bucket-size", t.ddp.bucket_size,
                 "Elements per data-parallel gradient bucket (default: one bucket per layer)")
      ->group("Distributed");

  f.compat.add_to(app);  // --tokenizer-type, --normalization, ... and the rejected ones
}

void finalize_train_flags(TrainFlags& f) {
  f.notices = f.compat.check();
  ModelConfig& m = f.model;
  TrainConfig& t = f.train;
  if (!f.group_query_attention) m.num_query_groups = m.num_heads;
  m.tie_embeddings = !f.untie_embeddings;
  m.bf16 = f.bf16;
  MOE_CHECK(!f.recompute_activations || f.recompute_granularity != "full",
            "[flags] --recompute-activations means --recompute-granularity selective: drop one "
            "of them");
  if (f.recompute_activations) f.recompute_granularity = "selective";
  m.recompute.granularity = f.recompute_granularity == "full"        ? RecomputeGranularity::Full
                            : f.recompute_granularity == "selective" ? RecomputeGranularity::Selective
                                                                      : RecomputeGranularity::None;
  m.recompute.method = f.recompute_method == "uniform" ? RecomputeMethod::Uniform
                       : f.recompute_method == "block" ? RecomputeMethod::Block
                                                       : RecomputeMethod::None;
  // The tokenizer fixes the vocabulary of real data; the synthetic language takes --vocab-size.
  const int64_t vocab = finalize_data_flags(t, f.vocab_size);
  MOE_CHECK(vocab >= 2, "[flags] --vocab-size={} must be >= 2", vocab);
  m.vocab_size = padded_vocab_size(vocab, f.make_vocab_size_divisible_by);
  t.data.synthetic_vocab = vocab;
  m.moe.router.num_experts = m.num_experts;
  finalize_router_flags(m.moe, f.router);
  m.moe_layer_pattern = m.num_experts > 0 ? parse_moe_layer_freq(f.moe_layer_freq, m.num_layers)
                                          : std::vector<int>{};
  t.lr.style = optim::parse_lr_decay_style(f.lr_decay_style);
  t.lr.wsd_style = optim::parse_wsd_decay_style(f.lr_wsd_decay_style);
  if (t.lr.decay_steps == 0) t.lr.decay_steps = t.train_iters;
  if (f.lr_warmup_fraction > 0) {
    MOE_CHECK(f.lr_warmup_iters_opt == nullptr || f.lr_warmup_iters_opt->count() == 0,
              "[flags] give --lr-warmup-iters or --lr-warmup-fraction, not both");
    MOE_CHECK(f.lr_warmup_fraction < 1, "[flags] --lr-warmup-fraction={} must be < 1",
              f.lr_warmup_fraction);
    t.lr.warmup_steps = static_cast<int64_t>(f.lr_warmup_fraction * t.lr.decay_steps);
  }
  t.peak_gflops = f.peak_tflops * 1e3;
  m.validate();
  t.validate();
  // The layout itself (world size, EP | experts, ...) is checked once the ranks are running.
  check_parallel_support(f.parallel);
}

parallel::ModelDims model_dims(const ModelConfig& m) {
  parallel::ModelDims d;
  d.num_layers = m.num_layers;
  d.num_experts = m.num_experts;
  d.num_attention_heads = m.num_heads;
  d.num_query_groups = m.num_query_groups;
  d.ffn_hidden = m.ffn_hidden;
  if (m.num_experts > 0) d.moe_ffn_hidden = m.moe.ffn_hidden;
  d.seq_length = m.seq_length;
  return d;
}

}  // namespace moecore::train
