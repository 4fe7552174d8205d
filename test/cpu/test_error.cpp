#include <ringattn/cuda_check.cuh>
#include <ringattn/error.cuh>

#include <doctest/doctest.h>

#include <string>
#include <thread>

using namespace ringattn;

TEST_CASE("validation keeps the first reason and throws invalid_argument with it") {
  validation v = validation::ok();
  CHECK(v.is_ok());
  v.require(true, "never shown");
  v.require(1 + 1 == 3, "first: ", 42);
  v.require(false, "second");
  CHECK_FALSE(v.is_ok());
  CHECK(v.reason() == "first: 42");
  CHECK_THROWS_WITH_AS(v.throw_if_invalid(), "ringattn: first: 42", invalid_argument);
  CHECK_NOTHROW(validation::ok().throw_if_invalid());
  validation w = validation::ok();
  w.require(validation::fail("inner"));
  CHECK(w.reason() == "inner");
}

TEST_CASE("a failed CUDA call names the call, CUDA's text and name, the rank and the place") {
  try {
    error_rank_scope scope(3);
    RINGATTN_CUDA_CHECK(cudaErrorMemoryAllocation);
    FAIL("no exception");
  } catch (const cuda_error& e) {
    const std::string m = e.what();
    CHECK(m.find("cudaErrorMemoryAllocation") != std::string::npos);
    CHECK(m.find("out of memory") != std::string::npos);
    CHECK(m.find("[rank 3]") != std::string::npos);
    CHECK(m.find("test_error.cpp") != std::string::npos);
    CHECK(e.code() == static_cast<int>(cudaErrorMemoryAllocation));
  }
  CHECK_NOTHROW(RINGATTN_CUDA_CHECK(cudaSuccess));
}

TEST_CASE("the error rank is per thread and restored after its scope") {
  CHECK(current_error_rank() == -1);
  {
    error_rank_scope a(1);
    std::thread([] { CHECK(current_error_rank() == -1); }).join();
    {
      error_rank_scope b(5);
      CHECK(current_error_rank() == 5);
    }
    CHECK(current_error_rank() == 1);
  }
  CHECK(current_error_rank() == -1);
  try {
    RINGATTN_CUDA_CHECK(cudaErrorInvalidValue);
  } catch (const error& e) {
    CHECK(std::string(e.what()).find("[rank") == std::string::npos);
  }
}
