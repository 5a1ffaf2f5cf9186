// GatedDeltaNet (gated_delta.h).
#include "gated_delta.h"

#include <ATen/Parallel.h>

#include <algorithm>
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
  conv_w_ = take_weight(w, p + "conv1d.weight").reshape({C, -1}).t().contiguous();   // [K, C]: taps over channels
  if (conv_w_.size(0) != shape.conv_kernel) throw std::invalid_argument(p + "conv1d.weight: wrong kernel size");
  neg_a_ = -take_weight(w, p + "A_log").exp();
  dt_bias_ = take_weight(w, p + "dt_bias");
  norm_w_ = take_weight(w, p + "norm.weight");
  out_proj_ = take_weight(w, p + "out_proj.weight");
}

void GatedDeltaNet::place(const at::Device& device, bool aten_ops) {
  if (!device.is_cpu() && !aten_ops) throw std::logic_error("the Gated DeltaNet's loops run on the CPU only");
  options_ = options_.device(device);
  aten_ops_ = aten_ops;
  for (at::Tensor* t : {&in_proj_, &conv_w_, &neg_a_, &dt_bias_, &norm_w_, &out_proj_}) *t = t->to(device);
  for (auto* states : {&conv_state_, &ssm_state_})
    for (at::Tensor& t : *states) t = t.to(device);
}

void GatedDeltaNet::ensure_slots(int64_t n) {
  while (static_cast<int64_t>(conv_state_.size()) < n) {
    conv_state_.push_back(at::zeros({shape_.conv_kernel - 1, shape_.conv_dim()}, options_));
    ssm_state_.push_back(at::zeros({shape_.num_v_heads, shape_.k_head_dim, shape_.v_head_dim}, options_));
  }
}

void GatedDeltaNet::check_slot(const DeltaChunk& ch) const {
  if (ch.slot < 0 || ch.slot >= static_cast<int64_t>(conv_state_.size()))
    throw std::logic_error("a linear-attention chunk has no state slot");
}

void GatedDeltaNet::copy_slot(int64_t from, int64_t to) {
  conv_state_[to].copy_(conv_state_[from]);
  ssm_state_[to].copy_(ssm_state_[from]);
}

void GatedDeltaNet::conv_chunk(const float* mixed, int64_t stride, const DeltaChunk& ch, float* act) {
  const int64_t C = shape_.conv_dim(), K = shape_.conv_kernel, n = ch.n, Kd = shape_.key_dim();
  const int64_t Hk = shape_.num_k_heads, Dk = shape_.k_head_dim;
  at::Tensor& conv_state = conv_state_[ch.slot];
  if (ch.fresh) conv_state.zero_();
  const float* prev = conv_state.data_ptr<float>();   // [K-1, C]
  const float* w = conv_w_.data_ptr<float>();          // [K, C]
  // Window row r (0 <= r < n + K - 1): the state's rows, then the chunk's.
  auto window = [&](int64_t r) { return r < K - 1 ? prev + r * C : mixed + (r - (K - 1)) * stride; };
  for (int64_t t = 0; t < n; ++t) {
    float* out = act + t * C;
    for (int64_t c = 0; c < C; ++c) out[c] = 0.0f;
    for (int64_t j = 0; j < K; ++j) {
      const float* in = window(t + j);
      const float* tap = w + j * C;
      for (int64_t c = 0; c < C; ++c) out[c] += in[c] * tap[c];
    }
    for (int64_t c = 0; c < C; ++c) out[c] = out[c] / (1.0f + std::exp(-out[c]));
    const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dk));
    for (int64_t part = 0; part < 2; ++part)   // q then k, per key head: x / sqrt(sum x^2 + 1e-6)
      for (int64_t hk = 0; hk < Hk; ++hk) {
        float* x = out + part * Kd + hk * Dk;
        float ss = 0.0f;
        for (int64_t i = 0; i < Dk; ++i) ss += x[i] * x[i];
        const float scale = 1.0f / std::sqrt(ss + 1e-6f) * (part == 0 ? q_scale : 1.0f);
        for (int64_t i = 0; i < Dk; ++i) x[i] *= scale;
      }
  }
  // The last K-1 window rows become the state (rows of the old state first when the chunk is shorter).
  std::vector<float> next(static_cast<size_t>((K - 1) * C));
  for (int64_t r = 0; r < K - 1; ++r) std::copy(window(n + r), window(n + r) + C, next.begin() + r * C);
  std::copy(next.begin(), next.end(), conv_state.data_ptr<float>());
}

