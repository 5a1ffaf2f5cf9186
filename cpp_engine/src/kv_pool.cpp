// The block pool and prefix cache (kv_pool.h).
#include "kv_pool.h"

#include <stdexcept>

namespace pocket {

KvPool::KvPool(int64_t num_blocks, int64_t block_size, bool prefix_caching)
    : num_blocks_(num_blocks), block_size_(block_size), prefix_caching_(prefix_caching),
      refs_(num_blocks, 0), block_hash_(num_blocks, 0), cached_(num_blocks, 0), lru_pos_(num_blocks),
      in_lru_(num_blocks, 0) {
  if (num_blocks < 1 || block_size < 1) throw std::invalid_argument("the KV cache needs at least one block");
  free_.reserve(num_blocks);
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

uint64_t KvPool::hash_block(uint64_t parent, const int64_t* tokens) const {
  uint64_t h = parent ^ 0x9E3779B97F4A7C15ull;
  for (int64_t i = 0; i < block_size_; ++i) {
    uint64_t z = h + static_cast<uint64_t>(tokens[i]) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    h = z ^ (z >> 31);
  }
  return h;
}

void KvPool::forget(int64_t block) {
  if (!cached_[block]) return;
  cache_.erase(block_hash_[block]);
  cached_[block] = 0;
}

int64_t KvPool::take_block() {
  int64_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {
    b = lru_.front();
    lru_.pop_front();
    in_lru_[b] = 0;
    forget(b);
  }
  refs_[b] = 1;
  return b;
}

bool KvPool::grow(std::vector<int64_t>& table, int64_t num_tokens) {
  const int64_t need = (num_tokens + block_size_ - 1) / block_size_ - static_cast<int64_t>(table.size());
  if (need <= 0) return true;
  if (need > num_available()) return false;
  for (int64_t i = 0; i < need; ++i) table.push_back(take_block());
  return true;
}

void KvPool::release(std::vector<int64_t>& table) {
  // Last blocks first into the LRU: a prefix's head outlives its tail.
  for (auto it = table.rbegin(); it != table.rend(); ++it) {
    const int64_t b = *it;
    if (--refs_[b] > 0) continue;
    if (cached_[b]) {
      lru_.push_back(b);
      lru_pos_[b] = std::prev(lru_.end());
      in_lru_[b] = 1;
    } else {
      free_.push_back(b);
    }
  }
  table.clear();
}

int64_t KvPool::match(const std::vector<int64_t>& tokens, int64_t limit, std::vector<int64_t>& table,
                      int64_t& hashed, uint64_t& last_hash, const std::function<bool(uint64_t)>& resumable) {
  hashed = 0;
  last_hash = 0;
  if (!prefix_caching_) return 0;
  ++queries_;
  // The cached chain first, then the longest resumable part of it claimed.
  std::vector<int64_t> blocks;
  std::vector<uint64_t> hashes;
  uint64_t parent = 0;
  const int64_t full = limit / block_size_;
  for (int64_t i = 0; i < full; ++i) {
    const int64_t* block_tokens = tokens.data() + i * block_size_;
    const uint64_t h = hash_block(parent, block_tokens);
    auto it = cache_.find(h);
    if (it == cache_.end() || it->second.parent != parent ||
        !std::equal(it->second.tokens.begin(), it->second.tokens.end(), block_tokens))
      break;
    blocks.push_back(it->second.block);
    hashes.push_back(h);
    parent = h;
  }
  int64_t keep = static_cast<int64_t>(blocks.size());
  if (resumable)
    while (keep > 0 && !resumable(hashes[keep - 1])) --keep;
  for (int64_t i = 0; i < keep; ++i) {
    const int64_t b = blocks[i];
    if (refs_[b]++ == 0 && in_lru_[b]) {
      lru_.erase(lru_pos_[b]);
      in_lru_[b] = 0;
    }
    table.push_back(b);
  }
  hashed = keep;
  last_hash = keep > 0 ? hashes[keep - 1] : 0;
  if (keep > 0) ++hits_;
  return keep * block_size_;
}

void KvPool::register_full(const std::vector<int64_t>& tokens, int64_t computed, const std::vector<int64_t>& table,
                           int64_t& hashed, uint64_t& last_hash) {
  if (!prefix_caching_) return;
  const int64_t full = std::min<int64_t>(computed / block_size_, static_cast<int64_t>(table.size()));
  for (; hashed < full; ++hashed) {
    const int64_t* block_tokens = tokens.data() + hashed * block_size_;
    const uint64_t h = hash_block(last_hash, block_tokens);
    const int64_t b = table[hashed];
    if (!cached_[b] && cache_.find(h) == cache_.end()) {
      cache_[h] = Entry{last_hash, std::vector<int64_t>(block_tokens, block_tokens + block_size_), b};
      block_hash_[b] = h;
      cached_[b] = 1;
    }
    last_hash = h;
  }
}

void KvPool::clear_prefix_cache() {
  for (int64_t b : lru_) {
    in_lru_[b] = 0;
    free_.push_back(b);
  }
  lru_.clear();
  for (int64_t b = 0; b < num_blocks_; ++b) cached_[b] = 0;
  cache_.clear();
}

}  // namespace pocket
