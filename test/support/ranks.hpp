#pragma once
// Runs one body per rank of an in-process group, each on its own thread, and collects what
// each rank threw; with RINGATTN_TEST_JITTER_US set, each thread starts after a random delay.
#include <ringattn/comm/in_process.cuh>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace ringattn::test {

//! The largest random delay (microseconds) before a rank's thread starts: RINGATTN_TEST_JITTER_US
//! (0, none, where unset), for the stress runs.
inline int start_jitter_us() {
  static const int us = [] {
    const char* s = std::getenv("RINGATTN_TEST_JITTER_US");
    return s ? std::max(0, std::atoi(s)) : 0;
  }();
  return us;
}

template <class Body>
std::vector<std::exception_ptr> on_ranks(in_process_group& group, Body body) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(group.size()));
  std::vector<std::thread> threads;
  std::vector<int> delay(static_cast<std::size_t>(group.size()), 0);
  if (const int most = start_jitter_us(); most > 0) {
    std::random_device rd;
    std::uniform_int_distribution<int> u(0, most);
    for (int& d : delay)
      d = u(rd);
  }
  for (int r = 0; r < group.size(); ++r)
    threads.emplace_back([&, r] {
      if (delay[static_cast<std::size_t>(r)] > 0)
        std::this_thread::sleep_for(std::chrono::microseconds(delay[static_cast<std::size_t>(r)]));
      try {
        auto comm = group.communicator(r);
        body(r, comm);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads)
    t.join();
  return errors;
}

//! The message of a captured exception ("" for none).
inline std::string message(const std::exception_ptr& e) {
  try {
    if (e) std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
  return "";
}

} // namespace ringattn::test
