#pragma once
// Counts the heap allocations (global operator new) a thread makes inside a scope; the
// replacement operators are in allocation_counter.cpp, linked into the suites that use it.
#include <cstdint>

namespace ringattn::test {

//! Allocations this thread made since the scope began; counting is per thread, so other threads
//! (the test runner, other ranks) do not disturb it.
class allocation_scope {
public:
  allocation_scope();
  ~allocation_scope();
  allocation_scope(const allocation_scope&) = delete;
  allocation_scope& operator=(const allocation_scope&) = delete;
  std::uint64_t count() const;

private:
  std::uint64_t start_;
  bool was_counting_;
};

} // namespace ringattn::test
