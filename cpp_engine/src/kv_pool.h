// KV-cache blocks: a free list, reference counts, and a prefix cache of full blocks keyed by chained hashes of
// their tokens (verified on a hit), whose unreferenced blocks are evicted least recently used first.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <unordered_map>
#include <vector>

namespace pocket {

class KvPool {
 public:
  KvPool(int64_t num_blocks, int64_t block_size, bool prefix_caching);

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  bool prefix_caching() const { return prefix_caching_; }
  int64_t num_available() const { return static_cast<int64_t>(free_.size() + lru_.size()); }
  int64_t prefix_queries() const { return queries_; }
  int64_t prefix_hits() const { return hits_; }

  // Append blocks to `table` until it covers `num_tokens` positions; false (and `table` unchanged) when short.
  bool grow(std::vector<int64_t>& table, int64_t num_tokens);
  // Drop the table's references (cached blocks stay findable until evicted) and clear it.
  void release(std::vector<int64_t>& table);

  // Claim the cached blocks holding the longest whole-block prefix of tokens[0, limit) into the empty `table`;
  // returns the tokens they cover, with `hashed`/`last_hash` set for later `register_full` calls. With
  // `resumable`, only a prefix whose chained hash it accepts counts (a hybrid model resumes only where a state
  // snapshot exists).
  int64_t match(const std::vector<int64_t>& tokens, int64_t limit, std::vector<int64_t>& table, int64_t& hashed,
                uint64_t& last_hash, const std::function<bool(uint64_t)>& resumable = nullptr);
  // Make the full blocks of tokens[0, computed) findable by later `match` calls.
  void register_full(const std::vector<int64_t>& tokens, int64_t computed, const std::vector<int64_t>& table,
                     int64_t& hashed, uint64_t& last_hash);
  // Forget every cached prefix (referenced blocks stay with their owners).
  void clear_prefix_cache();

 private:
  struct Entry {
    uint64_t parent = 0;
    std::vector<int64_t> tokens;
    int64_t block = -1;
  };
  uint64_t hash_block(uint64_t parent, const int64_t* tokens) const;
  int64_t take_block();
  void forget(int64_t block);

  int64_t num_blocks_, block_size_;
  bool prefix_caching_;
  std::vector<int64_t> refs_;
  std::vector<uint64_t> block_hash_;         // the hash a cached block is registered under
  std::vector<char> cached_;
  std::vector<int64_t> free_;                // unreferenced, uncached
  std::list<int64_t> lru_;                   // unreferenced, cached: front evicted first
  std::vector<std::list<int64_t>::iterator> lru_pos_;
  std::vector<char> in_lru_;
  std::unordered_map<uint64_t, Entry> cache_;
  int64_t queries_ = 0, hits_ = 0;
};

}  // namespace pocket
