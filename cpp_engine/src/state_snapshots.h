// Recurrent-state snapshots of a hybrid model for its prefix cache: which state slot holds the state after the
// cached block prefix with a given chained hash, at most `capacity` of them, the least recently used one given up
// first. Only bookkeeping: the engine copies the states.
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

namespace pocket {

class StateSnapshots {
 public:
  explicit StateSnapshots(int64_t capacity) : capacity_(capacity) {}

  int64_t capacity() const { return capacity_; }
  int64_t size() const { return static_cast<int64_t>(slot_.size()); }
  bool contains(uint64_t key) const { return slot_.count(key) > 0; }
  // The slot holding `key`'s state (marked most recently used), or -1.
  int64_t find(uint64_t key);
  // A slot to copy `key`'s state into, now registered under it: `fresh_slot` when there is room, else the least
  // recently used snapshot's slot (that snapshot is forgotten). Not for a key already held.
  int64_t claim(uint64_t key, int64_t fresh_slot);
  bool full() const { return size() >= capacity_; }
  // Forget `key`'s snapshot; returns its slot, or -1 when none is held.
  int64_t release(uint64_t key);
  // Forget every snapshot; returns their slots.
  std::vector<int64_t> clear();

 private:
  struct Held {
    int64_t slot;
    std::list<uint64_t>::iterator age;
  };
  int64_t capacity_;
  std::unordered_map<uint64_t, Held> slot_;
  std::list<uint64_t> lru_;   // front: least recently used
};

}  // namespace pocket
