#pragma once
//! \file
//! Host arrays packed into one device allocation at plan time (one allocation, one copy), each
//! starting 16-byte aligned: the tables of the kernels' schedules and of device partition plans.
//! While a `table_pool::use` scope is active on a thread, the tables made there draw their device
//! memory from that pool and give it back when destroyed, and copy through its pinned staging,
//! without waiting: on the pool's own stream, whose event `uploaded()` a launch that reads them
//! waits on, or on the steps' stream (`fix`), in order with the launches. Once the pool has grown
//! to a step's size, planning the step again allocates nothing.

#include <ringattn/cuda_check.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

namespace ringattn::detail {

//! Device blocks for `device_tables` to reuse, a pinned staging buffer and a stream to copy on.
//! The owner releases a table's block back only once no launch can still read it: a pool serves
//! one generation of a plan's tables, and its owner waits for that generation's last step before
//! destroying the tables it holds (`decode_device_resources`). The owner brackets a plan's tables
//! with `begin` and `finish`; the copies stay asynchronous.
class table_pool {
public:
  table_pool() = default;
  ~table_pool() { // after every table drawn from it; nothing useful to report from a destructor
    // copies still reading the staging
    if (upload_ && !fixed_stream_)
      cudaStreamSynchronize(upload_);
    else if (uploaded_)
      cudaEventSynchronize(uploaded_);
    for (const block& b : free_)
      cudaFree(b.memory);
    for (const block& b : fixed_)
      cudaFree(b.memory);
    if (staging_) cudaFreeHost(staging_);
    if (uploaded_) cudaEventDestroy(uploaded_);
    if (upload_ && !fixed_stream_) cudaStreamDestroy(upload_);
  }
  table_pool(const table_pool&) = delete;
  table_pool& operator=(const table_pool&) = delete;

  //! Tables constructed on this thread while a `use` lives draw from `pool`.
  class use {
  public:
    explicit use(table_pool& pool) : previous_(std::exchange(current_, &pool)) {}
    ~use() { current_ = previous_; }
    use(const use&) = delete;
    use& operator=(const use&) = delete;

  private:
    table_pool* previous_;
  };

  //! From now on the copies go on `stream` (the steps' stream: each after the launches enqueued
  //! there before it, which may still read the tables it overwrites) and the tables of a plan
  //! take the blocks the first plan after this call took, in the order they were made: the same
  //! addresses plan after plan, as long as each table fits the block (`fits`). Before any table.
  void fix(cudaStream_t stream) {
    fixed_stream_ = true;
    upload_ = stream;
  }
  //! Whether the last plan's tables each fitted the block of their place (always without `fix`).
  bool fits() const noexcept { return fits_; }
  //! A plan's tables follow: the staging is reused once the previous plan's copies have read it
  //! (a host wait only while the device has not reached them).
  void begin() {
    if (uploaded_) RINGATTN_CUDA_CHECK(cudaEventSynchronize(uploaded_));
    used_ = 0, next_ = 0, fits_ = true;
  }
  //! The plan's tables are made: `uploaded()` completes once their copies have.
  void finish() {
    if (!upload_) return;
    if (!uploaded_)
      RINGATTN_CUDA_CHECK(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming));
    RINGATTN_CUDA_CHECK(cudaEventRecord(uploaded_, upload_));
  }
  //! Completes once the tables of the last plan are on the device (null before any copy).
  cudaEvent_t uploaded() const noexcept { return uploaded_; }

private:
  friend class device_tables;
  struct block {
    void* memory = nullptr;
    std::size_t bytes = 0;
  };
  // Fixed (`fix`): the block of the next place, the first plan making the places (a block too
  // small is replaced, and the plan told by `fits`). Otherwise the smallest free block of at
  // least `bytes`, else a new one.
  block acquire(std::size_t bytes) {
    if (fixed_stream_) {
      if (next_ == fixed_.size()) {
        fixed_.reserve(fixed_.size() + 1);
        fixed_.push_back(allocate(bytes));
      } else if (fixed_[next_].bytes < bytes) {
        fits_ = false;
        block& place = fixed_[next_];
        const block b = allocate(bytes);
        cudaFree(place.memory); // synchronous: whatever read it has finished
        place = b;
      }
      return fixed_[next_++];
    }
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->bytes >= bytes && (best == free_.end() || it->bytes < best->bytes)) best = it;
    if (best != free_.end()) {
      const block b = *best;
      free_.erase(best);
      return b;
    }
    return allocate(bytes);
  }
  static block allocate(std::size_t bytes) {
    block b{nullptr, std::bit_ceil(std::max<std::size_t>(bytes, 4096))}; // room to grow into
    RINGATTN_CUDA_CHECK(device_malloc(&b.memory, b.bytes));
    return b;
  }
  void release(block b) noexcept {
    if (fixed_stream_) return; // the block stays in its place
    try {
      free_.push_back(b);
    } catch (...) { // no room to remember it: give it back to the device instead
      cudaFree(b.memory);
    }
  }
  // `bytes` of pinned staging after what was staged since `begin` (kept until the next `begin`:
  // the copies read it later). Growing waits for the pending copies, then replaces the buffer.
  unsigned char* stage(std::size_t bytes) {
    bytes = (bytes + 15) / 16 * 16;
    if (used_ + bytes > staging_bytes_) {
      if (upload_ && used_ > 0) { // this plan's copies so far read the old staging
        finish();
        RINGATTN_CUDA_CHECK(cudaEventSynchronize(uploaded_));
      }
      const std::size_t grown =
          std::bit_ceil(std::max({used_ + bytes, 2 * staging_bytes_, std::size_t{4096}}));
      unsigned char* fresh = nullptr;
      RINGATTN_CUDA_CHECK(pinned_malloc(&fresh, grown));
      if (staging_) cudaFreeHost(staging_); // its copies are done; nothing useful to report
      staging_ = fresh, staging_bytes_ = grown, used_ = 0;
    }
    unsigned char* at = staging_ + used_;
    used_ += bytes;
    return at;
  }
  // Copies `bytes` staged at `from` to `device` on the pool's stream, without waiting.
  void upload(void* device, const unsigned char* from, std::size_t bytes) {
    if (!upload_) RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&upload_, cudaStreamNonBlocking));
    RINGATTN_CUDA_CHECK(cudaMemcpyAsync(device, from, bytes, cudaMemcpyHostToDevice, upload_));
  }

  inline static thread_local table_pool* current_ = nullptr;
  std::vector<block> free_;
  std::vector<block> fixed_; // with `fix`: the blocks of a plan's tables, in the order made
  std::size_t next_ = 0;     // the next table's place in `fixed_`
  bool fixed_stream_ = false, fits_ = true;
  unsigned char* staging_ = nullptr;
  std::size_t staging_bytes_ = 0, used_ = 0;
  cudaStream_t upload_ = nullptr;
  cudaEvent_t uploaded_ = nullptr;
};

