// GatedDeltaNet (gated_delta.h).
#include "gated_delta.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <stdexcept>

namespace pocket {
namespace {

at::Tensor take_weight(TensorMap& weights, const std::string& name) {
  auto it = weights.find(name);
  if (it == weights.end()) throw std::invalid_argument("checkpoint has no tensor " + name);
  at::Tensor t = it->second;
  weights.erase(it);
  return t;
}

at::Tensor l2_normalize(const at::Tensor& x) { return x * at::rsqrt(x.pow(2).sum(-1, true) + 1e-6); }

}  // namespace

GatedDeltaNet::GatedDeltaNet(TensorMap& w, const std::string& p, const GatedDeltaShape& shape, int64_t hidden,
                             double eps)
    : shape_(shape), eps_(eps) {
  const int64_t C = shape.conv_dim(), Vd = shape.value_dim(), Hv = shape.num_v_heads;
  if (shape.num_k_heads < 1 || Hv % shape.num_k_heads != 0 || shape.conv_kernel < 1)
    throw std::invalid_argument("config.json: linear_num_value_heads must be a multiple of linear_num_key_heads");
  at::Tensor qkv = take_weight(w, p + "in_proj_qkv.weight"), z = take_weight(w, p + "in_proj_z.weight"),
             b = take_weight(w, p + "in_proj_b.weight"), a = take_weight(w, p + "in_proj_a.weight");
  if (qkv.size(0) != C || z.size(0) != Vd || b.size(0) != Hv || a.size(0) != Hv || qkv.size(1) != hidden)
    throw std::invalid_argument("linear-attention projections of " + p + " do not match config.json");
  in_proj_ = at::cat({qkv, z, b, a}, 0).contiguous();
  conv_w_ = take_weight(w, p + "conv1d.weight").reshape({C, -1}).contiguous();
  if (conv_w_.size(1) != shape.conv_kernel) throw std::invalid_argument(p + "conv1d.weight: wrong kernel size");
  neg_a_ = -take_weight(w, p + "A_log").exp();
  dt_bias_ = take_weight(w, p + "dt_bias");
  norm_w_ = take_weight(w, p + "norm.weight");
  out_proj_ = take_weight(w, p + "out_proj.weight");
}

void GatedDeltaNet::ensure_slots(int64_t n) {
  while (static_cast<int64_t>(conv_state_.size()) < n) {
    conv_state_.push_back(at::zeros({shape_.conv_kernel - 1, shape_.conv_dim()}));
    ssm_state_.push_back(at::zeros({shape_.num_v_heads, shape_.k_head_dim, shape_.v_head_dim}));
  }
}

// n tokens of one sequence: q, k [n, Hv, Dk], v and out [n, Hv, Dv], g and beta [n, Hv] (row stride Hv), state
// [Hv, Dk, Dv]. Heads are independent and run in parallel.
void GatedDeltaNet::recurrence(const float* q, const float* k, const float* v, const float* g, const float* beta,
                               float* state, float* out, int64_t n) const {
  const int64_t Hv = shape_.num_v_heads, Dk = shape_.k_head_dim, Dv = shape_.v_head_dim;
  at::parallel_for(0, Hv, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> pred(Dv), delta(Dv);
    for (int64_t h = h0; h < h1; ++h) {
      float* S = state + h * Dk * Dv;
      for (int64_t t = 0; t < n; ++t) {
        const float* qt = q + (t * Hv + h) * Dk;
        const float* kt = k + (t * Hv + h) * Dk;
        const float* vt = v + (t * Hv + h) * Dv;
        float* ot = out + (t * Hv + h) * Dv;
        const float decay = std::exp(g[t * Hv + h]), b = beta[t * Hv + h];
        std::fill(pred.begin(), pred.end(), 0.0f);
        for (int64_t i = 0; i < Dk; ++i) {   // decay the state and predict v from it: S^T k
          float* row = S + i * Dv;
          const float ki = kt[i];
          for (int64_t j = 0; j < Dv; ++j) {
            row[j] *= decay;
            pred[j] += ki * row[j];
          }
        }
        for (int64_t j = 0; j < Dv; ++j) {
          delta[j] = b * (vt[j] - pred[j]);
          ot[j] = 0.0f;
        }
        for (int64_t i = 0; i < Dk; ++i) {   // write k delta^T, then read with q
          float* row = S + i * Dv;
          const float ki = kt[i], qi = qt[i];
          for (int64_t j = 0; j < Dv; ++j) {
            row[j] += ki * delta[j];
            ot[j] += qi * row[j];
          }
        }
      }
    }
  });
}

