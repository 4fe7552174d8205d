#pragma once
//! \file
//! Library version. The numbers also name the ABI namespace (see config.cuh), so two shared
//! libraries built against different ringattn versions never share kernel symbols.

#define RINGATTN_VERSION_MAJOR 0
#define RINGATTN_VERSION_MINOR 1
#define RINGATTN_VERSION_PATCH 0
//! MAJOR * 10000 + MINOR * 100 + PATCH, for preprocessor comparisons.
#define RINGATTN_VERSION 100

namespace ringattn {
//! The version as numbers, for run-time reports.
struct version_info {
  int major;
  int minor;
  int patch;
};
inline constexpr version_info version{RINGATTN_VERSION_MAJOR, RINGATTN_VERSION_MINOR,
                                      RINGATTN_VERSION_PATCH};
} // namespace ringattn
