// StateSnapshots (state_snapshots.h).
#include "state_snapshots.h"

#include <stdexcept>

namespace pocket {

int64_t StateSnapshots::find(uint64_t key) {
  auto it = slot_.find(key);
  if (it == slot_.end()) return -1;
  lru_.splice(lru_.end(), lru_, it->second.age);
  return it->second.slot;
}

int64_t StateSnapshots::claim(uint64_t key, int64_t fresh_slot) {
  if (contains(key)) throw std::logic_error("a state snapshot is already held for this prefix");
  int64_t slot = fresh_slot;
  if (full()) {
    const uint64_t oldest = lru_.front();
    lru_.pop_front();
    slot = slot_.at(oldest).slot;
    slot_.erase(oldest);
  }
  if (slot < 0) throw std::logic_error("no state slot to hold a snapshot in");
  lru_.push_back(key);
  slot_[key] = Held{slot, std::prev(lru_.end())};
  return slot;
}

int64_t StateSnapshots::release(uint64_t key) {
  auto it = slot_.find(key);
  if (it == slot_.end()) return -1;
  const int64_t slot = it->second.slot;
  lru_.erase(it->second.age);
  slot_.erase(it);
  return slot;
}

std::vector<int64_t> StateSnapshots::clear() {
  std::vector<int64_t> slots;
  for (const auto& [key, held] : slot_) slots.push_back(held.slot);
  slot_.clear();
  lru_.clear();
  return slots;
}

}  // namespace pocket