at::Tensor GatedDeltaNet::forward(const at::Tensor& h, const std::vector<DeltaChunk>& chunks) {
  if (aten_ops_) return forward_aten(h, chunks);
  const int64_t T = h.size(0), C = shape_.conv_dim(), Kd = shape_.key_dim(), Vd = shape_.value_dim();
  const int64_t Hk = shape_.num_k_heads, Hv = shape_.num_v_heads, Dk = shape_.k_head_dim, Dv = shape_.v_head_dim;
  const int64_t groups = Hv / Hk;
  at::Tensor proj = at::linear(h, in_proj_).contiguous();   // [T, P]: mixed (conv input), z, b, a
  const int64_t P = proj.size(1);
  at::Tensor beta = at::sigmoid(proj.narrow(1, C + Vd, Hv)).contiguous();
  at::Tensor g = (neg_a_ * at::softplus(proj.narrow(1, C + Vd + Hv, Hv) + dt_bias_)).contiguous();
  // Conv, SiLU and q/k normalisation per chunk (sequential over its tokens), into act [T, C].
  at::Tensor act = at::empty({T, C});
  for (const DeltaChunk& ch : chunks) {
    check_slot(ch);
    conv_chunk(proj.data_ptr<float>() + ch.row0 * P, P, ch, act.data_ptr<float>() + ch.row0 * C);
  }
  // The delta rule and the gated RMSNorm, one work item per (chunk, value head): its tokens in order.
  at::Tensor out = at::empty({T, Hv, Dv});
  const float* A = act.data_ptr<float>();
  const float* Z = proj.data_ptr<float>() + C;
  const float* G = g.data_ptr<float>();
  const float* B = beta.data_ptr<float>();
  const float* NW = norm_w_.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t items = static_cast<int64_t>(chunks.size()) * Hv;
  const int64_t grain = T * Hv >= 64 ? 1 : items;   // a few decode rows: one thread, no parallel region
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> pred(Dv), delta(Dv), o(Dv);
    for (int64_t item = i0; item < i1; ++item) {
      const DeltaChunk& ch = chunks[item / Hv];
      const int64_t h = item % Hv, hk = h / groups;
      float* S = ssm_state_[ch.slot].data_ptr<float>() + h * Dk * Dv;
      if (ch.fresh) std::fill(S, S + Dk * Dv, 0.0f);
      for (int64_t t = ch.row0; t < ch.row0 + ch.n; ++t) {
        const float* qt = A + t * C + hk * Dk;
        const float* kt = A + t * C + Kd + hk * Dk;
        const float* vt = A + t * C + 2 * Kd + h * Dv;
        const float decay = std::exp(G[t * Hv + h]), b = B[t * Hv + h];
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
          o[j] = 0.0f;
        }
        for (int64_t i = 0; i < Dk; ++i) {   // write k delta^T, then read with q
          float* row = S + i * Dv;
          const float ki = kt[i], qi = qt[i];
          for (int64_t j = 0; j < Dv; ++j) {
            row[j] += ki * delta[j];
            o[j] += qi * row[j];
          }
        }
        // Gated RMSNorm of the head's output: weight * o / rms(o) * silu(z).
        float ss = 0.0f;
        for (int64_t j = 0; j < Dv; ++j) ss += o[j] * o[j];
        const float r = 1.0f / std::sqrt(ss / static_cast<float>(Dv) + static_cast<float>(eps_));
        const float* zt = Z + t * P + h * Dv;
        float* ot = O + (t * Hv + h) * Dv;
        for (int64_t j = 0; j < Dv; ++j) ot[j] = NW[j] * (o[j] * r) * (zt[j] / (1.0f + std::exp(-zt[j])));
      }
    }
  });
  return at::linear(out.view({T, Vd}), out_proj_);
}