at::Tensor GatedDeltaNet::forward(const at::Tensor& h, const std::vector<DeltaChunk>& chunks) {
  const int64_t T = h.size(0), C = shape_.conv_dim(), Kd = shape_.key_dim(), Vd = shape_.value_dim();
  const int64_t Hk = shape_.num_k_heads, Hv = shape_.num_v_heads, Dk = shape_.k_head_dim, Dv = shape_.v_head_dim;
  const int64_t K = shape_.conv_kernel, groups = Hv / Hk;
  at::Tensor proj = at::linear(h, in_proj_);
  at::Tensor mixed = proj.narrow(1, 0, C), z = proj.narrow(1, C, Vd);
  at::Tensor beta = at::sigmoid(proj.narrow(1, C + Vd, Hv)).contiguous();
  at::Tensor g = (neg_a_ * at::softplus(proj.narrow(1, C + Vd + Hv, Hv) + dt_bias_)).contiguous();
  at::Tensor core = at::empty({T, Hv, Dv});
  for (const DeltaChunk& ch : chunks) {
    if (ch.slot < 0 || ch.slot >= static_cast<int64_t>(conv_state_.size()))
      throw std::logic_error("a linear-attention chunk has no state slot");
    const int64_t n = ch.n;
    // Depthwise causal conv over the previous K-1 inputs and this chunk's.
    at::Tensor& conv_state = conv_state_[ch.slot];
    at::Tensor window = at::cat({ch.fresh ? at::zeros_like(conv_state) : conv_state, mixed.narrow(0, ch.row0, n)}, 0);
    at::Tensor conv = window.narrow(0, 0, n) * conv_w_.select(1, 0);
    for (int64_t j = 1; j < K; ++j) conv = conv + window.narrow(0, j, n) * conv_w_.select(1, j);
    conv_state.copy_(window.narrow(0, n, K - 1));
    at::Tensor act = at::silu(conv);
    at::Tensor q = l2_normalize(act.narrow(1, 0, Kd).reshape({n, Hk, Dk}));
    at::Tensor k = l2_normalize(act.narrow(1, Kd, Kd).reshape({n, Hk, Dk}));
    at::Tensor v = act.narrow(1, 2 * Kd, Vd).reshape({n, Hv, Dv}).contiguous();
    if (groups > 1) {
      q = q.repeat_interleave(groups, 1);
      k = k.repeat_interleave(groups, 1);
    }
    q = (q * (1.0 / std::sqrt(static_cast<double>(Dk)))).contiguous();
    k = k.contiguous();
    at::Tensor& state = ssm_state_[ch.slot];
    if (ch.fresh) state.zero_();
    recurrence(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>() + ch.row0 * Hv,
               beta.data_ptr<float>() + ch.row0 * Hv, state.data_ptr<float>(),
               core.data_ptr<float>() + ch.row0 * Hv * Dv, n);
  }
  // Gated RMSNorm per value head, then the output projection.
  at::Tensor normed = core * at::rsqrt(core.pow(2).mean(-1, true) + eps_);
  normed = norm_w_ * normed;
  at::Tensor gated = normed * at::silu(z.reshape({T, Hv, Dv}));
  return at::linear(gated.reshape({T, Vd}), out_proj_);
}

}  // namespace pocket