class device_tables {
public:
  device_tables() = default;
  //! Copies every span to the current device (synchronously outside a pool); `at<T>(i)` is where
  //! span i landed.
  //! Inside a `table_pool::use` scope the memory comes from that pool and returns to it, and the
  //! copy is enqueued on the pool's stream (see `table_pool::uploaded`).
  template <class... T>
  explicit device_tables(std::span<const T>... parts) {
    const std::size_t sizes[] = {parts.size_bytes()...};
    std::size_t total = 0;
    for (std::size_t n : sizes) {
      offsets_.push_back(total);
      total += (n + 15) / 16 * 16;
    }
    total = std::max<std::size_t>(total, 16);
    if (table_pool* pool = table_pool::current_) {
      unsigned char* staging = pool->stage(total);
      std::size_t i = 0;
      (copy_part(staging + offsets_[i++], parts.data(), parts.size_bytes()), ...);
      const table_pool::block b = pool->acquire(total);
      try {
        pool->upload(b.memory, staging, total);
      } catch (...) {
        pool->release(b);
        throw;
      }
      memory_ = b.memory, bytes_ = b.bytes, pool_ = pool;
      return;
    }
    std::vector<unsigned char> staging(total);
    std::size_t i = 0;
    (copy_part(staging.data() + offsets_[i++], parts.data(), parts.size_bytes()), ...);
    RINGATTN_CUDA_CHECK(device_malloc(&memory_, staging.size()));
    const cudaError_t e =
        cudaMemcpy(memory_, staging.data(), staging.size(), cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
      cudaFree(memory_);
      memory_ = nullptr;
      RINGATTN_CUDA_CHECK(e);
    }
  }
  ~device_tables() { give_back(); }
  device_tables(device_tables&& o) noexcept
      : memory_(std::exchange(o.memory_, nullptr)), bytes_(o.bytes_),
        pool_(std::exchange(o.pool_, nullptr)), offsets_(std::move(o.offsets_)) {}
  device_tables& operator=(device_tables&& o) noexcept {
    std::swap(memory_, o.memory_);
    std::swap(bytes_, o.bytes_);
    std::swap(pool_, o.pool_);
    std::swap(offsets_, o.offsets_);
    return *this;
  }
  device_tables(const device_tables&) = delete;
  device_tables& operator=(const device_tables&) = delete;

  template <class T>
  T* at(std::size_t i) const {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(memory_) + offsets_.at(i));
  }

private:
  static void copy_part(unsigned char* dst, const void* src, std::size_t n) {
    if (n) std::memcpy(dst, src, n);
  }
  void give_back() noexcept {
    if (!memory_) return;
    if (pool_)
      pool_->release({memory_, bytes_});
    else
      cudaFree(memory_); // a destructor must not throw; nothing useful to report
    memory_ = nullptr;
  }
  void* memory_ = nullptr;
  std::size_t bytes_ = 0;
  table_pool* pool_ = nullptr; // where the memory returns, or null: it is freed
  std::vector<std::size_t> offsets_;
};

} // namespace ringattn::detail
