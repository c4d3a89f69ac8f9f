// The tolerance table of docs/numerics.md, in one place. Raising a value needs a reason in the
// commit message and a row in docs/numerics.md.
#pragma once

namespace moecore::testing {

// fp64 central finite differences: truncation error O(h^2) ~ 1e-10 relative at h = 1e-5 on
// O(1) smooth functions, rounding error ~ eps/h ~ 1e-11.
inline constexpr double kFdStep = 1e-5;
inline constexpr double kFdRtol = 1e-6;
inline constexpr double kFdAtol = 1e-8;

// f32 fast path vs f32 reference loop: different summation order (blocked BLAS, vector lanes);
// error grows like sqrt(K) * eps32 ~ 1e-6 for K ~ 1e2..1e3 with O(1) inputs.
inline constexpr double kF32Rtol = 1e-5;
inline constexpr double kF32Atol = 1e-5;

// f64 fast path vs f64 reference.
inline constexpr double kF64Rtol = 1e-12;
inline constexpr double kF64Atol = 1e-12;

// f64 results that differ only by the rounding of a few additions (dispatch + combine of K
// prob-weighted copies): a few ulps.
inline constexpr double kF64FewUlps = 1e-15;

// moecore's router vs the router fixtures (tests/fixtures/router), per tensor, in units of the
// tensor's own largest |value| (the scale of the rounding inside a computation whose terms are
// that large; an absolute 1e-6 said nothing about aux-gradient entries of 1e-7).
// Against the fp64 run of Megatron's functions (fp32 casts widened): the same math in f64 in
// another order. Measured <= 3 f64 ulps of the largest value (dW, dx); 16 leaves headroom.
inline constexpr double kFixtureF64Ulps = 16;
// Against Megatron as it runs: it rounds softmax / sigmoid and the aux-loss scores to fp32 even
// for fp64 logits, and the aux-loss gradient is an fp32 difference of terms as large as the
// tensor's largest entry. Measured: Megatron fp32 vs its fp64 run <= 4.1 fp32 ulps of the largest
// value (dx of capacity_position_pad, the aux/z logit gradient of global_aux_two_micro).
inline constexpr double kMegatronFp32Ulps = 8;

// f32 model (the trainer's fast paths: oneDNN GEMMs, vectorised attention / softmax / SwiGLU,
// fast_exp) vs the f64 model on the same weights (the f32 ones widened) and batch
// (GPTModel.F32GradientsMatchF64OnTheSameWeights). f32 rounds each operation by u = 2^-24 ~
// 6e-8; a gradient passes through a few GEMMs (sums of 32..96 products), norms and softmaxes
// per layer, so its error is some u times the depth of the chain: a few 1e-7 in norm. Small
// elements of a tensor carry absolute errors of the size of the large ones, so the elementwise
// check scales its atol by the tensor's rms. Measured over 8 seeds (1 and 3 threads, the same):
// loss (lm + aux + z) <= 2.4e-8 relative; gradients <= 6.9e-7 relative norm; max elementwise
// |diff| <= 4.1e-6 * rms(gradient). Tolerances: ~4-5x the worst measured.
inline constexpr double kF32ModelLossRtol = 1e-7;
inline constexpr double kF32ModelGradRelNorm = 3e-6;    // |g32 - g64| / |g64|, per tensor
inline constexpr double kF32ModelGradRtol = 1e-5;       // elementwise, with the atol below
inline constexpr double kF32ModelGradAtolPerRms = 2e-5; // atol = this * rms(g64), per tensor

// --bf16 model vs the same f32 model (GEMM inputs rounded to bf16, f32 accumulation): each
// product carries ~2^-9 relative input error; a loss over O(1) logits moves ~1e-3 relative, a
// parameter gradient (a sum of products of rounded inputs) ~1e-2 in norm. Measured on the tiny
// test model: loss 3.0e-4 relative, gradients 2.8e-3 .. 1.1e-2 relative norm.
inline constexpr double kBf16LossRtol = 2e-3;
inline constexpr double kBf16GradRelNorm = 3e-2;

// bf16 round trip: 8 significant bits; round-to-nearest errs by at most half an ulp, which is
// up to 2^-8 relative just above a power of two.
inline constexpr double kBf16Rtol = 1.0 / 256.0;

// A HuggingFace checkpoint imported by `moecore convert` (tests/fixtures/hf/) vs transformers'
// float32 forward of the same weights (reference.json), moecore's f32 forward (oneDNN GEMMs,
// f64 router math, f64 RoPE angles) against PyTorch's (f32 RoPE angles, softmax over E then
// renormalised): two f32 computations of the same function in another order, each within a
// few 1e-6 of the exact value on logits of magnitude ~3 (tools/check_hf_mapping.py: f64 vs
// transformers 2.5e-6). The routing must be identical (the fixtures keep every top-k gap above
// 1e-3). Logits: |diff| <= this * the sequence's largest |logit|; routing weights (<= 1): this,
// absolute; the mean loss: this, relative. Measured: logits 6.6e-7 of the largest (2.0e-6
// absolute, qwen3_moe; qwen2_moe 6.0e-7, 4.1e-6 absolute; mixtral 4.7e-7), routing weights
// 6.4e-7, losses 7.1e-8. Also the trainer's f32 forward of an imported DeepSeek-V3 vs
// transformers' float64 reference.json (within kHfF64LogitsRtol's few 1e-7 of exact, so one f32
// computation against a near-exact one): logits 8.2e-7 (deepseek_v3), 9.6e-7 (no q LoRA),
// 1.25e-6 (fp8) of the largest, losses <= 1.5e-7.
inline constexpr double kHfLogitsRtol = 5e-6;

// transformers' float64 forward of DeepSeek-V3 (reference.json of tests/fixtures/hf/deepseek_v3*)
// vs a float64 computation of the same function: the imported moecore model in float64 and a
// float64 plain-loop transcription of transformers (tests/train/test_hf_deepseek_v3.cpp), which
// agree with each other to kF64Rtol. transformers' "float64" model still rounds to float32 its
// RMSNorms (DeepseekV3RMSNorm upcasts to float32, not to the input's dtype), its router logits
// (F.linear in float32) and its RoPE tables (inv_freq and the angles in float32), ~6e-8
// relative each, through three layers. Logits: |diff| <= this * the sequence's largest |logit|;
// the mean loss: this, relative. Measured (both alike): logits 3.7e-7 of the largest
// (deepseek_v3), 3.4e-7 (no q LoRA), 2.9e-7 (fp8); losses <= 6.5e-8.
inline constexpr double kHfF64LogitsRtol = 2e-6;

// Layout parity (tests/parallel/mpi/test_train_parity_mpi.cpp): N ranks vs 1 rank, 10 training
// steps of the same global batch. The layouts sum the same gradients in another order (per-rank
// partial sums of the micro-batches, then the all-reduce; the expert sum of squares per EP rank):
// an ulp or two per step. f64: measured bitwise-equal losses and weights for DP 2..8 (Adam's
// moments are fp32 and absorb ulp-level gradient differences); the tolerance allows a rounding
// flip of one fp32 moment (6e-8 relative in one update, ~1e-8 relative in the weight, ~1e-10 in
// the loss). f32: measured <= 2e-8 on the metrics, <= 8e-6 relative on weights above 1e-3.
inline constexpr double kParityF64Rtol = 1e-10;        // per-step lm loss, aux, z, grad norm
inline constexpr double kParityF64WeightRtol = 1e-7;   // final weights
inline constexpr double kParityF64WeightAtol = 1e-10;
inline constexpr double kParityF32Rtol = 1e-5;
inline constexpr double kParityF32WeightRtol = 1e-4;
inline constexpr double kParityF32WeightAtol = 1e-6;
// --bf16 under tensor parallelism vs the 1-rank --bf16 run (TensorParallelParity.LayoutsBf16).
// Step 1 (the same weights) holds to kParityF32Rtol: the layouts sum the same products in
// another order (row-parallel partial sums, the vocab-parallel head's slices), measured lm
// <= 5.8e-9, grad norm <= 6.5e-9. Later steps: an f32 ulp of difference before a bf16 rounding
// point (a norm's output, an activation, the dlogits) flips that element by 2^-8, which moves
// some router scores and Adam's normalised steps; the flips compound over the steps. Measured
// (10 steps, native and widened bf16 GEMMs): lm <= 6.0e-5, aux / z <= 1.7e-4, grad norm
// <= 2.4e-3; weights within 0.69 of (atol + rtol |w|) below, the worst an expert fc1 weight of
// 2.3e-3 that moved 2.1e-3 (0.7 of the peak lr 3e-3) away.
inline constexpr double kParityBf16Rtol = 1e-2;        // per-step lm loss, aux, z, grad norm
inline constexpr double kParityBf16WeightRtol = 0.1;   // final weights
inline constexpr double kParityBf16WeightAtol = 3e-3;  // the tests' peak learning rate
// The same layouts step by step (expect_bf16_steps_close), in units of bf16's unit roundoff u
// (8 significant bits: 2^-8), the size of one bf16 rounding flip. The steps on the initial
// weights hold to kParityF32Rtol (above). The weights after the first update (Adam's normalised
// step on gradients that differ where an f32 ulp flipped a bf16 value): per tensor
// |w - w_ref| / |w_ref - w0| <= u; measured <= 1.07e-3 = 0.27 u (2, 4, 8 ranks, widened bf16
// GEMMs), while one rank's learning rate x 1.01 in that step gives 7.2e-3 = 1.8 u. Later steps
// (the flips compound): lm <= u / 32, aux and z <= u / 8, grad norm <= u. Measured (2, 4, 8
// ranks, widened GEMMs, AMD EPYC without AVX512-BF16): lm <= 2.6e-5 = u / 150, aux <= 1.5e-4,
// z <= 4.4e-5 (<= u / 26), grad norm <= 5.2e-4 = u / 7.5; the maxima of the earlier measurement on
// both GEMM paths (kParityBf16Rtol above): lm 6.0e-5 = u / 65, aux / z 1.7e-4 = u / 23, grad norm
// 2.4e-3 = u / 1.6. One rank's learning rate x 1.1 in step 5 moves the next steps' lm by 4.2e-4
// (u / 9), in step 8 by 2.2e-4 (u / 18).
// The first update leaves out the elements that moved less than lr / 2 in both runs: Adam's
// first step is lr g / (|g| + eps), so their gradients were below eps in both, where the layouts'
// rounding noise sets the sign (with the residual stream and the MoE way back in bf16, one
// element of MLA's 512-element linear_kv_down_proj.weight at TP 2 + SP x ETP 2, native path,
// had a gradient of +8.7e-10 in one run and -6.6e-10 in the other: 2.15 u for that tensor with
// it, 0.083 u without; a layout's update scaled by 1.01 gives 2.6 u).
inline constexpr double kBf16UnitRoundoff = 0x1p-8;
inline constexpr double kParityBf16FirstUpdateRelNorm = kBf16UnitRoundoff;
inline constexpr double kParityBf16StepLmRtol = kBf16UnitRoundoff / 32;
inline constexpr double kParityBf16StepAuxZRtol = kBf16UnitRoundoff / 8;
inline constexpr double kParityBf16StepGradNormRtol = kBf16UnitRoundoff;
// The final weights of the routed parameters (the experts' fc1 / fc2, the router's weight) under
// --bf16, per expert e: |w_e - w_ref,e| / |w_ref,e - w0,e| (expect_bf16_routed_weights_close);
// the other weights keep kParityBf16WeightRtol / Atol element by element. Element by element
// the routed ones cannot hold to a learning rate: an element whose gradient terms nearly cancel
// takes its sign from the layouts' bf16 rounding flips, and Adam makes whole-lr steps of it.
// The layout runs replay the one-rank run's routing (moe/routing_replay.h): without it a token
// within a bf16 flip of a top-k tie went to another expert in one of the runs, adding or removing
// its whole term in two experts' gradients, and this row had to be 0.2 (measured <= 0.094; the
// element that failed an elementwise row at 1.69 had a gradient of +4.6e-5 in one run and -2.9e-5
// in the other). Measured with replay (the --bf16 layouts of TensorParallelParity, MtpParity and
// ContextParallelParity at 2 and 4 ranks, seeds 1-12, native and widened bf16 GEMMs, AMD EPYC with
// AVX512-BF16, n2 and the final norm's output in bf16): <= 0.009. Planted: one expert's gradient
// doubled in one step (step 5, decoder.layers.1 expert 0's fc1) 0.072, which the row of 0.2 and
// every other row let pass; one step's gradient of one expert negated 0.32 .. 0.42.
inline constexpr double kParityBf16RoutedTravelRelNorm = 0.03;
// Quantile beta (an fp32 buffer) after N ranks vs 1 rank: the per-micro-batch estimates are
// averaged in another order (per rank, then over dp_cp) in f64 and rounded to fp32: one fp32
// rounding flip, in units of the buffer's largest |value| (entries are centred, so some are ~0).
inline constexpr double kParityBetaUlps = 4;

// `moecore plan` against `moecore train` (tests/plan/test_plan_vs_measured.cpp). Memory: the
// plan is the trainer's arenas plus MPI's all-reduce scratch, the measured peak resident set adds
// the process (code, libraries, MPI: about 30 MiB); measured plan / RSS 0.931 .. 0.971. Dropless
// all-to-all bytes: the plan is the balanced expectation, a step's routing keeps more or fewer
// rows local; measured 0.834 (padded dispatch: exact, no tolerance).
inline constexpr double kPlanMemoryRtol = 0.10;
inline constexpr double kPlanDroplessAlltoallRtol = 0.25;
// docs/plan.md's figures for the planner (parameters in B to 0.01, memory in GiB to 0.1, TFLOP/s
// to 1, seconds to 0.1, bytes to 1) against the planner: the planner is deterministic arithmetic,
// so the only slack is the document's rounding, half a unit of the last digit it prints
// (tests/plan/documented_figure.h).
inline constexpr double kPlanDocumentedHalfUnits = 0.5;

}  // namespace moecore::testing