at::Tensor GatedDeltaNet::forward_aten(const at::Tensor& h, const std::vector<DeltaChunk>& chunks) {
  const int64_t T = h.size(0), C = shape_.conv_dim(), Kd = shape_.key_dim(), Vd = shape_.value_dim();
  const int64_t Hk = shape_.num_k_heads, Hv = shape_.num_v_heads, Dk = shape_.k_head_dim, Dv = shape_.v_head_dim;
  const int64_t K = shape_.conv_kernel, groups = Hv / Hk;
  at::Tensor proj = at::linear(h, in_proj_);   // [T, P]: mixed (conv input), z, b, a
  at::Tensor z = proj.narrow(1, C, Vd).view({T, Hv, Dv});
  at::Tensor beta = at::sigmoid(proj.narrow(1, C + Vd, Hv));
  at::Tensor decay = at::exp(neg_a_ * at::softplus(proj.narrow(1, C + Vd + Hv, Hv) + dt_bias_));   // [T, Hv]
  at::Tensor out = at::empty({T, Hv, Dv}, options_);
  for (const DeltaChunk& ch : chunks) {
    check_slot(ch);
    at::Tensor& conv_state = conv_state_[ch.slot];
    at::Tensor& S = ssm_state_[ch.slot];   // [Hv, Dk, Dv]
    if (ch.fresh) {
      conv_state.zero_();
      S.zero_();
    }
    // The causal depthwise conv over the state's K-1 rows then the chunk's, SiLU; the last K-1 rows kept.
    at::Tensor window = at::cat({conv_state, proj.narrow(0, ch.row0, ch.n).narrow(1, 0, C)}, 0);
    at::Tensor act = at::zeros({ch.n, C}, options_);
    for (int64_t j = 0; j < K; ++j) act.add_(window.narrow(0, j, ch.n) * conv_w_[j]);
    act = at::silu(act);
    conv_state.copy_(window.narrow(0, ch.n, K - 1));
    // q and k L2-normalised per key head (q also scaled by Dk^-0.5), then repeated for their value heads.
    auto heads = [&](int64_t offset, double scale) {
      at::Tensor x = act.narrow(1, offset, Kd).view({ch.n, Hk, Dk});
      x = x * at::rsqrt(x.pow(2).sum(-1, true) + 1e-6) * scale;
      return x.repeat_interleave(groups, 1);   // [n, Hv, Dk]
    };
    at::Tensor q = heads(0, 1.0 / std::sqrt(static_cast<double>(Dk))), k = heads(Kd, 1.0);
    at::Tensor v = act.narrow(1, 2 * Kd, Vd).view({ch.n, Hv, Dv});
    for (int64_t i = 0; i < ch.n; ++i) {
      const int64_t t = ch.row0 + i;
      S.mul_(decay[t].view({Hv, 1, 1}));
      at::Tensor kt = k[i].unsqueeze(2);                                   // [Hv, Dk, 1]
      at::Tensor predicted = (S * kt).sum(1);                              // S^T k: [Hv, Dv]
      at::Tensor delta = beta[t].unsqueeze(1) * (v[i] - predicted);        // [Hv, Dv]
      S.add_(kt * delta.unsqueeze(1));
      out[t].copy_((S * q[i].unsqueeze(2)).sum(1));                        // S^T q
    }
  }
  // Gated RMSNorm per head: weight * o / rms(o) * silu(z).
  at::Tensor normed = out * at::rsqrt(out.pow(2).mean(-1, true) + eps_) * norm_w_ * at::silu(z);
  return at::linear(normed.reshape({T, Vd}), out_proj_);
}

}  // namespace pocket
