#pragma once
// Runs one body per rank of an in-process group, each on its own thread, and collects what
// each rank threw.
#include <ringattn/comm/in_process.cuh>

#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace ringattn::test {

template <class Body>
std::vector<std::exception_ptr> on_ranks(in_process_group& group, Body body) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(group.size()));
  std::vector<std::thread> threads;
  for (int r = 0; r < group.size(); ++r)
    threads.emplace_back([&, r] {
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
