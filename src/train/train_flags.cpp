#include "train/train_flags.h"

#include "core/check.h"

namespace moecore::train {

TrainFlags default_train_flags() {
  TrainFlags f;
  ModelConfig& m = f.model;
  m.vocab_size = 256;
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

void add_train_flags(CLI::App& app, TrainFlags& f) {
  ModelConfig& m = f.model;
  TrainConfig& t = f.train;
  const char* kModel = "Model";
  app.add_option("--num-layers", m.num_layers, "Number of transformer layers")->group(kModel);
  app.add_option("--hidden-size", m.hidden, "Hidden size")->group(kModel);
  app.add_option("--ffn-hidden-size", m.ffn_hidden, "Dense MLP width")->group(kModel);
  app.add_option("--num-attention-heads", m.num_heads, "Query heads")->group(kModel);
  app.add_option("--num-query-groups", m.num_query_groups, "KV heads with --group-query-attention")
      ->group(kModel);
  app.add_flag("--group-query-attention", f.group_query_attention, "Use --num-query-groups")
      ->group(kModel);
  app.add_option("--kv-channels", m.kv_channels, "Head dim (default hidden / heads)")->group(kModel);
  app.add_option("--seq-length", m.seq_length, "Sequence length")->group(kModel);
  app.add_option("--max-position-embeddings", m.max_position_embeddings, "RoPE table length")
      ->group(kModel);
  app.add_option("--rotary-base", m.rotary_base, "RoPE theta")->group(kModel);
  app.add_option("--norm-epsilon", m.norm_eps, "RMSNorm epsilon")->group(kModel);
  app.add_option("--vocab-size", m.vocab_size, "Vocabulary (synthetic language)")->group(kModel);
  app.add_option("--init-method-std", m.init_std, "Init std (output layers / sqrt(2L))")
      ->group(kModel);

  const char* kMoe = "Mixture of experts";
  app.add_option("--num-experts", m.num_experts, "Routed experts (0: dense)")->group(kMoe);
  app.add_option("--moe-ffn-hidden-size", m.moe.ffn_hidden, "Expert width")->group(kMoe);
  add_router_flags(app, m.moe.router, f.router);
  app.add_option("--moe-shared-expert-intermediate-size", m.moe.shared_ffn_hidden,
                 "Shared expert width (0: none)")
      ->group(kMoe);
  app.add_option("--moe-layer-freq", f.moe_layer_freq, "N or a list like ([0]*1+[1]*3)")
      ->group(kMoe);

  const char* kTrain = "Training";
  app.add_option("--micro-batch-size", t.micro_batch, "Sequences per micro-batch")->group(kTrain);
  app.add_option("--global-batch-size", t.global_batch, "Sequences per iteration")->group(kTrain);
  app.add_option("--train-iters", t.train_iters, "Iterations")->group(kTrain);
  app.add_option("--seed", t.seed, "Seed for init and data")->group(kTrain);
  app.add_option("--log-interval", t.log_interval, "Iterations between log lines")->group(kTrain);
  app.add_option("--clip-grad", t.adam.clip_grad, "Global grad-norm clip (0: off)")->group(kTrain);

  const char* kLr = "Learning rate";
  app.add_option("--lr", t.lr.max_lr, "Peak learning rate")->group(kLr);
  app.add_option("--min-lr", t.lr.min_lr, "Final learning rate")->group(kLr);
  app.add_option("--lr-warmup-iters", t.lr.warmup_steps, "Linear warmup iterations")->group(kLr);
  app.add_option("--lr-decay-iters", t.lr.decay_steps, "Decay iterations (default train-iters)")
      ->group(kLr);
  app.add_option("--lr-decay-style", f.lr_decay_style, "constant | linear | cosine")
      ->check(CLI::IsMember({"constant", "linear", "cosine"}))
      ->group(kLr);

  const char* kReg = "Regularization";
  app.add_option("--weight-decay", t.adam.weight_decay, "Decoupled weight decay")->group(kReg);
  app.add_option("--adam-beta1", t.adam.beta1, "Adam beta1")->group(kReg);
  app.add_option("--adam-beta2", t.adam.beta2, "Adam beta2")->group(kReg);
  app.add_option("--adam-eps", t.adam.eps, "Adam epsilon")->group(kReg);
}

void finalize_train_flags(TrainFlags& f) {
  ModelConfig& m = f.model;
  if (!f.group_query_attention) m.num_query_groups = m.num_heads;
  m.moe.router.num_experts = m.num_experts;
  finalize_router_flags(m.moe.router, f.router);
  m.moe_layer_pattern = m.num_experts > 0 ? parse_moe_layer_freq(f.moe_layer_freq, m.num_layers)
                                          : std::vector<int>{};
  f.train.lr.style = optim::parse_lr_decay_style(f.lr_decay_style);
  m.validate();
  if (f.train.lr.decay_steps == 0) f.train.lr.decay_steps = f.train.train_iters;
  f.train.validate();
}

}  // namespace moecore::train
