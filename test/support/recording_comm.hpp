#pragma once
// A Communicator that records every exchange of the one it wraps (host and device), for the tests
// that compare what a path sent with its schedule's program (ring/program.cuh).
#include <ringattn/ring/program.cuh>
#include <ringattn/ring/schedules.cuh>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ringattn::test {

// One exchange as a communicator saw it.
struct sent {
  std::size_t send_bytes = 0, recv_bytes = 0;
  int to = 0, from = 0;
  std::int64_t tag = 0;
  friend bool operator==(const sent&, const sent&) = default;
};

inline sent seen_of(const detail::message& m) {
  return {m.send_bytes, m.recv_bytes, m.to, m.from, m.tag};
}
inline std::vector<sent> seen_of(const std::vector<detail::message>& ms) {
  std::vector<sent> out;
  for (const detail::message& m : ms)
    out.push_back(seen_of(m));
  return out;
}

// The messages of a schedule's forward and backward programs for a rank's plan `s` (a schedule
// that names a program: ring_pass, all_gather_kv), as a communicator sees them.
template <class Schedule, class T>
std::pair<std::vector<sent>, std::vector<sent>> program_messages(const ring_schedule& s,
                                                                 const attention_arguments& a) {
  using program = typename Schedule::program;
  detail::trace_engine forward, backward;
  const ring_workspace w = program::workspace(s, a, element_format::of<T>());
  program::forward(forward, s, w);
  program::backward(backward, s, w);
  return {seen_of(forward.messages()), seen_of(backward.messages())};
}

template <class C>
class recording_communicator {
public:
  explicit recording_communicator(C& inner) : inner_(inner) {}
  static constexpr bool host_collectives = C::host_collectives;

  int rank() const noexcept { return inner_.rank(); }
  int size() const noexcept { return inner_.size(); }
  std::uint64_t bytes_sent() const noexcept { return inner_.bytes_sent(); }
  void exchange(const void* s, std::size_t sb, int to, void* r, std::size_t rb, int from,
                std::int64_t step) {
    log.push_back({sb, rb, to, from, step});
    inner_.exchange(s, sb, to, r, rb, from, step);
  }
  template <class Stream>
  void exchange_async(const void* s, std::size_t sb, int to, void* r, std::size_t rb, int from,
                      std::int64_t step, const Stream& stream) requires requires(C& c) {
    c.exchange_async(s, sb, to, r, rb, from, step, stream);
  }
  {
    log.push_back({sb, rb, to, from, step});
    inner_.exchange_async(s, sb, to, r, rb, from, step, stream);
  }
  void all_gather(const void* s, std::size_t n, void* r) { inner_.all_gather(s, n, r); }
  void barrier() { inner_.barrier(); }
  void abort(const std::string& why) { inner_.abort(why); }
  void prepare_device() requires requires(C& c) { c.prepare_device(); }
  { inner_.prepare_device(); }
  int device() const requires requires(const C& c) { c.device(); }
  { return inner_.device(); }
  void begin_call(std::uint64_t call) requires requires(C& c) { c.begin_call(call); }
  { inner_.begin_call(call); }
  [[nodiscard]] auto enter_call() requires requires(C& c) { c.enter_call(); }
  { return inner_.enter_call(); }

  std::vector<sent> log; // every exchange, in the order this rank made them

private:
  C& inner_;
};

} // namespace ringattn::test
